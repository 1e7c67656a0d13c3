#include "engine/works/session.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "engine/works/session_work.h"

namespace deft::engine {

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

std::unique_ptr<Work> Session::next_work(Forest& forest) {
  using Kind = SessionCommand::Kind;
  const SequenceTree& tree = forest.tree();
  while (!busy_ && !closing_ && !commands_.empty()) {
    SessionCommand command = std::move(commands_.front());
    commands_.pop_front();
    const auto fail = [&](const absl::Status& status) {
      if (command.kind == Kind::kVerify) {
        command.reply->finish(status);
      } else {
        error(command.request_id, status);
      }
    };
    const auto path_length = [&](NodeId node) {
      return tree.node(node).depth_begin + static_cast<int64_t>(tree.node(node).tokens.size());
    };
    const auto check_leaf = [&](NodeId node, const char* field) -> absl::Status {
      if (absl::Status status = check_node(node, field); !status.ok()) return status;
      if (!tree.node(node).children.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            field, " = ", node, " has ", tree.node(node).children.size(),
            " children; only a leaf can grow (branch it and extend a child)"));
      }
      return absl::OkStatus();
    };
    const auto check_context = [&](int64_t tokens, const char* what) -> absl::Status {
      if (limits_.max_context > 0 && tokens > limits_.max_context) {
        return absl::InvalidArgumentError(absl::StrCat(what, " would reach ", tokens,
                                                       " tokens; the model's context is ",
                                                       limits_.max_context));
      }
      return absl::OkStatus();
    };
    const auto check_room = [&](int64_t new_nodes) -> absl::Status {
      if (num_nodes() + new_nodes > limits_.max_nodes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("session ", id_, " holds ", num_nodes(), " nodes; ", new_nodes,
                         " more would pass the limit of ", limits_.max_nodes,
                         " (prune some first)"));
      }
      return absl::OkStatus();
    };
    absl::Status status = command.invalid;
    if (!status.ok()) {
      fail(status);
      continue;
    }
    switch (command.kind) {
      case Kind::kCreate:
        status = check_room(1);
        if (status.ok())
          status = check_context(static_cast<int64_t>(command.tokens.size()), "the prompt");
        if (status.ok()) {
          busy_ = true;
          return make_prefill_work(shared_from_this(), std::move(command));
        }
        break;
      case Kind::kExtend:
        status = check_leaf(command.node, "extend.node");
        if (status.ok()) {
          status = check_context(path_length(command.node) +
                                     static_cast<int64_t>(command.tokens.size()),
                                 "the extended node");
        }
        if (status.ok()) {
          busy_ = true;
          return make_prefill_work(shared_from_this(), std::move(command));
        }
        break;
      case Kind::kDecode: {
        std::unordered_set<NodeId> seen;
        if (command.nodes.empty()) status = absl::InvalidArgumentError("decode.nodes is empty");
        for (size_t i = 0; i < command.nodes.size() && status.ok(); ++i) {
          const NodeId node = command.nodes[i];
          status = check_leaf(node, "decode.nodes[]");
          if (status.ok() && !seen.insert(node).second) {
            status = absl::InvalidArgumentError(
                absl::StrCat("decode.nodes[", i, "] = ", node, " is listed twice"));
          }
          if (status.ok())
            status = check_context(path_length(node) + command.max_tokens, "a decoded node");
        }
        if (status.ok()) {
          busy_ = true;
          return make_decode_work(shared_from_this(), std::move(command));
        }
        break;
      }
      case Kind::kScore:
        status = check_node(command.node, "score.node");
        if (status.ok()) {
          status = check_context(path_length(command.node) +
                                     static_cast<int64_t>(command.tokens.size()),
                                 "the scored continuation");
        }
        if (status.ok()) {
          busy_ = true;
          return make_score_work(shared_from_this(), std::move(command));
        }
        break;
      case Kind::kVerify:
        status = check_node(command.node, "node");
        if (status.ok()) status = check_room(1);
        if (status.ok()) {
          status = check_context(path_length(command.node) +
                                     static_cast<int64_t>(command.tokens.size()),
                                 "the drafted tree's deepest path");
        }
        if (status.ok()) {
          busy_ = true;
          return make_verify_work(shared_from_this(), std::move(command));
        }
        break;
      case Kind::kBranch:
        branch(command, forest);
        continue;
      case Kind::kPrune:
        prune(command, forest);
        continue;
      case Kind::kClose:
        events_->push({.request_id = command.request_id, .kind = SessionEvent::Kind::kClosed});
        close(forest, absl::OkStatus());
        continue;
    }
    fail(status);
  }
  return nullptr;
}

void Session::branch(const SessionCommand& command, Forest& forest) {
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
    error(command.request_id, status);
    return;
  }
  // The children start where their parent ends: they share its next-token logits.
  const Logits logits = nodes_.at(command.node);
  for (NodeId child : *children) adopt(child, logits);
  events_->push({.request_id = command.request_id,
                 .kind = SessionEvent::Kind::kBranched,
                 .node = command.node,
                 .children = *children});
}

void Session::prune(const SessionCommand& command, Forest& forest) {
  if (absl::Status status = check_node(command.node, "prune.node"); !status.ok()) {
    error(command.request_id, status);
    return;
  }
  // The node and every node of the session below it; KV that others share stays.
  const SequenceTree& tree = forest.tree();
  std::vector<NodeId> dropped;
  for (const auto& [node, logits] : nodes_) {
    for (NodeId at = node; at != -1; at = tree.node(at).parent) {
      if (at == command.node) {
        dropped.push_back(node);
        break;
      }
    }
  }
  for (NodeId node : dropped) nodes_.erase(node);
  for (NodeId node : dropped) forest.release(node);
  events_->push({.request_id = command.request_id,
                 .kind = SessionEvent::Kind::kPruned,
                 .node = command.node});
}

void Session::close(Forest& forest, const absl::Status& status) {
  if (closed_) return;
  closed_ = true;
  closing_ = true;
  for (const auto& [node, logits] : nodes_) forest.release(node);
  nodes_.clear();
  for (SessionCommand& command : commands_) {
    if (command.reply != nullptr) {
      command.reply->finish(absl::AbortedError(absl::StrCat("session ", id_, " closed")));
    }
  }
  commands_.clear();
  events_->finish(status);
}

}  // namespace deft::engine
