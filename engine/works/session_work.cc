#include "engine/works/session_work.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/works/verify_work.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

using Logits = Session::Logits;

Logits copy_row(std::span<const float> row) {
  return std::make_shared<const std::vector<float>>(row.begin(), row.end());
}

// create (a new node for a prompt, sharing any live prefix) and extend (a run appended to a
// leaf): prefilled in chunks under the step budget; the node keeps the last row's logits.
class PrefillWork final : public SessionWork {
 public:
  PrefillWork(std::shared_ptr<Session> session, uint64_t request_id, CreateCommand create)
      : SessionWork(std::move(session), request_id),
        create_(true),
        tokens_(std::move(create.prompt)) {}
  PrefillWork(std::shared_ptr<Session> session, uint64_t request_id, ExtendCommand extend)
      : SessionWork(std::move(session), request_id),
        create_(false),
        extend_node_(extend.node),
        tokens_(std::move(extend.tokens)) {}

  int64_t pending_pages(const Forest& forest) const override {
    const auto total = static_cast<int64_t>(tokens_.size());
    if (node_ < 0) {
      if (create_) return pages_for(total, session_->page_tokens());
      const TreeNode& node = forest.tree().node(extend_node_);
      return pages_for(static_cast<int64_t>(node.tokens.size()) + total, session_->page_tokens()) -
             forest.node_pages(extend_node_);
    }
    const TreeNode& node = forest.tree().node(node_);
    return pages_for(static_cast<int64_t>(node.tokens.size()) + total - next_,
                     session_->page_tokens()) -
           forest.node_pages(node_);
  }
  int64_t max_step_rows() const override { return 1; }
  int64_t step_pages(const Forest& forest, const StepContext& step) const override {
    return forest.append_pages(node_,
                               step.chunk_rows(static_cast<int64_t>(tokens_.size()) - next_));
  }

  void start(Forest& forest) override {
    if (create_) {
      const PromptPlacement placement = forest.place_prompt(tokens_);
      node_ = placement.node;
      next_ = placement.shared;
    } else {
      node_ = extend_node_;
      next_ = 0;
    }
  }

  absl::Status add_rows(StepContext& step) override {
    return step.add_chunk(node_, tokens_, &next_, &in_step_);
  }

  absl::Status take_logits(StepContext& step) override {
    if (!in_step_) return absl::OkStatus();
    Logits logits = copy_row(step.next_logits());
    SessionEvent event{.request_id = request_id_, .node = node_};
    if (create_) {
      session_->adopt(node_, std::move(logits));  // the placement's hold becomes the session's
      event.kind = SessionEvent::Kind::kCreated;
    } else {
      session_->set_logits(node_, std::move(logits));
      const TreeNode& node = step.forest.tree().node(node_);
      event.kind = SessionEvent::Kind::kExtended;
      event.length = node.depth_begin + static_cast<int64_t>(node.tokens.size());
    }
    session_->events().push(std::move(event));
    done();
    return absl::OkStatus();
  }

 protected:
  void release_held(Forest& forest) override {
    // A created node not yet handed to the session; an extended node keeps its new tokens
    // (their KV is valid, but its logits are stale: drop them by truncating the run).
    if (create_) {
      if (node_ >= 0) forest.release(node_);
    } else if (node_ >= 0 && next_ > 0 && forest.tree().contains(node_)) {
      const TreeNode& node = forest.tree().node(node_);
      (void)forest.tree().truncate(node_, static_cast<int64_t>(node.tokens.size()) - next_);
    }
  }

 private:
  bool create_;  // create: a new node for the prompt; extend: a run onto extend_node_
  NodeId extend_node_ = -1;
  std::vector<TokenId> tokens_;  // the prompt or the appended run
  NodeId node_ = -1;
  int64_t next_ = 0;  // tokens of the run appended so far (create: from the shared prefix)
  bool in_step_ = false;
};

// decode: every listed leaf generates in place, all in the same steps. A node's first token is
// sampled here from the node's kept logits; each step then runs the node's newest token and its
// row samples the next one (on the device when the runner can: no logits row comes back). The
// row that runs a node's last token asks for its logits instead, which the node keeps, so the
// node's KV and logits cover all its tokens when the decode ends.
class DecodeWork final : public SessionWork {
 public:
  DecodeWork(std::shared_ptr<Session> session, uint64_t request_id, DecodeCommand command)
      : SessionWork(std::move(session), request_id), command_(std::move(command)) {
    for (NodeId node : command_.nodes) {
      nodes_.push_back({.node = node,
                        .seed = branch_seed(command_.sampling.seed, static_cast<uint64_t>(node)),
                        .stream = std::make_unique<TokenStream>(session_->tokenizer(),
                                                                &command_.limits)});
    }
  }

