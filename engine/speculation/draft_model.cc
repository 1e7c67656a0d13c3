#include "engine/speculation/draft_model.h"

#include <algorithm>
#include <chrono>

namespace deft::engine {
namespace {

// More passes than any tree has levels (depth <= kMaxSpeculativeDepth): a bound on a bug.
constexpr int32_t kMaxPasses = 64;

PlannerOptions with_wave(PlannerOptions options, const ModelRunner& runner) {
  if (options.wave.ctas == 0) options.wave = runner.attention_wave();
  return options;
}

}  // namespace

DraftModel::DraftModel(DraftModelOptions options, ModelRunner& runner, const Tokenizer& tokenizer)
    : options_(options),
      runner_(runner),
      kv_({.page_tokens = options.page_tokens, .num_pages = options.kv_pages}),
      forest_(&kv_, 1, {.max_pages = options.prefix_cache_pages}),
      planner_(with_wave(options.planner, runner)),
      step_(forest_, sampler_, tokenizer, runner.vocab_size()) {}

absl::Status DraftModel::run(std::span<Work* const> works, DraftStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status status;
  for (int32_t level = 0; level < kMaxPasses; ++level) {
    step_.clear();
    step_.budget = options_.max_step_tokens;
    step_.prefill_budget = options_.max_prefill_tokens > 0
                               ? options_.max_prefill_tokens
                               : std::max(1, options_.max_step_tokens / 2);
    for (Work* work : works) {
      status = work->add_draft_rows(step_, level);
      if (!status.ok()) break;
    }
    if (!status.ok() || step_.tokens.empty()) break;
    const TreeQueries trees[] = {{&forest_.tree(), step_.queries}};
    status = planner_.plan(trees, plan_);
    if (!status.ok()) break;
    const StepBatch batch{.plan = &plan_, .tokens = step_.tokens, .logit_rows = step_.logit_rows};
    // Every draft row with logits wants a top list only: sampled where the runner samples.
    if (!step_.logit_rows.empty() && step_.any_row_sampled()) {
      step_.sampled.resize(step_.logit_rows.size());
      const std::span<const RowSampling> rows = step_.row_sampling();
      const size_t floats = step_.wanted_logit_rows() * static_cast<size_t>(runner_.vocab_size());
      logits_.resize(floats);
      step_.logits = logits_;
      status = runner_.forward_sampled(batch, rows, step_.sampled, logits_);
    } else {
      logits_.resize(step_.logit_rows.size() * static_cast<size_t>(runner_.vocab_size()));
      step_.logits = logits_;
      status = runner_.forward(batch, logits_);
    }
    if (!status.ok()) break;
    ++stats->passes;
    stats->rows += static_cast<int64_t>(step_.tokens.size());
    for (Work* work : works) {
      status = work->take_draft_rows(step_, level);
      if (!status.ok()) break;
    }
    if (!status.ok()) break;
  }
  step_.clear();
  if (!status.ok()) forest_.clear_cache();  // rows may have been appended without their KV
  stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return status;
}

}  // namespace deft::engine
