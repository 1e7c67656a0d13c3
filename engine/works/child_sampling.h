// First tokens of the k children of a branch point, all from the parent's next-token logits.
// Greedy (temperature 0) would give k identical children, so a greedy branch point gives its
// children the k most likely tokens (logit descending, ties to the lower id; with fewer tokens
// than children the last repeats); with temperature > 0 child i samples with its own seed
// branch_seed(params.seed, i), so a tree replays identically.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/sampler.h"

namespace deft::engine {

// `step` is the children's first token position. Child i's SampledToken carries the top list
// the params ask for.
absl::StatusOr<std::vector<SampledToken>> sample_children(Sampler& sampler,
                                                          std::span<const float> logits,
                                                          const SamplingParams& params,
                                                          uint64_t step, int32_t k);

}  // namespace deft::engine