  int64_t pending_pages(const Forest& forest) const override {
    int64_t pending = 0;
    for (const Live& live : nodes_) {
      if (live.done) continue;
      const TreeNode& node = forest.tree().node(live.node);
      // Tokens sampled but not yet run count as generated and still need their KV.
      const int64_t left =
          command_.max_tokens - live.stream->generated() + static_cast<int64_t>(live.unfed.size());
      pending +=
          pages_for(static_cast<int64_t>(node.tokens.size()) + left, session_->page_tokens()) -
          forest.node_pages(live.node) + tree_pages();
    }
    return std::max<int64_t>(pending, 0);
  }
  int64_t max_step_rows() const override {
    const int64_t per_node = command_.speculative == nullptr ? 1 : command_.speculative->depth + 1;
    return static_cast<int64_t>(nodes_.size()) * per_node;
  }
  // Every live node's uncommitted tokens (one at first) and its tree (add_rows below), or
  // nothing when the budget is short.
  int64_t step_pages(const Forest& forest, const StepContext& step) const override {
    const int64_t rows = unfed_rows();
    if (step.budget < rows) return 0;
    int64_t pages = 0;
    for (const Live& node : nodes_) {
      if (node.done) continue;
      pages += forest.append_pages(node.node,
                                   std::max<int64_t>(1, static_cast<int64_t>(node.unfed.size())));
      if (node.speculator != nullptr && step.speculate) pages += node.speculator->tree_bound();
    }
    return pages;
  }

