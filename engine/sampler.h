// Picks the next token from one row of logits: greedy, temperature, top-k, top-p, with the
// log-probability of the chosen token and of the n most likely tokens.
//
// Reproducibility: the only randomness is one uniform number drawn from a counter-based
// generator (Philox4x32-10) keyed by the branch's seed and counted by `step`. A branch's
// token therefore depends only on (its logits, its params, seed, step): not on which other
// branches share the batch, on their order, or on how many tokens were drawn before. Ties
// between equal logits go to the lower token id.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace deft::engine {

// Most top logprobs one request may ask for (OpenAI's limit is 20).
inline constexpr int32_t kMaxTopLogprobs = 20;

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy (argmax)
  int32_t top_k = 0;         // keep the k most likely tokens; 0: all
  float top_p = 1.0f;        // keep the smallest most-likely set with mass >= top_p; (0, 1]
  uint64_t seed = 0;         // per branch; see branch_seed()
  int32_t top_logprobs = 0;  // report this many most likely tokens with their logprobs
  std::vector<int32_t> stop_token_ids;  // a sampled one sets SampledToken::stop
};

// INVALID_ARGUMENT naming the bad field: temperature < 0 or not finite, top_k < 0,
// top_p outside (0, 1], top_logprobs outside [0, kMaxTopLogprobs], or a stop token id outside
// [0, vocab_size).
absl::Status validate_sampling_params(const SamplingParams& params, int32_t vocab_size);

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

struct SampledToken {
  int32_t token = -1;
  // log softmax of the raw logits (before temperature, top-k, top-p): the model's own
  // probability of the token, what a search scores branches with.
  float logprob = 0.0f;
  std::vector<TokenLogprob> top_logprobs;  // most likely first, raw logprobs
  bool stop = false;                       // token is one of params.stop_token_ids
};

// Seed of child `branch_index` of a branch seeded `parent_seed` (a SplitMix64 mix), so forked
// branches draw independent streams and a tree replays identically.
uint64_t branch_seed(uint64_t parent_seed, uint64_t branch_index);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key);
// The uniform number in [0, 1) (53 bits) that `step` of the stream `seed` draws.
double sampling_uniform(uint64_t seed, uint64_t step);

// Not thread-safe: holds scratch buffers reused across calls (one sampler per engine thread).
class Sampler {
 public:
  // Samples from `logits` (one row, vocab-sized). `step` counts the branch's draws; the
  // engine passes the new token's position. INVALID_ARGUMENT for bad params or an empty row;
  // INTERNAL for a NaN or +inf logit, or a row with no finite logit (a model bug, reported
  // rather than sampled around). -inf logits are allowed and never sampled.
  absl::StatusOr<SampledToken> sample(std::span<const float> logits, const SamplingParams& params,
                                      uint64_t step);

 private:
  // Likelihood order: logit descending, then token id ascending (a total order).
  static bool more_likely(std::span<const float> logits, int32_t a, int32_t b);
  // Moves the `count` most likely tokens of order_ to its front (unordered), the count-th
  // most likely at position count - 1.
  void select_most_likely(std::span<const float> logits, size_t count);
  // Among order_[0, count): the least likely token of the smallest most-likely set whose
  // weight reaches `mass_needed`. Expected linear time (no full sort).
  int32_t select_top_p(std::span<const float> logits, size_t count, double mass_needed);

  std::vector<int32_t> order_;  // token ids, permuted by the selections
  std::vector<float> weights_;  // exp((logit - max) / temperature)
};

}  // namespace deft::engine
