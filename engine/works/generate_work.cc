#include "engine/works/generate_work.h"

#include <algorithm>
#include <limits>

#include "engine/works/child_sampling.h"

namespace deft::engine {
namespace {

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

}  // namespace

GenerateWork::GenerateWork(GenerateJob job, std::shared_ptr<GenerateEvents> events,
                           const Tokenizer& tokenizer, int32_t page_tokens)
    : job_(std::move(job)),
      events_(std::move(events)),
      tokenizer_(tokenizer),
      page_tokens_(page_tokens) {
  requester = job_.requester;
}

int64_t GenerateWork::max_pages(const GenerateJob& job, int32_t page_tokens) {
  return pages_for(static_cast<int64_t>(job.prompt.size()), page_tokens) +
         int64_t{job.n} * pages_for(job.max_tokens, page_tokens);
}

// A speculative step runs at least the branches' uncommitted tokens (up to depth + 1 each); its
// trees take what the budget leaves.
int64_t GenerateWork::max_step_rows() const {
  return job_.speculative == nullptr ? job_.n : int64_t{job_.n} * (job_.speculative->depth + 1);
}

bool GenerateWork::needs_draft_model() const {
  return job_.speculative != nullptr && job_.speculative->policy != TreePolicy::kNgram;
}

int64_t GenerateWork::tree_pages() const {
  return job_.speculative == nullptr ? 0 : job_.speculative->tree_tokens;
}

int32_t GenerateWork::tree_depth(const Branch& branch) const {
  if (job_.speculative == nullptr) return 0;
  return std::min(job_.speculative->depth, job_.max_tokens - branch.stream->generated() - 1);
}

int64_t GenerateWork::pending_pages(const Forest& forest) const {
  if (finished_) return 0;
  if (prefilled_ < 0) return max_pages(job_, page_tokens_) + int64_t{job_.n} * tree_pages();
  const SequenceTree& tree = forest.tree();
  int64_t pending = 0;
  if (branches_.empty()) {
    return prompt_pages_left(forest) +
           int64_t{job_.n} * (pages_for(job_.max_tokens, page_tokens_) + tree_pages());
  }
  // A branch's node holds its path from its depth on: the generated tokens, or after a
  // preemption whatever of prompt + generated tokens was not found cached.
  const auto path_tokens = static_cast<int64_t>(job_.prompt.size()) + job_.max_tokens;
  for (const Branch& branch : branches_) {
    if (!branch.live) continue;
    pending += tree_pages();  // a step's drafted nodes, discarded after it
    if (branch.node < 0) {
      pending += pages_for(path_tokens, page_tokens_);
    } else {
      pending += pages_for(path_tokens - tree.node(branch.node).depth_begin, page_tokens_) -
                 forest.node_pages(branch.node);
    }
  }
  return std::max<int64_t>(pending, 0);
}

int64_t GenerateWork::reserve_pages(const Forest& forest) const {
  if (finished_) return 0;
  if (branches_.empty()) {
    // The prompt's pages (whole before placement) and the first decode step's.
    const int64_t first_step = int64_t{job_.n} * (1 + tree_pages());
    if (prefilled_ < 0)
      return pages_for(static_cast<int64_t>(job_.prompt.size()), page_tokens_) + first_step;
    return prompt_pages_left(forest) + first_step;
  }
  int64_t pages = 0;
  for (const Branch& branch : branches_) {
    if (!branch.live) continue;
    pages += tree_pages();
    if (job_.speculative != nullptr) pages += pages_for(job_.speculative->depth + 1, page_tokens_);
    const int64_t context = static_cast<int64_t>(job_.prompt.size() + branch.fed.size());
    if (branch.node < 0) {
      pages += pages_for(context, page_tokens_) + 1;  // preempted: its whole path again
    } else if (branch.refilled < static_cast<int64_t>(branch.refill.size())) {
      const int64_t left = static_cast<int64_t>(branch.refill.size()) - branch.refilled;
      pages += pages_for(left, page_tokens_) + 2;
    } else {
      pages += 1;
    }
  }
  return pages;
}

int64_t GenerateWork::step_pages(const Forest& forest, const StepContext& step) const {
  if (finished_) return 0;
  const auto growth = [&](NodeId node, int64_t count) { return forest.append_pages(node, count); };
  const auto prompt_size = static_cast<int64_t>(job_.prompt.size());
  if (prefilled_ < prompt_size)
    return growth(prompt_node_, step.chunk_rows(prompt_size - prefilled_));
  if (refilling()) {
    int64_t pages = 0;
    int64_t rows = step.chunk_rows(std::numeric_limits<int64_t>::max());
    for (const Branch& branch : branches_) {
      if (!branch.live) continue;
      const int64_t count =
          std::min(rows, static_cast<int64_t>(branch.refill.size()) - branch.refilled);
      if (count > 0) pages += growth(branch.node, count);
      rows -= std::max<int64_t>(count, 0);
    }
    return pages;
  }
  int64_t unfed = 0;
  for (const Branch& branch : branches_) {
    if (branch.live) unfed += static_cast<int64_t>(branch.unfed.size());
  }
  if (step.budget < unfed) return 0;
  int64_t pages = 0;
  for (const Branch& branch : branches_) {
    if (!branch.live) continue;
    pages += growth(branch.node, static_cast<int64_t>(branch.unfed.size()));
    // At most a page per drafted entry (a node each where the tree branches).
    if (branch.speculator != nullptr && step.speculate) pages += branch.speculator->tree_bound();
  }
  return pages;
}

int64_t GenerateWork::prompt_pages_left(const Forest& forest) const {
  const int64_t own_tokens =
      static_cast<int64_t>(job_.prompt.size()) - forest.tree().node(prompt_node_).depth_begin;
  return pages_for(own_tokens, page_tokens_) - forest.node_pages(prompt_node_);
}

bool GenerateWork::refilling() const {
  for (const Branch& branch : branches_) {
    if (branch.live && branch.refilled < static_cast<int64_t>(branch.refill.size())) return true;
  }
  return false;
}

void GenerateWork::preempt(Forest& forest) {
  if (prompt_draft_ != nullptr && draft_ != nullptr) prompt_draft_->release(*draft_);
  if (branches_.empty()) {
    if (prompt_node_ >= 0) forest.release(prompt_node_);
    prompt_node_ = -1;
    prefilled_ = -1;
    return;
  }
  for (Branch& branch : branches_) {
    if (branch.live && branch.speculator != nullptr) {
      branch.speculator->drop_tree(forest, draft_);
      if (draft_ != nullptr) branch.speculator->release(*draft_);
    }
    if (!branch.live || branch.node < 0) continue;
    forest.release(branch.node);
    branch.node = -1;
    branch.refill.clear();
    branch.refilled = 0;
  }
}

void GenerateWork::start(Forest& forest) {
  if (branches_.empty()) {
    const PromptPlacement placement = forest.place_prompt(job_.prompt);
    prompt_node_ = placement.node;
    prefilled_ = placement.shared;
    if (drafts()) {
      // The draft model reads the prompt while the target prefills it.
      prompt_draft_ = std::make_unique<Speculator>(job_.speculative.get(), job_.prompt,
                                                   /*anchor=*/false);
      prompt_draft_->place(*draft_);
    }
    return;
  }
  // Resuming after a preemption: each live branch is a prompt of its own.
  for (Branch& branch : branches_) {
    if (!branch.live) continue;
    branch.refill = job_.prompt;
    branch.refill.insert(branch.refill.end(), branch.fed.begin(), branch.fed.end());
    const PromptPlacement placement = forest.place_prompt(branch.refill);
    branch.node = placement.node;
    branch.refilled = placement.shared;
    if (branch.speculator != nullptr && drafts()) branch.speculator->place(*draft_);
  }
}

absl::Status GenerateWork::add_draft_rows(StepContext& draft, int32_t level) {
  if (events_->backlogged()) return absl::OkStatus();  // paused: add_rows adds nothing either
  if (branches_.empty()) {
    if (prompt_draft_ != nullptr && level == 0) return prompt_draft_->add_draft_rows(draft, 0, 0);
    return absl::OkStatus();
  }
  if (refilling()) return absl::OkStatus();
  for (Branch& branch : branches_) {
    if (!branch.live || branch.speculator == nullptr) continue;
    if (absl::Status status =
            branch.speculator->add_draft_rows(draft, level, level == 0 ? tree_depth(branch) : 0);
        !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status GenerateWork::take_draft_rows(StepContext& draft, int32_t level) {
  if (branches_.empty()) {
    if (prompt_draft_ != nullptr) return prompt_draft_->take_draft_rows(draft, level);
    return absl::OkStatus();
  }
  for (Branch& branch : branches_) {
    if (!branch.live || branch.speculator == nullptr) continue;
    if (absl::Status status = branch.speculator->take_draft_rows(draft, level); !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status GenerateWork::add_rows(StepContext& step) {
  in_step_ = false;
  if (events_->backlogged()) return absl::OkStatus();  // paused: the client reads slowly
  const auto prompt_size = static_cast<int64_t>(job_.prompt.size());
  if (prefilled_ < prompt_size) {
    // Prefill, in chunks when the step budget is short; logits from the last chunk only.
    return step.add_chunk(prompt_node_, job_.prompt, &prefilled_, &in_step_);
  }
  if (refilling()) {
    // Recompute after a preemption: no logits (each branch's next token is known already).
    for (Branch& branch : branches_) {
      if (!branch.live) continue;
      bool ended = false;
      if (absl::Status status = step.add_chunk(branch.node, branch.refill, &branch.refilled, &ended,
                                               StepContext::Logits::kNone, /*recomputed=*/true);
          !status.ok()) {
        return status;
      }
    }
    if (!refilling()) {
      for (Branch& branch : branches_) std::vector<TokenId>().swap(branch.refill);
      for (Branch& branch : branches_) branch.refilled = 0;
    }
    return absl::OkStatus();
  }
  int64_t unfed = 0;
  for (const Branch& branch : branches_) {
    if (branch.live) unfed += static_cast<int64_t>(branch.unfed.size());
  }
  if (step.budget < unfed) return absl::OkStatus();  // wait for a roomier step
  SamplingParams params = job_.sampling;
  for (Branch& branch : branches_) {
    if (!branch.live) continue;
    if (absl::Status status = step.add_run(branch.node, branch.unfed); !status.ok()) {
      return status;
    }
    unfed -= static_cast<int64_t>(branch.unfed.size());
    branch.fed.insert(branch.fed.end(), branch.unfed.begin(), branch.unfed.end());
    // The sampler's step counter is the new token's position: draws replay exactly.
    const TreeNode& node = step.forest.tree().node(branch.node);
    const auto position = static_cast<uint64_t>(node.depth_begin + node.tokens.size());
    params.seed = branch.seed;
    step.sample_last_row(params, position);
    if (branch.speculator != nullptr && step.speculate) {
      // The tree gets the rows the other branches' uncommitted tokens leave.
      if (absl::Status status = branch.speculator->add_tree_rows(
              step, branch.node, params, position, step.budget - unfed, tree_depth(branch));
          !status.ok()) {
        return status;
      }
    }
  }
  in_step_ = true;
  return absl::OkStatus();
}

absl::Status GenerateWork::take_logits(StepContext& step) {
  if (!in_step_) return absl::OkStatus();
  in_step_ = false;
  Forest& forest = step.forest;
  if (branches_.empty()) {
    // The prompt's last row: the prompt node branches n ways.
    const std::span<const float> logits = step.next_logits();
    absl::StatusOr<std::vector<NodeId>> children = forest.branch(prompt_node_, job_.n);
    if (!children.ok()) return children.status();
    branches_.resize(static_cast<size_t>(job_.n));
    for (int32_t i = 0; i < job_.n; ++i) {
      branches_[i].node = (*children)[i];
      branches_[i].seed = branch_seed(job_.sampling.seed, static_cast<uint64_t>(i));
      branches_[i].stream = std::make_unique<TokenStream>(tokenizer_, &job_.limits);
    }
    live_branches_ = job_.n;
    forest.release(prompt_node_);  // the branches hold the path from now on
    absl::StatusOr<std::vector<SampledToken>> first = sample_children(
        step.sampler, logits, job_.sampling, static_cast<uint64_t>(job_.prompt.size()), job_.n);
    if (!first.ok()) return first.status();
    for (int32_t i = 0; i < job_.n; ++i) {
      Branch& branch = branches_[i];
      if (job_.speculative != nullptr) {
        std::vector<TokenId> context = job_.prompt;
        context.push_back((*first)[i].token);
        branch.speculator =
            std::make_unique<Speculator>(job_.speculative.get(), std::move(context));
      }
      if (absl::Status status = add_token(i, (*first)[i], forest); !status.ok()) return status;
      ++step.generated;
      // Each branch's draft context shares the prompt's draft pages.
      if (branch.live && branch.speculator != nullptr && drafts()) {
        branch.speculator->place(*draft_);
      }
    }
    if (prompt_draft_ != nullptr) {
      prompt_draft_->release(*draft_);
      prompt_draft_.reset();
    }
  } else {
    std::vector<SampledToken>& committed = committed_;
    for (int32_t i = 0; i < static_cast<int32_t>(branches_.size()); ++i) {
      Branch& branch = branches_[i];
      if (!branch.live) continue;
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      committed.clear();
      if (branch.speculator != nullptr) {
        if (absl::Status status = branch.speculator->take_tree_rows(step, *sampled, &committed);
            !status.ok()) {
          return status;
        }
      } else {
        committed.push_back(*std::move(sampled));
      }
      branch.unfed.clear();
      for (const SampledToken& token : committed) {
        if (absl::Status status = add_token(i, token, forest); !status.ok()) return status;
        ++step.generated;
        if (!branch.live) break;
      }
      if (branch.live && branch.speculator != nullptr) branch.speculator->commit(branch.unfed);
    }
  }
  if (live_branches_ == 0) {
    finished_ = true;
    events_->finish(absl::OkStatus());
  }
  return absl::OkStatus();
}

absl::Status GenerateWork::add_token(int32_t index, const SampledToken& sampled, Forest& forest) {
  Branch& branch = branches_[index];
  TokenDelta delta =
      branch.stream->add(sampled, branch.stream->generated() + 1 >= job_.max_tokens);
  const bool ended = delta.finish != FinishReason::kNone;
  GenerateEvent event{.branch = index, .delta = std::move(delta)};
  if (ended && branch.speculator != nullptr) event.speculation = branch.speculator->stats();
  events_->push(std::move(event));
  if (!ended) {
    branch.unfed.push_back(sampled.token);
    return absl::OkStatus();
  }
  end_branch(branch, forest);
  return absl::OkStatus();
}

void GenerateWork::end_branch(Branch& branch, Forest& forest) {
  branch.live = false;
  --live_branches_;
  // The branch's KV is of no further use: its pages go back now, not at the job's end.
  if (branch.speculator != nullptr) {
    branch.speculator->drop_tree(forest, draft_);
    if (draft_ != nullptr) branch.speculator->release(*draft_);
  }
  if (branch.node >= 0) forest.release(branch.node);
  branch.node = -1;
}

void GenerateWork::abort(const absl::Status& status, Forest& forest) {
  const FinishReason reason =
      status.ok() ? FinishReason::kNone : FinishReason::kCancelled;
  if (branches_.empty()) {
    if (prompt_node_ >= 0) forest.release(prompt_node_);
  }
  if (prompt_draft_ != nullptr && draft_ != nullptr) prompt_draft_->release(*draft_);
  for (size_t i = 0; i < branches_.size(); ++i) {
    Branch& branch = branches_[i];
    if (!branch.live) continue;
    GenerateEvent event{.branch = static_cast<int32_t>(i), .delta = branch.stream->end(reason)};
    if (branch.speculator != nullptr) event.speculation = branch.speculator->stats();
    events_->push(std::move(event));
    end_branch(branch, forest);  // none while preempted
  }
  live_branches_ = 0;
  finished_ = true;
  events_->finish(status);
}

}  // namespace deft::engine
