// A Generate job as engine work: n samples from one prompt, i.e. a depth-1 tree. The prompt is
// placed in the forest (sharing any live prefix) and prefilled, in chunks when the step budget
// is short; its last row branches n ways (sample_children), and every step then decodes the
// pending token of every live branch. A finished branch frees its node's pages at once.
//
// Preemption by recompute: preempt() releases every node to the prefix cache and keeps each
// live branch's tokens; on re-admission every live branch is placed again as a prompt of its
// own (prompt + tokens so far: whatever of it is still cached is reused), refilled without
// logits, and decoding goes on from its pending token. Recompute rather than swapping pages
// to host memory: the runner has no page copy, a refill of the uncached part costs one chunked
// prefill (cheap next to the decode steps that made it), and the prefix cache often still
// holds most of it.
//
// Speculative decoding (GenerateJob::speculative): each step a branch verifies a drafted token
// tree after its uncommitted tokens (engine/speculation/speculator.h) and commits the accepted
// path plus the target's next token, the tokens plain decoding would give (same seed, same
// positions). With a draft model, the prompt is fed to the draft while the target prefills it,
// and each branch then keeps its context in the draft forest.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/speculation/speculator.h"
#include "engine/works/event_queue.h"
#include "engine/works/work.h"

namespace deft::engine {

struct GenerateJob {
  std::vector<TokenId> prompt;  // validated: non-empty, ids inside the vocabulary
  int32_t n = 1;                // branches
  int32_t max_tokens = 1;       // per branch
  SamplingParams sampling;      // its stop_token_ids end a branch (reason kStop)
  StreamLimits limits;          // stop strings, ignore_eos, top lists
  Requester requester;          // admission order (engine/scheduler.h)
  // Server-side speculative decoding; null: off.
  std::shared_ptr<const SpeculativeOptions> speculative;
};

struct GenerateEvent {
  int32_t branch = 0;
  TokenDelta delta;
  SpeculationStats speculation;  // the branch's, on its last event (finish set)
};
using GenerateEvents = EventQueue<GenerateEvent>;

class GenerateWork final : public Work {
 public:
  GenerateWork(GenerateJob job, std::shared_ptr<GenerateEvents> events,
               const Tokenizer& tokenizer, int32_t page_tokens);

  int64_t pending_pages(const Forest& forest) const override;
  int64_t max_step_rows() const override;
  int64_t reserve_pages(const Forest& forest) const override;
  int64_t step_pages(const Forest& forest, const StepContext& step) const override;
  bool preemptible() const override { return !finished_; }
  void preempt(Forest& forest) override;
  void start(Forest& forest) override;
  absl::Status add_rows(StepContext& step) override;
  absl::Status take_logits(StepContext& step) override;
  bool finished() const override { return finished_; }
  bool cancelled() const override { return events_->cancelled(); }
  void abort(const absl::Status& status, Forest& forest) override;
  bool needs_draft_model() const override;
  void attach_draft(Forest* draft) override { draft_ = draft; }
  absl::Status add_draft_rows(StepContext& draft, int32_t level) override;
  absl::Status take_draft_rows(StepContext& draft, int32_t level) override;

  // KV pages the job may hold at its peak (admission's worst case).
  static int64_t max_pages(const GenerateJob& job, int32_t page_tokens);

 private:
  struct Branch {
    NodeId node = -1;
    // Committed (streamed) tokens not yet run through the model: the last sampled token, or
    // a speculative step's accepted tokens and the target's next one.
    std::vector<TokenId> unfed;
    uint64_t seed = 0;
    std::unique_ptr<TokenStream> stream;
    bool live = true;
    std::vector<TokenId> fed;     // tokens after the prompt whose KV the node path holds
    std::vector<TokenId> refill;  // after a preemption: prompt + fed, to recompute
    int64_t refilled = 0;         // refill tokens with KV again
    std::unique_ptr<Speculator> speculator;  // with GenerateJob::speculative
  };
  bool refilling() const;
  // Pages the placed prompt's own node still needs (prefill phase).
  int64_t prompt_pages_left(const Forest& forest) const;
  absl::Status add_token(int32_t index, const SampledToken& sampled, Forest& forest);
  // Ends branch `index` after its last token: frees its KV in both forests.
  void end_branch(Branch& branch, Forest& forest);
  // Levels the branch's tree may have: a step commits at most the tokens the length limit
  // leaves, the target's own one among them.
  int32_t tree_depth(const Branch& branch) const;
  // Pages a speculative step adds beyond the branch's uncommitted tokens: its tree's.
  int64_t tree_pages() const;
  bool drafts() const { return draft_ != nullptr && needs_draft_model(); }

  GenerateJob job_;
  std::shared_ptr<GenerateEvents> events_;
  const Tokenizer& tokenizer_;
  int32_t page_tokens_;
  NodeId prompt_node_ = -1;
  int64_t prefilled_ = -1;  // prompt tokens with KV; -1 until placed
  bool in_step_ = false;    // rows were added this step
  std::vector<Branch> branches_;
  int32_t live_branches_ = 0;
  bool finished_ = false;
  Forest* draft_ = nullptr;  // the draft model's forest, when the job drafts with it
  std::unique_ptr<Speculator> prompt_draft_;  // the prompt's draft KV until the job branches
  std::vector<SampledToken> committed_;  // a step's tokens of one branch (storage kept)
};

}  // namespace deft::engine
