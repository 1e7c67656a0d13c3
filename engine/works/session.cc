#include "engine/works/session.h"

#include <algorithm>
#include <functional>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace deft::engine {
namespace {

// Tokens on the path from the root to the end of `node`.
int64_t path_length(const SequenceTree& tree, NodeId node) {
  return tree.node(node).depth_begin + static_cast<int64_t>(tree.node(node).tokens.size());
}

}  // namespace

Session::Session(uint64_t id, std::shared_ptr<SessionEvents> events, const SessionLimits& limits,
                 const Tokenizer& tokenizer, int32_t page_tokens)
    : id_(id),
      events_(std::move(events)),
      limits_(limits),
      tokenizer_(tokenizer),
      page_tokens_(page_tokens) {}

absl::Status Session::check_node(NodeId node, const char* field) const {
  if (has_node(node)) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat(field, " = ", node, ": session ", id_, " has no such node (pruned or never "
                   "created)"));
}

void Session::error(uint64_t request_id, const absl::Status& status) {
  events_->push({.request_id = request_id, .kind = SessionEvent::Kind::kError, .error = status});
}

void Session::fail(const SessionCommand& command, const absl::Status& status) {
  if (const std::shared_ptr<VerifyReply> reply = command.verify_reply(); reply != nullptr) {
    reply->finish(status);
  } else {
    error(command.request_id, status);
  }
}

std::optional<SessionCommand> Session::next_command(Forest& forest) {
  const SequenceTree& tree = forest.tree();
  // A client that does not read its answers: no new command starts until it has taken them
  // (engine/works/event_queue.h).
  if (events_->backlogged()) return std::nullopt;
  while (!busy_ && !closing_ && !commands_.empty()) {
    SessionCommand command = std::move(commands_.front());
    commands_.pop_front();
    if (command.counted) events_->inflow_taken();
    absl::Status status = command.invalid;
    if (const std::shared_ptr<VerifyReply> reply = command.verify_reply();
        reply != nullptr && reply->cancelled()) {
      status = absl::CancelledError("the client gave up on the verify before it ran");
    }
    if (!status.ok()) {
      fail(command, status);
      continue;
    }
    if (const auto* create = std::get_if<CreateCommand>(&command.op)) {
      status = check(*create);
    } else if (const auto* extend = std::get_if<ExtendCommand>(&command.op)) {
      status = check(*extend, tree);
    } else if (const auto* decode = std::get_if<DecodeCommand>(&command.op)) {
      status = check(*decode, tree);
    } else if (const auto* score = std::get_if<ScoreCommand>(&command.op)) {
      status = check(*score, tree);
    } else if (const auto* verify = std::get_if<VerifyCommand>(&command.op)) {
      status = check(*verify, tree);
    } else if (const auto* branch = std::get_if<BranchCommand>(&command.op)) {
      this->branch(command.request_id, *branch, forest);
      continue;
    } else if (const auto* prune = std::get_if<PruneCommand>(&command.op)) {
      this->prune(command.request_id, *prune, forest);
      continue;
    } else {  // CloseCommand
      events_->push({.request_id = command.request_id, .kind = SessionEvent::Kind::kClosed});
      close(forest, absl::OkStatus());
      continue;
    }
    if (!status.ok()) {
      fail(command, status);
      continue;
    }
    busy_ = true;
    return command;
  }
  return std::nullopt;
}

absl::Status Session::check_leaf(NodeId node, const char* field, const SequenceTree& tree) const {
  if (absl::Status status = check_node(node, field); !status.ok()) return status;
  if (!tree.node(node).children.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, " = ", node, " has ", tree.node(node).children.size(),
                     " children; only a leaf can grow (branch it and extend a child)"));
  }
  return absl::OkStatus();
}

absl::Status Session::check_logits(NodeId node, const char* field) const {
  if (nodes_.at(node) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, " = ", node,
                     " has no next-token logits (a decode of it failed part way); extend it "
                     "or prune it"));
  }
  return absl::OkStatus();
}

absl::Status Session::check_context(int64_t tokens, const char* what) const {
  if (limits_.max_context > 0 && tokens > limits_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " would reach ", tokens, " tokens; the model's context is ", limits_.max_context));
  }
  return absl::OkStatus();
}

absl::Status Session::check_room(int64_t new_nodes) const {
  if (num_nodes() + new_nodes > limits_.max_nodes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session ", id_, " holds ", num_nodes(), " nodes; ", new_nodes,
                     " more would pass the limit of ", limits_.max_nodes, " (prune some first)"));
  }
  return absl::OkStatus();
}

absl::Status Session::check(const CreateCommand& create) const {
  if (absl::Status status = check_room(1); !status.ok()) return status;
  return check_context(static_cast<int64_t>(create.prompt.size()), "the prompt");
}

