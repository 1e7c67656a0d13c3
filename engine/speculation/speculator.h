// One branch's speculative decoding (engine/works/generate_work.h drives it). Each engine step:
//   1. draft passes (engine/speculation/draft_model.h), before the target's rows: pass 0 feeds
//      the draft model the branch's tokens it has not seen (the prompt at first, then the last
//      step's committed tokens) and reads the draft's top list after the last one; pass l >= 1
//      feeds the tree entries of depth l the policy expands (each a one-token node of the draft
//      forest under its parent's) and reads their top lists. The TokenTree grows from these.
//      kNgram needs no draft model: its tree is drafted from the context at step 2.
//   2. the target step: the caller adds the branch's uncommitted tokens (the last of them is the
//      anchor) and then the tree's rows here, each marked to draw the target's token with the
//      branch's sampling params at the entry's position;
//   3. after it, the walk (TokenTree::walk) gives the committed tokens, and every drafted node
//      is discarded, in both forests. The committed tokens' KV is computed again at the next
//      step (as the anchor's run): a few rows more in a step of tree_tokens rows, against
//      keeping the accepted nodes, which would leave each branch a chain of part-filled pages.
// Draft KV is the draft forest's own (a pool beside the target's): a draft step short of pages
// drafts a smaller tree (or none) and the branch decodes plainly, never fails.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/speculation/speculative_options.h"
#include "engine/speculation/token_tree.h"
#include "engine/works/tree_rows.h"
#include "engine/works/work.h"

namespace deft::engine {

// What speculation did, for a request's final message and the metrics.
struct SpeculationStats {
  int64_t steps = 0;     // target steps that verified a tree of this branch
  int64_t drafted = 0;   // tree entries verified
  int64_t accepted = 0;  // of which accepted
};

class Speculator {
 public:
  // `context`: the tokens the branch's next token follows (prompt + committed tokens).
  // `anchor`: false for a prompt drafted before the target branches (catch up only, no tree).
  Speculator(const SpeculativeOptions* options, std::vector<TokenId> context, bool anchor = true);

  // The draft model's side (not called without one). place() holds a node of `draft` for the
  // context (sharing cached KV); release() lets go of it and of this step's draft entries.
  void place(Forest& draft);
  void release(Forest& draft);
  bool placed() const { return node_ >= 0; }

  // Draft pass `level` (step 1 above); `max_depth` (level 0 only) bounds the tree's levels.
  absl::Status add_draft_rows(StepContext& draft, int32_t level, int32_t max_depth);
  absl::Status take_draft_rows(StepContext& draft, int32_t level);

  // Step 2: the tree's rows under `under` (the node the caller just appended the anchor to),
  // at most `max_entries` of them; `first_position` is the position of the anchor's next token.
  // kNgram drafts its tree here, up to `max_depth` levels.
  absl::Status add_tree_rows(StepContext& step, NodeId under, const SamplingParams& params,
                             uint64_t first_position, int64_t max_entries, int32_t max_depth);
  // Entries add_tree_rows() would add at most (pages and rows the scheduler makes room for).
  int32_t tree_bound() const;
  // Step 3: `anchor` is the target's draw at the anchor row; the entries' draws are read from
  // `step` in row order. Appends the committed tokens (at least `anchor`) to `committed`,
  // counts the verified tree in the step's metrics (StepContext::accepted_lengths, drafted)
  // and discards the drafted nodes of both forests.
  absl::Status take_tree_rows(StepContext& step, const SampledToken& anchor,
                              std::vector<SampledToken>* committed);
  // Drops this step's drafted nodes without a verdict (the work skipped the target step, was
  // preempted or ended). `draft` may be null (kNgram).
  void drop_tree(Forest& target, Forest* draft);

  // The branch committed `tokens` (the draft catches up on them next step).
  void commit(std::span<const TokenId> tokens);
  std::span<const TokenId> context() const { return context_; }

  const SpeculationStats& stats() const { return stats_; }

 private:
  void drop_draft_entries(Forest& draft);

  const SpeculativeOptions* options_;
  std::vector<TokenId> context_;
  bool anchor_;
  TokenTree tree_;
  // Draft forest side.
  Forest* draft_ = nullptr;
  NodeId node_ = -1;  // holds context_[0, have_)
  int64_t have_ = 0;
  bool anchor_read_ = false;           // pass 0 read the anchor's top list this step
  std::vector<int32_t> level_rows_;    // entries whose rows the current pass added
  std::vector<NodeId> entry_node_;     // per entry: its draft node (-1: not fed)
  std::vector<NodeId> draft_created_;  // draft nodes of this step's entries
  std::vector<int32_t> scratch_;
  // Target side.
  TreeRows target_rows_;
  int32_t tree_rows_ = 0;  // entries whose rows are in the target step
  std::vector<TokenId> drawn_;
  std::vector<SampledToken> draws_;
  std::vector<int32_t> path_;
  SpeculationStats stats_;
};

}  // namespace deft::engine
