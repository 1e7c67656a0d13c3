// Entries are laid out as engine/works/tree_rows.h lays out drafted trees (a chain of entries
// shares one node), so the accepted path ends inside at most one node, which is truncated.
#include "engine/works/verify_work.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/draft_acceptance.h"
#include "engine/works/session_work.h"
#include "engine/works/tree_rows.h"

namespace deft::engine {
namespace {

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

class VerifyWork final : public SessionWork {
 public:
  VerifyWork(std::shared_ptr<Session> session, uint64_t request_id, VerifyCommand command)
      : SessionWork(std::move(session), request_id), command_(std::move(command)) {}

  // At worst every entry starts a node.
  int64_t pending_pages(const Forest& forest) const override {
    (void)forest;
    if (in_step_ || finished_) return 0;
    return static_cast<int64_t>(command_.tokens.size()) *
           pages_for(1, session_->page_tokens());
  }
  int64_t max_step_rows() const override { return static_cast<int64_t>(command_.tokens.size()); }
  // A Verify RPC whose client gave up (cancel, deadline) before its step is dropped: nothing is
  // committed. Once its step ran, the outcome stands (a reply may then go unread).
  bool cancelled() const override {
    return SessionWork::cancelled() ||
           (!in_step_ && command_.reply != nullptr && command_.reply->cancelled());
  }

  absl::Status add_rows(StepContext& step) override {
    const size_t n = command_.tokens.size();
    if (in_step_ || step.budget < static_cast<int64_t>(n)) return absl::OkStatus();
    if (absl::Status status =
            add_tree_rows(step, command_.node, command_.tokens, command_.parents,
                          StepContext::Logits::kAll, &rows_);
        !status.ok()) {
      return status;
    }
    step.prompt_rows += static_cast<int64_t>(n);
    in_step_ = true;
    return absl::OkStatus();
  }

  absl::Status take_logits(StepContext& step) override {
    if (!in_step_) return absl::OkStatus();
    const size_t n = command_.tokens.size();
    // Row spans, not a copy: the step's logits stay valid until this work returns.
    std::vector<std::span<const float>> logits(n + 1);
    logits[0] = *session_->node_logits(command_.node);
    for (size_t i = 0; i < n; ++i) logits[i + 1] = step.next_logits();
    const TreeNode& anchor_node = step.forest.tree().node(command_.node);
    const auto first_position =
        static_cast<uint64_t>(anchor_node.depth_begin + anchor_node.tokens.size());
    const DraftTree tree{.tokens = command_.tokens,
                         .parents = command_.parents,
                         .draft_probs = command_.draft_probs,
                         .distributions = command_.draft_distributions,
                         .draft_sampling = command_.draft_sampling};
    absl::StatusOr<Acceptance> acceptance =
        accept_draft_tree(tree, logits, step.vocab_size, command_.sampling, first_position);
    if (!acceptance.ok()) return acceptance.status();

    VerifyOutcome outcome;
    outcome.bonus_token = acceptance->bonus_token;
    outcome.accepted_entries = acceptance->accepted_entries;
    for (int32_t entry : acceptance->accepted_entries) {
      outcome.accepted.push_back(command_.tokens[static_cast<size_t>(entry)]);
    }
    // Keep the accepted path: release every drafted node (the path's stay alive through the
    // last one, which the session adopts), then cut the last node after the accepted entry.
    Forest& forest = step.forest;
    outcome.node = command_.node;
    if (!acceptance->accepted_entries.empty()) {
      const auto last = static_cast<size_t>(acceptance->accepted_entries.back());
      const NodeId leaf = rows_.node_of[last];
      forest.hold(leaf);
      release_held(forest);
      if (absl::Status status = forest.tree().truncate(leaf, rows_.index_of[last] + 1); !status.ok()) {
        return status;
      }
      const std::span<const float> row = logits[last + 1];
      session_->adopt(leaf, std::make_shared<const std::vector<float>>(row.begin(), row.end()));
      outcome.node = leaf;
    } else {
      release_held(forest);
    }
    if (command_.reply != nullptr) {
      command_.reply->push(std::move(outcome));
      command_.reply->finish(absl::OkStatus());
    } else {
      session_->events().push({.request_id = request_id_,
                               .kind = SessionEvent::Kind::kVerified,
                               .verified = std::move(outcome)});
    }
    in_step_ = false;
    done();
    return absl::OkStatus();
  }

 protected:
  void release_held(Forest& forest) override {
    // Children before parents, so each discard frees its node at once. Rejected entries are
    // discarded, not cached: one token and one page each, they would push useful prefixes out.
    rows_.discard(forest);
  }
  void answer_error(const absl::Status& status) override {
    if (command_.reply != nullptr) {
      command_.reply->finish(status);
    } else {
      SessionWork::answer_error(status);
    }
  }

 private:
  VerifyCommand command_;
  TreeRows rows_;  // the drafted entries' nodes (engine/works/tree_rows.h)
  bool in_step_ = false;
};

}  // namespace

std::unique_ptr<Work> make_verify_work(std::shared_ptr<Session> session, uint64_t request_id,
                                       VerifyCommand command) {
  return std::make_unique<VerifyWork>(std::move(session), request_id, std::move(command));
}

}  // namespace deft::engine
