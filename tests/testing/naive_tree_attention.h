// Test support (header only): the float64 naive attention every tree-attention plan is checked
// against, and a small seeded random generator whose seed the tests print on failure.
//
// The naive attention knows nothing of plans, tasks or masks: for each query row it takes the
// list of KV slots that row may see and computes softmax(scale * q.k) V over exactly those
// slots, in double. A plan executed by deft_attention_cpu (or a GPU kernel) must agree with it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kernels/attention_params.h"

namespace deft::test {

// out[q][h][d] (double) = softmax over s in visible_slots[q] of (scale * q[q][h] . k[s][h/g]),
// weighted sum of v[s][h/g]. Layouts as in kernels/attention_params.h. Aborts on a row with no
// visible slot (attention over nothing is undefined, and no tree query sees nothing).
inline std::vector<double> naive_tree_attention(
    const kernels::AttentionDims& dims, const float* q, const float* k_cache, const float* v_cache,
    const std::vector<std::vector<int32_t>>& visible_slots,
    std::vector<double>* lse_out = nullptr) {
  const size_t head_dim = static_cast<size_t>(dims.head_dim);
  const size_t num_q_heads = static_cast<size_t>(dims.num_q_heads);
  const size_t num_kv_heads = static_cast<size_t>(dims.num_kv_heads);
  const size_t group_size = num_q_heads / num_kv_heads;
  const size_t num_queries = visible_slots.size();
  std::vector<double> out(num_queries * num_q_heads * head_dim, 0.0);
  if (lse_out != nullptr) lse_out->assign(num_queries * num_q_heads, 0.0);
  std::vector<double> scores;
  for (size_t row = 0; row < num_queries; ++row) {
    const std::vector<int32_t>& slots = visible_slots[row];
    if (slots.empty()) std::abort();
    scores.resize(slots.size());
    for (size_t head = 0; head < num_q_heads; ++head) {
      const size_t kv_head = head / group_size;
      const float* q_vec = q + (row * num_q_heads + head) * head_dim;
      double max_score = -std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < slots.size(); ++i) {
        const float* k_vec =
            k_cache + (static_cast<size_t>(slots[i]) * num_kv_heads + kv_head) * head_dim;
        double dot = 0.0;
        for (size_t d = 0; d < head_dim; ++d) dot += double{q_vec[d]} * double{k_vec[d]};
        scores[i] = double{dims.softmax_scale} * dot;
        max_score = std::max(max_score, scores[i]);
      }
      double sum = 0.0;
      double* dst = out.data() + (row * num_q_heads + head) * head_dim;
      for (size_t i = 0; i < slots.size(); ++i) {
        const double weight = std::exp(scores[i] - max_score);
        sum += weight;
        const float* v_vec =
            v_cache + (static_cast<size_t>(slots[i]) * num_kv_heads + kv_head) * head_dim;
        for (size_t d = 0; d < head_dim; ++d) dst[d] += weight * double{v_vec[d]};
      }
      for (size_t d = 0; d < head_dim; ++d) dst[d] /= sum;
      if (lse_out != nullptr) (*lse_out)[row * num_q_heads + head] = max_score + std::log(sum);
    }
  }
  return out;
}

// Expands a plan into what each query row sees: for every entry of every task, the slots of the
// task's run that the entry's mask bit (or no mask) lets it see, appended to the entry's row in
// plan order; then the keys each prefill run's rows see. A correct plan lists each visible slot of a row exactly once, so tests compare the
// sorted lists with the expected visibility (a duplicate means a pair covered twice).
inline std::vector<std::vector<int32_t>> plan_visible_slots(
    const kernels::AttentionPlanView& plan) {
  std::vector<std::vector<int32_t>> visible(static_cast<size_t>(plan.num_queries));
  for (int32_t task = 0; task < plan.num_tasks; ++task) {
    const int32_t kv_begin = plan.task_kv_begin[task];
    const int32_t mask_begin = plan.task_mask_begin[task];
    for (int32_t entry = plan.task_entry_begin[task]; entry < plan.task_entry_begin[task + 1];
         ++entry) {
      const int32_t bit = entry - plan.task_entry_begin[task];
      std::vector<int32_t>& row = visible[static_cast<size_t>(plan.entry_query[entry])];
      for (int32_t i = kv_begin; i < plan.task_kv_end[task]; ++i) {
        if (mask_begin == -1 || ((plan.mask_words[mask_begin + (i - kv_begin)] >> bit) & 1u) != 0) {
          row.push_back(plan.kv_slots[i]);
        }
      }
    }
  }
  // Prefill runs: row i of a run sees the first prefix_tokens + i + 1 keys of its key list.
  for (int32_t run = 0; run < plan.num_prefill_runs; ++run) {
    const kernels::PrefillRun& r = plan.prefill_runs[run];
    for (int32_t i = 0; i < r.num_rows; ++i) {
      std::vector<int32_t>& row = visible[static_cast<size_t>(r.row_begin + i)];
      for (int32_t k = 0; k < r.prefix_tokens + i + 1; ++k) row.push_back(plan.kv_slots[r.kv_begin + k]);
    }
  }
  return visible;
}

// ||out - ref|| / ||ref|| (Euclidean norms over all elements); +inf on a size mismatch.
template <typename T>
double relative_error(std::span<const T> out, std::span<const double> ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff_sq = 0.0;
  double ref_sq = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = static_cast<double>(out[i]) - ref[i];
    diff_sq += diff * diff;
    ref_sq += ref[i] * ref[i];
  }
  if (ref_sq == 0.0) return diff_sq == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff_sq / ref_sq);
}

// The seed a randomised test uses: DEFT_TEST_SEED from the environment when set (to replay a
// failure), else the test's fixed default (so CI runs are reproducible).
inline uint64_t test_seed(uint64_t default_seed) {
  if (const char* env = std::getenv("DEFT_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 0);
  }
  return default_seed;
}

// For SCOPED_TRACE: failures then print the seed and how to replay it.
inline std::string seed_message(uint64_t seed) {
  return "seed=" + std::to_string(seed) + " (replay: DEFT_TEST_SEED=" + std::to_string(seed) + ")";
}

// splitmix64: tiny, and gives the same stream on every platform and standard library (the
// std:: distributions do not), so a printed seed replays anywhere.
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : seed_(seed), state_(seed) {}
  uint64_t seed() const { return seed_; }

  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [lo, hi] (inclusive).
  int64_t uniform_int(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(next_u64() % span);
  }
  float uniform_float(float lo, float hi) { return lo + static_cast<float>(uniform()) * (hi - lo); }
  bool bernoulli(double p) { return uniform() < p; }
  // Integer in [lo, hi] with log-uniform density: many small values, some large ones.
  int64_t log_uniform_int(int64_t lo, int64_t hi) {
    const double log_lo = std::log(static_cast<double>(lo));
    const double log_hi = std::log(static_cast<double>(hi) + 1.0);
    const auto value = static_cast<int64_t>(std::exp(log_lo + uniform() * (log_hi - log_lo)));
    return std::clamp(value, lo, hi);
  }
  void fill(std::span<float> values, float lo = -1.0f, float hi = 1.0f) {
    for (float& value : values) value = uniform_float(lo, hi);
  }

 private:
  uint64_t seed_;
  uint64_t state_;
};

}  // namespace deft::test
