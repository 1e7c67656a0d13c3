#include "engine/model_runner.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace deft::engine {

absl::Status check_row_sampling(const StepBatch& batch, std::span<const RowSampling> rows,
                                std::span<const SampledToken> out, size_t logits_size,
                                int32_t vocab_size) {
  if (rows.size() != batch.logit_rows.size() || out.size() != batch.logit_rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("forward_sampled: ", batch.logit_rows.size(),
                                                   " logit rows but ", rows.size(),
                                                   " sampling rows and ", out.size(), " outputs"));
  }
  size_t wanted = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].params == nullptr) {
      ++wanted;
      continue;
    }
    if (absl::Status status = validate_sampling_params(*rows[i].params, vocab_size); !status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward_sampled: logit row ", i, ": ", status.message()));
    }
  }
  if (logits_size != wanted * static_cast<size_t>(vocab_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward_sampled: ", wanted, " rows want their logits (", vocab_size,
                     " each) but the logits span holds ", logits_size, " floats"));
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::forward_sampled(const StepBatch& batch, std::span<const RowSampling> rows,
                                          std::span<SampledToken> out, std::span<float> logits) {
  const int32_t vocab = vocab_size();
  if (absl::Status status = check_row_sampling(batch, rows, out, logits.size(), vocab);
      !status.ok()) {
    return status;
  }
  std::vector<float> all(batch.logit_rows.size() * static_cast<size_t>(vocab));
  if (absl::Status status = forward(batch, all); !status.ok()) return status;
  Sampler sampler;
  size_t kept = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto row = std::span<const float>(all).subspan(i * vocab, vocab);
    if (rows[i].params == nullptr) {
      std::copy(row.begin(), row.end(), logits.begin() + static_cast<ptrdiff_t>(kept++ * vocab));
      continue;
    }
    absl::StatusOr<SampledToken> token = sampler.sample(row, *rows[i].params, rows[i].step);
    if (!token.ok()) {
      return absl::Status(token.status().code(),
                          absl::StrCat("forward_sampled: logit row ", i, " (query row ",
                                       batch.logit_rows[i], "): ", token.status().message()));
    }
    out[i] = std::move(*token);
  }
  return absl::OkStatus();
}

}  // namespace deft::engine
