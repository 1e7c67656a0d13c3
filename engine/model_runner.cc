#include "engine/model_runner.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace deft::engine {

absl::Status check_row_sampling(const StepBatch& batch, std::span<const RowSampling> rows,
                                std::span<const SampledToken> out, int32_t vocab_size) {
  if (rows.size() != batch.logit_rows.size() || out.size() != batch.logit_rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("forward_sampled: ", batch.logit_rows.size(),
                                                   " logit rows but ", rows.size(),
                                                   " sampling rows and ", out.size(), " outputs"));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].params == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward_sampled: logit row ", i, " has no sampling params"));
    }
    if (absl::Status status = validate_sampling_params(*rows[i].params, vocab_size); !status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward_sampled: logit row ", i, ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::forward_sampled(const StepBatch& batch, std::span<const RowSampling> rows,
                                          std::span<SampledToken> out) {
  const int32_t vocab = vocab_size();
  if (absl::Status status = check_row_sampling(batch, rows, out, vocab); !status.ok()) {
    return status;
  }
  std::vector<float> logits(batch.logit_rows.size() * static_cast<size_t>(vocab));
  if (absl::Status status = forward(batch, logits); !status.ok()) return status;
  Sampler sampler;
  for (size_t i = 0; i < rows.size(); ++i) {
    absl::StatusOr<SampledToken> token = sampler.sample(
        std::span<const float>(logits).subspan(i * vocab, vocab), *rows[i].params, rows[i].step);
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
