#include "engine/works/child_sampling.h"

#include <algorithm>
#include <numeric>

namespace deft::engine {

absl::StatusOr<std::vector<SampledToken>> sample_children(Sampler& sampler,
                                                          std::span<const float> logits,
                                                          const SamplingParams& params,
                                                          uint64_t step, int32_t k) {
  std::vector<SampledToken> children;
  children.reserve(static_cast<size_t>(k));
  if (params.temperature == 0.0f && k > 1) {
    // The greedy draw validates the row and gives the raw normaliser and the top list.
    absl::StatusOr<SampledToken> first = sampler.sample(logits, params, step);
    if (!first.ok()) return first.status();
    const float log_normaliser = logits[first->token] - first->logprob;
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    const size_t count = std::min<size_t>(static_cast<size_t>(k), logits.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<ptrdiff_t>(count), order.end(),
                      [&](int32_t a, int32_t b) {
                        return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
                      });
    for (int32_t i = 0; i < k; ++i) {
      const int32_t token = order[std::min<size_t>(static_cast<size_t>(i), count - 1)];
      SampledToken child = *first;
      child.token = token;
      child.logprob = logits[token] - log_normaliser;
      child.stop = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) !=
                   params.stop_token_ids.end();
      children.push_back(std::move(child));
    }
    return children;
  }
  for (int32_t i = 0; i < k; ++i) {
    SamplingParams child_params = params;
    child_params.seed = branch_seed(params.seed, static_cast<uint64_t>(i));
    absl::StatusOr<SampledToken> sampled = sampler.sample(logits, child_params, step);
    if (!sampled.ok()) return sampled.status();
    children.push_back(std::move(*sampled));
  }
  return children;
}

}  // namespace deft::engine