  bool needs_draft_model() const override {
    return command_.speculative != nullptr && command_.speculative->policy != TreePolicy::kNgram;
  }
  void attach_draft(Forest* draft) override { draft_ = draft; }
  // Each node's speculator starts from the node's whole context (its path's tokens).
  void start(Forest& forest) override {
    if (command_.speculative == nullptr) return;
    for (Live& live : nodes_) {
      std::vector<TokenId> context;
      absl::StatusOr<std::vector<NodeId>> path = forest.tree().path(live.node);
      if (path.ok()) {
        for (NodeId id : *path) {
          const NodeTokens& tokens = forest.tree().node(id).tokens;
          context.insert(context.end(), tokens.begin(), tokens.end());
        }
      }
      live.speculator =
          std::make_unique<Speculator>(command_.speculative.get(), std::move(context));
      // Placed between steps: a placement may split draft nodes.
      if (draft_ != nullptr && needs_draft_model()) live.speculator->place(*draft_);
    }
  }
  absl::Status add_draft_rows(StepContext& draft, int32_t level) override {
    if (session_->events().backlogged()) return absl::OkStatus();
    for (Live& live : nodes_) {
      // The node's first token comes from its kept logits at add_rows: trees start after it.
      if (live.done || live.ending || live.speculator == nullptr || live.unfed.empty()) continue;
      if (absl::Status status =
              live.speculator->add_draft_rows(draft, level, level == 0 ? tree_depth(live) : 0);
          !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }
  absl::Status take_draft_rows(StepContext& draft, int32_t level) override {
    for (Live& live : nodes_) {
      if (live.done || live.ending || live.speculator == nullptr || live.unfed.empty()) continue;
      if (absl::Status status = live.speculator->take_draft_rows(draft, level); !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }

  absl::Status add_rows(StepContext& step) override {
    in_step_ = false;
    // Paused while the client reads slowly (engine/works/event_queue.h).
    if (session_->events().backlogged()) return absl::OkStatus();
    const int64_t rows = unfed_rows();
    if (rows == 0 || step.budget < rows) return absl::OkStatus();
    int64_t later = rows;  // rows of this node and the ones after it, kept for them
    for (Live& live_node : nodes_) {
      if (live_node.done) continue;
      if (live_node.unfed.empty()) {  // the decode's first step: from the node's kept logits
        const TreeNode& node = step.forest.tree().node(live_node.node);
        absl::StatusOr<SampledToken> sampled =
            step.sampler.sample(*session_->node_logits(live_node.node), params_of(live_node),
                                static_cast<uint64_t>(node.depth_begin + node.tokens.size()));
        if (!sampled.ok()) return sampled.status();
        take_token(live_node, *sampled, step);
        if (live_node.speculator != nullptr) live_node.speculator->commit(live_node.unfed);
      }
      later -= static_cast<int64_t>(live_node.unfed.size());
      if (absl::Status status = step.add_run(live_node.node, live_node.unfed); !status.ok()) {
        return status;
      }
      live_node.unfed.clear();
      if (!live_node.ending) {
        const TreeNode& node = step.forest.tree().node(live_node.node);
        const auto position = static_cast<uint64_t>(node.depth_begin + node.tokens.size());
        step.sample_last_row(params_of(live_node), position);
        if (live_node.speculator != nullptr && step.speculate) {
          if (absl::Status status = live_node.speculator->add_tree_rows(
                  step, live_node.node, params_of(live_node), position, step.budget - later,
                  tree_depth(live_node));
              !status.ok()) {
            return status;
          }
        }
      }
    }
    in_step_ = true;
    return absl::OkStatus();
  }

  absl::Status take_logits(StepContext& step) override {
    if (!in_step_) return absl::OkStatus();
    bool all_done = true;
    std::vector<SampledToken>& committed = committed_;
    for (Live& live_node : nodes_) {
      if (live_node.done) continue;
      if (live_node.ending) {
        session_->set_logits(live_node.node, copy_row(step.next_logits()));
        live_node.done = true;
        release_speculator(live_node, step.forest);
        continue;
      }
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      committed.clear();
      if (live_node.speculator != nullptr) {
        if (absl::Status status = live_node.speculator->take_tree_rows(step, *sampled, &committed);
            !status.ok()) {
          return status;
        }
      } else {
        committed.push_back(*std::move(sampled));
      }
      for (const SampledToken& token : committed) {
        take_token(live_node, token, step);
        if (live_node.ending) break;
      }
      if (live_node.speculator != nullptr && !live_node.ending) {
        live_node.speculator->commit(live_node.unfed);
      }
      all_done = false;
    }
    if (all_done) done();
    return absl::OkStatus();
  }

 protected:
  void release_held(Forest& forest) override {
    for (Live& live_node : nodes_) {
      release_speculator(live_node, forest);
      // A node that never streamed a token (the decode was refused or ended before its first
      // step) is untouched: no finish of its own, its logits kept; the error answers the command.
      if (live_node.done || live_node.stream->generated() == 0) continue;
      // The node ran tokens whose logits never came back: it has none until extended.
      session_->set_logits(live_node.node, nullptr);
      session_->events().push({.request_id = request_id_,
                               .kind = SessionEvent::Kind::kDecoded,
                               .node = live_node.node,
                               .delta = live_node.stream->end(FinishReason::kCancelled)});
    }
  }

 private:
  struct Live {
    NodeId node = -1;
    uint64_t seed = 0;
    std::unique_ptr<TokenStream> stream;
    // Sampled and streamed tokens not yet run (the newest sampled token, or a speculative
    // step's accepted tokens and the target's next one); empty before the first step.
    std::vector<TokenId> unfed;
    bool ending = false;  // the last of `unfed` ends the node's stream: its row keeps the logits
    bool done = false;
    std::unique_ptr<Speculator> speculator;  // with DecodeCommand::speculative
  };

  SamplingParams params_of(const Live& live) const {
    SamplingParams params = command_.sampling;
    params.seed = live.seed;
    return params;
  }
  int64_t tree_pages() const {
    return command_.speculative == nullptr ? 0 : command_.speculative->tree_tokens;
  }
  int32_t tree_depth(const Live& live) const {
    if (command_.speculative == nullptr) return 0;
    return std::min(command_.speculative->depth,
                    command_.max_tokens - live.stream->generated() - 1);
  }
  // Rows the live nodes' uncommitted tokens take (one for a node's first token).
  int64_t unfed_rows() const {
    int64_t rows = 0;
    for (const Live& node : nodes_) {
      if (!node.done) rows += std::max<int64_t>(1, static_cast<int64_t>(node.unfed.size()));
    }
    return rows;
  }
  void release_speculator(Live& live, Forest& forest) {
    if (live.speculator == nullptr) return;
    live.speculator->drop_tree(forest, draft_);
    if (draft_ != nullptr) live.speculator->release(*draft_);
  }

  // Streams a sampled token; it runs in the node's next step.
  void take_token(Live& live, const SampledToken& sampled, StepContext& step) {
    TokenDelta delta =
        live.stream->add(sampled, live.stream->generated() + 1 >= command_.max_tokens);
    live.unfed.push_back(sampled.token);
    live.ending = delta.finish != FinishReason::kNone;
    ++step.generated;
    SessionEvent event{.request_id = request_id_,
                       .kind = SessionEvent::Kind::kDecoded,
                       .node = live.node,
                       .delta = std::move(delta)};
    if (live.ending && live.speculator != nullptr) event.speculation = live.speculator->stats();
    session_->events().push(std::move(event));
  }

  DecodeCommand command_;
  std::vector<Live> nodes_;
  bool in_step_ = false;
  Forest* draft_ = nullptr;
  std::vector<SampledToken> committed_;  // a step's tokens of one node (storage kept)
};

// score: the continuation runs under a temporary child of the node (its KV freed at the end);
// token i's log-probability comes from the row before it (the node's own logits for i = 0).
class ScoreWork final : public SessionWork {
 public:
  ScoreWork(std::shared_ptr<Session> session, uint64_t request_id, ScoreCommand command)
      : SessionWork(std::move(session), request_id), command_(std::move(command)) {}

  int64_t pending_pages(const Forest& forest) const override {
    const auto total = static_cast<int64_t>(command_.continuation.size());
    if (child_ < 0) return pages_for(total, session_->page_tokens());
    return pages_for(total, session_->page_tokens()) - forest.node_pages(child_);
  }
  int64_t max_step_rows() const override { return 1; }
  int64_t step_pages(const Forest& forest, const StepContext& step) const override {
    const auto total = static_cast<int64_t>(command_.continuation.size());
    const int64_t count = std::min(total - 1 - next_, step.budget);
    if (count <= 0) return 0;
    return child_ < 0 ? pages_for(count, session_->page_tokens())
                      : forest.append_pages(child_, count);
  }

  absl::Status add_rows(StepContext& step) override {
    rows_ = 0;
    if (child_ < 0) {
      absl::StatusOr<NodeId> child = step.forest.add_child(command_.node);
      if (!child.ok()) return child.status();
      child_ = *child;
      const std::vector<float>& logits = *session_->node_logits(command_.node);
      logprobs_.push_back(raw_logprob(logits, command_.continuation[0]));
    }
    // Every token but the last needs its row's logits (for the next token's log-probability).
    const auto total = static_cast<int64_t>(command_.continuation.size());
    const int64_t count = std::min(total - 1 - next_, step.budget);
    if (count <= 0) {
      if (next_ == total - 1) finish_score(step.forest);
      return absl::OkStatus();
    }
    if (absl::Status status =
            step.add_run(child_, std::span(command_.continuation).subspan(next_, count),
                         StepContext::Logits::kAll);
        !status.ok()) {
      return status;
    }
    step.prompt_rows += count;
    rows_ = count;
    return absl::OkStatus();
  }

  absl::Status take_logits(StepContext& step) override {
    for (int64_t i = 0; i < rows_; ++i) {
      ++next_;
      logprobs_.push_back(raw_logprob(step.next_logits(), command_.continuation[next_]));
    }
    rows_ = 0;
    if (next_ == static_cast<int64_t>(command_.continuation.size()) - 1) {
      finish_score(step.forest);
    }
    return absl::OkStatus();
  }

 protected:
  void release_held(Forest& forest) override {
    // A hypothetical continuation: its KV is freed, not cached.
    if (child_ >= 0) forest.discard(child_);
    child_ = -1;
  }

 private:
  void finish_score(Forest& forest) {
    if (finished_) return;
    release_held(forest);
    double total = 0.0;
    for (float logprob : logprobs_) total += logprob;
    session_->events().push({.request_id = request_id_,
                             .kind = SessionEvent::Kind::kScored,
                             .node = command_.node,
                             .logprob = total,
                             .token_logprobs = std::move(logprobs_)});
    done();
  }

  ScoreCommand command_;
  NodeId child_ = -1;
  int64_t next_ = 0;  // continuation tokens run so far
  int64_t rows_ = 0;  // rows added this step
  std::vector<float> logprobs_;
};

}  // namespace

void SessionWork::abort(const absl::Status& status, Forest& forest) {
  release_held(forest);
  answer_error(status);
  finished_ = true;
  session_->command_done();
}

float raw_logprob(std::span<const float> logits, TokenId token) {
  float max_logit = -INFINITY;
  for (float logit : logits) max_logit = std::max(max_logit, logit);
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - max_logit);
  return static_cast<float>(static_cast<double>(logits[token]) - max_logit - std::log(sum));
}

std::unique_ptr<Work> make_session_work(std::shared_ptr<Session> session, SessionCommand command) {
  const uint64_t request_id = command.request_id;
  if (auto* create = std::get_if<CreateCommand>(&command.op)) {
    return std::make_unique<PrefillWork>(std::move(session), request_id, std::move(*create));
  }
  if (auto* extend = std::get_if<ExtendCommand>(&command.op)) {
    return std::make_unique<PrefillWork>(std::move(session), request_id, std::move(*extend));
  }
  if (auto* decode = std::get_if<DecodeCommand>(&command.op)) {
    return std::make_unique<DecodeWork>(std::move(session), request_id, std::move(*decode));
  }
  if (auto* score = std::get_if<ScoreCommand>(&command.op)) {
    return std::make_unique<ScoreWork>(std::move(session), request_id, std::move(*score));
  }
  if (auto* verify = std::get_if<VerifyCommand>(&command.op)) {
    return make_verify_work(std::move(session), request_id, std::move(*verify));
  }
  DEFT_FAIL("session %llu, request %llu: command %zu runs in the session, not as a work",
            static_cast<unsigned long long>(session->id()),
            static_cast<unsigned long long>(request_id), command.op.index());
}

}  // namespace deft::engine
