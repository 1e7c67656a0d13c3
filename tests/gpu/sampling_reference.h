// Test helper: how close engine::Sampler's random decision for one row came to a boundary.
// The GPU sampler sums masses in double in another order than the CPU, so a token may differ
// from the CPU's only where the draw (u x kept mass) or top-p's needed mass lies within rounding
// of a cumulative-mass boundary. This recomputes the CPU's decision with a full sort and long
// double sums and returns the smallest distance, relative to the mass involved, between such a
// target and the boundaries next to it. Written for obviousness (a sort per call).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "engine/sampler.h"

namespace deft::testing {

// +inf for greedy rows (no randomness: tokens must match exactly).
inline double sampling_decision_margin(std::span<const float> logits,
                                       const engine::SamplingParams& params, uint64_t step) {
  if (params.temperature == 0.0f || params.top_k == 1) {
    return std::numeric_limits<double>::infinity();
  }
  const auto vocab = static_cast<int32_t>(logits.size());
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<float> weights(logits.size());
  for (int32_t t = 0; t < vocab; ++t) {
    weights[t] = std::exp((logits[t] - max_logit) / params.temperature);
  }
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  const int32_t candidates = params.top_k > 0 && params.top_k < vocab ? params.top_k : vocab;
  int32_t last_rank = candidates - 1;
  double margin = std::numeric_limits<double>::infinity();
  if (params.top_p < 1.0f) {
    long double candidate_mass = 0;
    for (int32_t i = 0; i < candidates; ++i) candidate_mass += weights[order[i]];
    const long double needed = static_cast<long double>(params.top_p) * candidate_mass;
    long double running = 0;
    for (int32_t i = 0; i < candidates; ++i) {
      const long double before = running;
      running += weights[order[i]];
      if (running >= needed || i == candidates - 1) {
        last_rank = i;
        margin = static_cast<double>(
            std::min(std::abs(running - needed), std::abs(needed - before)) / candidate_mass);
        break;
      }
    }
  }
  std::vector<char> kept(logits.size(), 0);
  for (int32_t i = 0; i <= last_rank; ++i) kept[order[i]] = 1;
  long double kept_mass = 0;
  for (int32_t t = 0; t < vocab; ++t) {
    if (kept[t]) kept_mass += weights[t];
  }
  const long double target =
      static_cast<long double>(engine::sampling_uniform(params.seed, step)) * kept_mass;
  long double cumulative = 0;
  for (int32_t t = 0; t < vocab; ++t) {
    if (!kept[t] || weights[t] == 0.0f) continue;
    const long double before = cumulative;
    cumulative += weights[t];
    if (cumulative > target) {
      return std::min(
          margin, static_cast<double>(std::min(target - before, cumulative - target) / kept_mass));
    }
  }
  return std::min(margin, static_cast<double>((target - cumulative) / kept_mass));
}

}  // namespace deft::testing
