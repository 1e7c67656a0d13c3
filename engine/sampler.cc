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

// First prefix tried when top-p runs without top-k; most of the mass of a language model's
// next-token distribution sits in a few dozen tokens, so the full vocabulary is rarely sorted.
constexpr size_t kTopPFirstPrefix = 64;

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
        absl::StrCat("sampling: temperature must be finite and >= 0, got ", params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_k must be >= 0 (0 = off), got ", params.top_k));
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_p must be in (0, 1], got ", params.top_p));
  }
  if (params.top_logprobs < 0 || params.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: top_logprobs must be in [0, ",
                                                   kMaxTopLogprobs, "], got ",
                                                   params.top_logprobs));
  }
  for (int32_t token : params.stop_token_ids) {
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("sampling: stop token id ", token,
                                                     " outside the vocabulary [0, ", vocab_size,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

void Sampler::sort_prefix(std::span<const float> logits, size_t count) {
  const auto more_likely = [&logits](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  count = std::min(count, order_.size());
  if (count < order_.size()) {
    std::nth_element(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(count), order_.end(),
                     more_likely);
  }
  std::sort(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(count), more_likely);
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
      return absl::InternalError(
          absl::StrCat("sampling: logit of token ", token, " is ", logit));
    }
    if (logit > max_logit) {
      max_logit = logit;
      argmax = token;
    }
  }
  if (argmax < 0) return absl::InternalError("sampling: every logit of the row is -inf");
  double raw_sum = 0.0;
  for (float logit : logits) raw_sum += std::exp(static_cast<double>(logit - max_logit));
  const double log_normaliser = static_cast<double>(max_logit) + std::log(raw_sum);
  const auto raw_logprob = [&](int32_t token) {
    return static_cast<float>(static_cast<double>(logits[token]) - log_normaliser);
  };

  order_.resize(logits.size());
  for (int32_t token = 0; token < vocab_size; ++token) order_[token] = token;

  int32_t chosen = argmax;
  const bool greedy = params.temperature == 0.0f || params.top_k == 1;
  if (!greedy) {
    const double inv_temperature = 1.0 / static_cast<double>(params.temperature);
    const auto weight = [&](int32_t token) {
      return std::exp((static_cast<double>(logits[token]) - max_logit) * inv_temperature);
    };
    const double u = sampling_uniform(params.seed, step);
    if (params.top_k == 0 && params.top_p >= 1.0f) {
      // Plain temperature sampling: inverse CDF in token-id order, no sort.
      weights_.resize(logits.size());
      double total = 0.0;
      for (int32_t token = 0; token < vocab_size; ++token) {
        weights_[token] = weight(token);
        total += weights_[token];
      }
      const double target = u * total;
      double cumulative = 0.0;
      for (int32_t token = 0; token < vocab_size; ++token) {
        if (weights_[token] == 0.0) continue;
        chosen = token;  // the last positive-weight token absorbs rounding at the top end
        cumulative += weights_[token];
        if (cumulative > target) break;
      }
    } else {
      // Candidates in likelihood order: top-k first, then top-p over the top-k set
      // (transformers' and vLLM's order of the two filters).
      size_t kept = params.top_k > 0 ? std::min<size_t>(params.top_k, logits.size())
                                     : logits.size();
      double kept_total = 0.0;
      if (params.top_k > 0) {
        sort_prefix(logits, kept);
        for (size_t i = 0; i < kept; ++i) kept_total += weight(order_[i]);
      } else {
        for (int32_t token = 0; token < vocab_size; ++token) kept_total += weight(token);
      }
      if (params.top_p < 1.0f) {
        // Smallest prefix whose mass reaches top_p; sort more of the vocabulary only when
        // the prefix sorted so far does not reach it.
        const double mass_needed = static_cast<double>(params.top_p) * kept_total;
        size_t sorted = params.top_k > 0 ? kept : 0;
        size_t prefix = 0;
        double cumulative = 0.0;
        bool reached = false;
        while (!reached) {
          if (prefix == sorted) {
            const size_t next = std::min(kept, std::max(kTopPFirstPrefix, sorted * 4));
            if (params.top_k == 0) sort_prefix(logits, next);
            sorted = next;
          }
          while (prefix < sorted) {
            cumulative += weight(order_[prefix]);
            ++prefix;
            if (cumulative >= mass_needed) {
              reached = true;
              break;
            }
          }
          if (sorted == kept) reached = true;
        }
        kept = prefix;
        kept_total = cumulative;
      }
      const double target = u * kept_total;
      double cumulative = 0.0;
      chosen = order_[0];
      for (size_t i = 0; i < kept; ++i) {
        const double w = weight(order_[i]);
        if (w == 0.0) break;  // sorted: the rest weigh nothing too
        chosen = order_[i];
        cumulative += w;
        if (cumulative > target) break;
      }
    }
  }

  SampledToken result;
  result.token = chosen;
  result.logprob = raw_logprob(chosen);
  result.stop = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), chosen) !=
                params.stop_token_ids.end();
  if (params.top_logprobs > 0) {
    const size_t count = std::min<size_t>(params.top_logprobs, logits.size());
    for (int32_t token = 0; token < vocab_size; ++token) order_[token] = token;
    sort_prefix(logits, count);
    result.top_logprobs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      result.top_logprobs.push_back({order_[i], raw_logprob(order_[i])});
    }
  }
  return result;
}

}  // namespace deft::engine
