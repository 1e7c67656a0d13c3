#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace deft::engine {
namespace {

// Philox constants (Random123).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kPhiloxW0;
      key[1] += kPhiloxW1;
    }
    const uint64_t product0 = static_cast<uint64_t>(kPhiloxM0) * counter[0];
    const uint64_t product1 = static_cast<uint64_t>(kPhiloxM1) * counter[2];
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32);
    const uint32_t lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32);
    const uint32_t lo1 = static_cast<uint32_t>(product1);
    counter = {hi1 ^ counter[1] ^ key[0], lo1, hi0 ^ counter[3] ^ key[1], lo0};
  }
  return counter;
}

double sampling_uniform(uint64_t seed, uint64_t step) {
  const std::array<uint32_t, 4> bits =
      philox4x32_10({static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u},
                    {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  // 53 random bits: 27 from the first word, 26 from the second.
  const uint64_t mantissa = (static_cast<uint64_t>(bits[0] >> 5) << 26) | (bits[1] >> 6);
  return static_cast<double>(mantissa) * 0x1.0p-53;
}

uint64_t branch_seed(uint64_t parent_seed, uint64_t branch_index) {
  return splitmix64(splitmix64(parent_seed) ^ splitmix64(branch_index + 0x5851F42D4C957F2Dull));
}

absl::Status validate_sampling_params(const SamplingParams& params, int32_t vocab_size) {
  if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, got ", params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0 (0 = off), got ", params.top_k));
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", params.top_p));
  }
  if (params.top_logprobs < 0 || params.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs,
                                                   "], got ", params.top_logprobs));
  }
  for (int32_t token : params.stop_token_ids) {
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop token id ", token, " outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

bool Sampler::more_likely(std::span<const float> logits, int32_t a, int32_t b) {
  return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
}

void Sampler::select_most_likely(std::span<const float> logits, size_t count) {
  const size_t vocab_size = logits.size();
  count = std::min(count, vocab_size);
  const auto by_likelihood = [&logits](int32_t a, int32_t b) { return more_likely(logits, a, b); };
  if (count > 0 && count * 8 <= vocab_size) {
    // Few wanted (top-k, top logprobs): one pass with a heap whose root is the least likely
    // token kept so far; most tokens fail the comparison with the root and cost one compare.
    order_.clear();
    for (int32_t token = 0; token < static_cast<int32_t>(vocab_size); ++token) {
      if (order_.size() < count) {
        order_.push_back(token);
        std::push_heap(order_.begin(), order_.end(), by_likelihood);
      } else if (more_likely(logits, token, order_.front())) {
        std::pop_heap(order_.begin(), order_.end(), by_likelihood);
        order_.back() = token;
        std::push_heap(order_.begin(), order_.end(), by_likelihood);
      }
    }
    std::pop_heap(order_.begin(), order_.end(), by_likelihood);  // least likely to the back
    return;
  }
  order_.resize(vocab_size);
  for (size_t token = 0; token < vocab_size; ++token) order_[token] = static_cast<int32_t>(token);
  if (count == 0 || count == vocab_size) return;
  std::nth_element(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(count - 1), order_.end(),
                   by_likelihood);
}

int32_t Sampler::select_top_p(std::span<const float> logits, size_t count, double mass_needed) {
  // Quickselect on likelihood that tracks mass: [0, lo) are known to be kept and weigh
  // `mass_before` < mass_needed; the boundary lies in [lo, hi).
  size_t lo = 0;
  size_t hi = count;
  double mass_before = 0.0;
  uint64_t pivot_state = count;
  while (hi - lo > 32) {
    // Median of three pseudo-random positions: deterministic, and no bad case for sorted rows.
    size_t positions[3];
    for (size_t& position : positions) {
      pivot_state = pivot_state * 6364136223846793005ull + 1442695040888963407ull;
      position = lo + static_cast<size_t>((pivot_state >> 33) % (hi - lo));
    }
    const auto by_likelihood = [&](size_t a, size_t b) {
      return more_likely(logits, order_[a], order_[b]);
    };
    if (by_likelihood(positions[1], positions[0])) std::swap(positions[0], positions[1]);
    if (by_likelihood(positions[2], positions[1])) std::swap(positions[1], positions[2]);
    if (by_likelihood(positions[1], positions[0])) std::swap(positions[0], positions[1]);
    const int32_t pivot = order_[positions[1]];
    const auto middle = std::partition(
        order_.begin() + static_cast<ptrdiff_t>(lo), order_.begin() + static_cast<ptrdiff_t>(hi),
        [&](int32_t token) { return more_likely(logits, token, pivot); });
    const auto mid = static_cast<size_t>(middle - order_.begin());
    double upper_mass = 0.0;
    for (size_t i = lo; i < mid; ++i) upper_mass += weights_[order_[i]];
    if (mass_before + upper_mass >= mass_needed) {
      hi = mid;  // the boundary is among the tokens more likely than the pivot
      continue;
    }
    mass_before += upper_mass;
    // The pivot is the most likely of [mid, hi); it is the boundary or kept.
    std::iter_swap(order_.begin() + static_cast<ptrdiff_t>(mid),
                   std::find(order_.begin() + static_cast<ptrdiff_t>(mid),
                             order_.begin() + static_cast<ptrdiff_t>(hi), pivot));
    mass_before += weights_[pivot];
    if (mass_before >= mass_needed) return pivot;
    lo = mid + 1;
  }
  std::sort(order_.begin() + static_cast<ptrdiff_t>(lo),
            order_.begin() + static_cast<ptrdiff_t>(hi),
            [&logits](int32_t a, int32_t b) { return more_likely(logits, a, b); });
  for (size_t i = lo; i < hi; ++i) {
    mass_before += weights_[order_[i]];
    if (mass_before >= mass_needed) return order_[i];
  }
  // Rounding left the mass a hair short: everything up to the least likely candidate is kept.
  return hi > 0 ? order_[hi - 1] : order_[0];
}

absl::StatusOr<SampledToken> Sampler::sample(std::span<const float> logits,
                                             const SamplingParams& params, uint64_t step) {
  if (logits.empty()) return absl::InvalidArgumentError("sampling: empty logits row");
  const auto vocab_size = static_cast<int32_t>(logits.size());
  if (absl::Status status = validate_sampling_params(params, vocab_size); !status.ok()) {
    return status;
  }

  // Raw log-softmax normaliser; the row must be finite or -inf.
  float max_logit = -std::numeric_limits<float>::infinity();
  int32_t argmax = -1;
  for (int32_t token = 0; token < vocab_size; ++token) {
    const float logit = logits[token];
    if (std::isnan(logit) || logit == std::numeric_limits<float>::infinity()) {
      return absl::InternalError(absl::StrCat("sampling: logit of token ", token, " is ", logit));
    }
    if (logit > max_logit) {
      max_logit = logit;
      argmax = token;
    }
  }
  if (argmax < 0) return absl::InternalError("sampling: every logit of the row is -inf");
  weights_.resize(logits.size());
  double raw_sum = 0.0;
  for (int32_t token = 0; token < vocab_size; ++token) {
    weights_[token] = std::exp(logits[token] - max_logit);
    raw_sum += weights_[token];
  }
  const double log_normaliser = static_cast<double>(max_logit) + std::log(raw_sum);
  const auto raw_logprob = [&](int32_t token) {
    return static_cast<float>(static_cast<double>(logits[token]) - log_normaliser);
  };

  int32_t chosen = argmax;
  const bool greedy = params.temperature == 0.0f || params.top_k == 1;
  if (!greedy) {
    // Weights exp((logit - max) / T); at T = 1 those of the normaliser above.
    // Divided, not multiplied by 1/T: a tiny T must give exp(0 / T) = 1 for the maximum,
    // where 1/T overflows and 0 * inf is NaN.
    if (params.temperature != 1.0f) {
      for (int32_t token = 0; token < vocab_size; ++token) {
        weights_[token] = std::exp((logits[token] - max_logit) / params.temperature);
      }
    }
    // The kept set is every token ranked (logit descending, id ascending) at or above a
    // boundary token: top-k picks the k-th, top-p then the smallest prefix of those reaching
    // p of their mass (transformers' and vLLM's order of the two filters). Neither needs a
    // sort: selection and a mass-aware selection are linear in the vocabulary.
    int32_t boundary = -1;  // -1: every token is kept
    if (params.top_k > 0 || params.top_p < 1.0f) {
      const bool top_k_filters =
          params.top_k > 0 && static_cast<size_t>(params.top_k) < logits.size();
      const size_t candidates = top_k_filters ? static_cast<size_t>(params.top_k) : logits.size();
      select_most_likely(logits, candidates);
      if (top_k_filters) boundary = order_[candidates - 1];
      if (params.top_p < 1.0f) {
        double candidate_mass = 0.0;
        for (size_t i = 0; i < candidates; ++i) candidate_mass += weights_[order_[i]];
        boundary = select_top_p(logits, candidates, params.top_p * candidate_mass);
      }
    }
    const auto kept = [&](int32_t token) {
      if (boundary < 0) return true;
      return logits[token] != logits[boundary] ? logits[token] > logits[boundary]
                                               : token <= boundary;
    };
    // Inverse CDF over the kept tokens in id order.
    double kept_mass = 0.0;
    for (int32_t token = 0; token < vocab_size; ++token) {
      if (kept(token)) kept_mass += weights_[token];
    }
    const double target = sampling_uniform(params.seed, step) * kept_mass;
    double cumulative = 0.0;
    for (int32_t token = 0; token < vocab_size; ++token) {
      if (weights_[token] == 0.0f || !kept(token)) continue;
      chosen = token;  // the last kept token absorbs rounding at the top end
      cumulative += weights_[token];
      if (cumulative > target) break;
    }
  }

  SampledToken result;
  result.token = chosen;
  result.logprob = raw_logprob(chosen);
  result.stop = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), chosen) !=
                params.stop_token_ids.end();
  if (params.top_logprobs > 0) {
    const size_t count = std::min<size_t>(params.top_logprobs, logits.size());
    select_most_likely(logits, count);
    std::sort(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(count),
              [&logits](int32_t a, int32_t b) { return more_likely(logits, a, b); });
    result.top_logprobs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      result.top_logprobs.push_back({order_[i], raw_logprob(order_[i])});
    }
  }
  return result;
}

}  // namespace deft::engine
