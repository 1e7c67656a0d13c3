#include "engine/speculation/speculator.h"

#include <algorithm>

#include "engine/speculation/ngram.h"

namespace deft::engine {

Speculator::Speculator(const SpeculativeOptions* options, std::vector<TokenId> context, bool anchor)
    : options_(options), context_(std::move(context)), anchor_(anchor), tree_(options) {}

void Speculator::place(Forest& draft) {
  draft_ = &draft;
  const PromptPlacement placement = draft.place_prompt(context_);
  node_ = placement.node;
  have_ = placement.shared;
}

void Speculator::release(Forest& draft) {
  drop_draft_entries(draft);
  if (node_ >= 0) draft.release(node_);
  node_ = -1;
  have_ = 0;
  anchor_read_ = false;
}

void Speculator::drop_draft_entries(Forest& draft) {
  for (auto it = draft_created_.rbegin(); it != draft_created_.rend(); ++it) draft.discard(*it);
  draft_created_.clear();
  entry_node_.clear();
  level_rows_.clear();
}

absl::Status Speculator::add_draft_rows(StepContext& draft, int32_t level, int32_t max_depth) {
  const SamplingParams top{.temperature = 0.0f,
                           .top_logprobs = std::clamp(tree_.top_k(), 1, kMaxTopLogprobs)};
  if (level == 0) {
    drop_draft_entries(draft.forest);
    tree_.reset(anchor_ ? max_depth : 0);
    anchor_read_ = false;
    if (node_ < 0) return absl::OkStatus();
    const bool wants_tree = tree_.max_depth() > 0;
    const auto size = static_cast<int64_t>(context_.size());
    SequenceTree& tree = draft.forest.tree();
    if (wants_tree && have_ == size && have_ > tree.node(node_).depth_begin) {
      // Nothing new since a step that drafted but was not run: feed the last token again for
      // its top list.
      if (absl::Status status = tree.truncate(node_, have_ - 1 - tree.node(node_).depth_begin);
          !status.ok()) {
        return status;
      }
      --have_;
    }
    bool ended = false;
    if (!draft
             .add_chunk(node_, context_, &have_, &ended,
                        wants_tree ? StepContext::Logits::kLast : StepContext::Logits::kNone)
             .ok()) {
      return absl::OkStatus();  // the draft pool is short: no tree this step
    }
    if (ended && wants_tree) {
      draft.sample_last_row(top, static_cast<uint64_t>(have_));
      level_rows_.assign(1, -1);
    }
    return absl::OkStatus();
  }
  level_rows_.clear();
  if (!anchor_read_) return absl::OkStatus();
  tree_.expansions(level, &scratch_);
  entry_node_.resize(static_cast<size_t>(tree_.size()), -1);
  for (int32_t entry : scratch_) {
    if (draft.budget < 1) break;
    const int32_t parent = tree_.parents()[static_cast<size_t>(entry)];
    const NodeId under = parent < 0 ? node_ : entry_node_[static_cast<size_t>(parent)];
    if (under < 0) continue;
    absl::StatusOr<NodeId> child = draft.forest.add_child(under);
    if (!child.ok()) break;
    draft_created_.push_back(*child);
    const TokenId token = tree_.tokens()[static_cast<size_t>(entry)];
    if (!draft.add_run(*child, std::span(&token, 1)).ok()) break;  // pool short: a smaller tree
    entry_node_[static_cast<size_t>(entry)] = *child;
    draft.sample_last_row(top, static_cast<uint64_t>(have_ + tree_.depth(entry)));
    level_rows_.push_back(entry);
  }
  return absl::OkStatus();
}

absl::Status Speculator::take_draft_rows(StepContext& draft, int32_t level) {
  (void)level;
  for (int32_t entry : level_rows_) {
    absl::StatusOr<SampledToken> sampled = draft.next_sampled();
    if (!sampled.ok()) return sampled.status();
    tree_.expand(entry, sampled->top_logprobs);
    if (entry < 0) anchor_read_ = true;
  }
  level_rows_.clear();
  return absl::OkStatus();
}

int32_t Speculator::tree_bound() const {
  if (options_->policy == TreePolicy::kNgram) return options_->tree_tokens;
  return std::min(tree_.size(), options_->tree_tokens);
}

absl::Status Speculator::add_tree_rows(StepContext& step, NodeId under,
                                       const SamplingParams& params, uint64_t first_position,
                                       int64_t max_entries, int32_t max_depth) {
  tree_rows_ = 0;
  if (options_->policy == TreePolicy::kNgram) {
    tree_.reset(max_depth);
    std::vector<std::vector<TokenId>> continuations;
    if (tree_.max_depth() > 0) {
      ngram_continuations(context_, options_->top_k, tree_.max_depth(), &continuations);
    }
    for (const std::vector<TokenId>& continuation : continuations) tree_.add_path(continuation);
  } else {
    tree_.finish();
  }
  tree_.truncate(static_cast<int32_t>(std::min<int64_t>(max_entries, tree_.size())));
  if (tree_.size() == 0) return absl::OkStatus();
  // Entry i's row draws the token at its position + 1 (an entry of depth d sits at
  // first_position + d - 1), as plain decoding draws it there.
  absl::Status status = engine::add_tree_rows(
      step, under, tree_.tokens(), tree_.parents(), StepContext::Logits::kLast, &target_rows_,
      [&](size_t entry) {
        step.sample_last_row(
            params,
            first_position + static_cast<uint64_t>(tree_.depth(static_cast<int32_t>(entry))));
        ++tree_rows_;
      });
  return status;
}

absl::Status Speculator::take_tree_rows(StepContext& step, const SampledToken& anchor,
                                        std::vector<SampledToken>* committed) {
  drawn_.assign(1, anchor.token);
  draws_.assign(1, anchor);
  for (int32_t i = 0; i < tree_rows_; ++i) {
    absl::StatusOr<SampledToken> sampled = step.next_sampled();
    if (!sampled.ok()) return sampled.status();
    drawn_.push_back(sampled->token);
    draws_.push_back(*std::move(sampled));
  }
  path_.clear();
  const TokenTree& tree = tree_;
  if (tree_rows_ < tree.size()) tree_.truncate(tree_rows_);
  tree.walk(drawn_, &path_);
  for (int32_t row : path_) committed->push_back(std::move(draws_[static_cast<size_t>(row)]));
  if (tree_rows_ > 0) {
    ++stats_.steps;
    stats_.drafted += tree_rows_;
    stats_.accepted += static_cast<int64_t>(path_.size()) - 1;
  }
  if (tree_rows_ > 0) {
    step.accepted_lengths.push_back(static_cast<int32_t>(path_.size()) - 1);
    step.drafted += tree_rows_;
  }
  drop_tree(step.forest, draft_);
  return absl::OkStatus();
}

void Speculator::drop_tree(Forest& target, Forest* draft) {
  target_rows_.discard(target);
  if (draft != nullptr) drop_draft_entries(*draft);
  tree_.clear();
  tree_rows_ = 0;
  anchor_read_ = false;
}

void Speculator::commit(std::span<const TokenId> tokens) {
  context_.insert(context_.end(), tokens.begin(), tokens.end());
}

}  // namespace deft::engine
