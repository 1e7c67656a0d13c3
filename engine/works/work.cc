#include "engine/works/work.h"

#include <algorithm>

#include "kernels/check.h"

namespace deft::engine {

absl::Status StepContext::add_run(NodeId node, std::span<const TokenId> run, Logits wanted) {
  SequenceTree& tree = forest.tree();
  const auto first = static_cast<int32_t>(tree.contains(node) ? tree.node(node).tokens.size() : 0);
  if (absl::Status status = forest.append(node, run); !status.ok()) return status;
  for (size_t i = 0; i < run.size(); ++i) {
    if (wanted == Logits::kAll || (wanted == Logits::kLast && i + 1 == run.size())) {
      logit_rows.push_back(static_cast<int32_t>(tokens.size()));
    }
    queries.push_back({node, first + static_cast<int32_t>(i)});
    tokens.push_back(run[i]);
  }
  budget -= static_cast<int64_t>(run.size());
  return absl::OkStatus();
}

absl::Status StepContext::add_chunk(NodeId node, std::span<const TokenId> tokens, int64_t* next,
                                    bool* ended, Logits last_logits, bool recomputed) {
  *ended = false;
  const auto total = static_cast<int64_t>(tokens.size());
  const int64_t count = chunk_rows(total - *next);
  if (count <= 0) return absl::OkStatus();
  const bool last = *next + count == total;
  if (absl::Status status =
          add_run(node, tokens.subspan(*next, count), last ? last_logits : Logits::kNone);
      !status.ok()) {
    return status;
  }
  prefill_budget -= count;
  if (!recomputed) prompt_rows += count;
  *next += count;
  *ended = last;
  return absl::OkStatus();
}

void StepContext::sample_last_row(const SamplingParams& params, uint64_t step) {
  const size_t row = logit_rows.size() - 1;
  row_params_.resize(logit_rows.size());
  row_steps_.resize(logit_rows.size());
  row_samples_.resize(logit_rows.size(), 0);
  row_params_[row] = params;
  row_steps_[row] = step;
  row_samples_[row] = 1;
}

bool StepContext::any_row_sampled() const {
  return std::find(row_samples_.begin(), row_samples_.end(), uint8_t{1}) != row_samples_.end();
}

std::span<const RowSampling> StepContext::row_sampling() {
  row_samples_.resize(logit_rows.size(), 0);
  row_params_.resize(logit_rows.size());
  row_steps_.resize(logit_rows.size());
  row_sampling_.resize(logit_rows.size());
  logits_index_.assign(logit_rows.size(), -1);
  wanted_rows_ = 0;
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    if (row_samples_[i] != 0) {
      row_sampling_[i] = {.params = &row_params_[i], .step = row_steps_[i]};
    } else {
      row_sampling_[i] = {.params = nullptr};
      logits_index_[i] = static_cast<int32_t>(wanted_rows_++);
    }
  }
  return row_sampling_;
}

absl::StatusOr<SampledToken> StepContext::next_sampled() {
  const size_t row = logit_cursor_;
  DEFT_CHECK(row < row_samples_.size() && row_samples_[row] != 0,
             "StepContext: row %zu was not marked for sampling", row);
  if (!sampled.empty()) {
    ++logit_cursor_;
    return sampled[row];
  }
  return sampler.sample(next_logits(), row_params_[row], row_steps_[row]);
}

std::span<const float> StepContext::next_logits() {
  const size_t vocab = static_cast<size_t>(vocab_size);
  const size_t row = logit_cursor_++;
  // Sampled on the device: `logits` holds only the rows that wanted theirs.
  const size_t index = sampled.empty() ? row : static_cast<size_t>(logits_index_.at(row));
  DEFT_CHECK(sampled.empty() || logits_index_[row] >= 0,
             "StepContext: row %zu was sampled on the device; its logits are gone", row);
  DEFT_CHECK((index + 1) * vocab <= logits.size(),
             "StepContext: a work took more logit rows than the step has");
  return logits.subspan(index * vocab, vocab);
}

void StepContext::clear() {
  budget = 0;
  prefill_budget = 0;
  generated = 0;
  accepted_lengths.clear();
  drafted = 0;
  prompt_rows = 0;
  queries.clear();
  tokens.clear();
  logit_rows.clear();
  logits = {};
  logit_cursor_ = 0;
  row_params_.clear();
  row_steps_.clear();
  row_samples_.clear();
  row_sampling_.clear();
  logits_index_.clear();
  wanted_rows_ = 0;
  sampled.clear();
}

}  // namespace deft::engine