absl::Status Session::check(const ExtendCommand& extend, const SequenceTree& tree) const {
  if (absl::Status status = check_leaf(extend.node, "extend.node", tree); !status.ok()) {
    return status;
  }
  return check_context(path_length(tree, extend.node) + static_cast<int64_t>(extend.tokens.size()),
                       "the extended node");
}

absl::Status Session::check(const DecodeCommand& decode, const SequenceTree& tree) const {
  if (decode.nodes.empty()) return absl::InvalidArgumentError("decode.nodes is empty");
  std::unordered_set<NodeId> seen;
  for (size_t i = 0; i < decode.nodes.size(); ++i) {
    const NodeId node = decode.nodes[i];
    if (absl::Status status = check_leaf(node, "decode.nodes[]", tree); !status.ok()) {
      return status;
    }
    if (absl::Status status = check_logits(node, "decode.nodes[]"); !status.ok()) return status;
    if (!seen.insert(node).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode.nodes[", i, "] = ", node, " is listed twice"));
    }
    if (absl::Status status =
            check_context(path_length(tree, node) + decode.max_tokens, "a decoded node");
        !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status Session::check(const ScoreCommand& score, const SequenceTree& tree) const {
  if (absl::Status status = check_node(score.node, "score.node"); !status.ok()) return status;
  if (absl::Status status = check_logits(score.node, "score.node"); !status.ok()) return status;
  return check_context(
      path_length(tree, score.node) + static_cast<int64_t>(score.continuation.size()),
      "the scored continuation");
}

absl::Status Session::check(const VerifyCommand& verify, const SequenceTree& tree) const {
  if (absl::Status status = check_node(verify.node, "node"); !status.ok()) return status;
  if (absl::Status status = check_logits(verify.node, "node"); !status.ok()) return status;
  if (absl::Status status = check_room(1); !status.ok()) return status;
  return check_context(path_length(tree, verify.node) + static_cast<int64_t>(verify.tokens.size()),
                       "the drafted tree's deepest path");
}

void Session::branch(uint64_t request_id, const BranchCommand& command, Forest& forest) {
  absl::Status status = check_node(command.node, "branch.node");
  if (status.ok() && (command.k < 1 || command.k > limits_.max_branches)) {
    status = absl::InvalidArgumentError(absl::StrCat("branch.k = ", command.k, " must be in [1, ",
                                                     limits_.max_branches, "] (max_branches)"));
  }
  if (status.ok() && num_nodes() + command.k > limits_.max_nodes) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("session ", id_, " holds ", num_nodes(), " nodes; ", command.k,
                     " more would pass the limit of ", limits_.max_nodes, " (prune some first)"));
  }
  absl::StatusOr<std::vector<NodeId>> children;
  if (status.ok()) {
    children = forest.branch(command.node, command.k);
    status = children.status();
  }
  if (!status.ok()) {
    error(request_id, status);
    return;
  }
  // The children start where their parent ends: they share its next-token logits.
  const Logits logits = nodes_.at(command.node);
  for (NodeId child : *children) adopt(child, logits);
  events_->push({.request_id = request_id,
                 .kind = SessionEvent::Kind::kBranched,
                 .node = command.node,
                 .children = *children});
}

void Session::prune(uint64_t request_id, const PruneCommand& command, Forest& forest) {
  if (absl::Status status = check_node(command.node, "prune.node"); !status.ok()) {
    error(request_id, status);
    return;
  }
  // The node and every node of the session below it; KV that others share stays.
  const SequenceTree& tree = forest.tree();
  std::vector<std::pair<int32_t, NodeId>> dropped;  // (distance below command.node, node)
  for (const auto& [node, logits] : nodes_) {
    int32_t distance = 0;
    for (NodeId at = node; at != -1; at = tree.node(at).parent, ++distance) {
      if (at == command.node) {
        dropped.push_back({distance, node});
        break;
      }
    }
  }
  for (const auto& [distance, node] : dropped) nodes_.erase(node);
  // A pruned node's KV is freed at once (DESIGN.md §4), not cached: the deepest nodes first,
  // so each node is unreferenced, and freed, when its turn comes.
  std::sort(dropped.begin(), dropped.end(), std::greater<>());
  for (const auto& [distance, node] : dropped) forest.discard(node);
  events_->push(
      {.request_id = request_id, .kind = SessionEvent::Kind::kPruned, .node = command.node});
}

void Session::close(Forest& forest, const absl::Status& status) {
  if (closed_) return;
  closed_ = true;
  closing_ = true;
  for (const auto& [node, logits] : nodes_) forest.release(node);
  nodes_.clear();
  for (const SessionCommand& command : commands_) {
    if (command.counted) events_->inflow_taken();
    if (const std::shared_ptr<VerifyReply> reply = command.verify_reply(); reply != nullptr) {
      reply->finish(
          absl::NotFoundError(absl::StrCat("session ", id_, " closed before the verify ran")));
    }
  }
  commands_.clear();
  events_->finish(status);
}

}  // namespace deft::engine
