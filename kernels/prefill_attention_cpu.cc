#include "kernels/prefill_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/check.h"

namespace deft::kernels {

void prefill_attention_cpu(const AttentionPlanView& plan, const AttentionDims& dims, const float* q,
                           const float* k_cache, const float* v_cache, float* out, float* lse_out) {
  const size_t head_dim = static_cast<size_t>(dims.head_dim);
  const size_t kv_stride = static_cast<size_t>(dims.num_kv_heads) * head_dim;
  const int32_t group = dims.group_size();
  std::vector<float> scores;
  std::vector<float> acc(head_dim);
  for (int32_t run = 0; run < plan.num_prefill_runs; ++run) {
    const PrefillRun& r = plan.prefill_runs[run];
    DEFT_CHECK(r.num_rows >= 0 && r.prefix_tokens >= 0 && r.row_begin >= 0 &&
                   r.row_begin + r.num_rows <= plan.num_queries && r.kv_begin >= 0 &&
                   r.kv_begin + r.prefix_tokens + r.num_rows <= plan.num_kv_indices,
               "prefill_attention_cpu: invalid plan: run %d out of range (rows [%d, %d) of %d "
               "queries, keys [%d, %d) of %d)",
               run, r.row_begin, r.row_begin + r.num_rows, plan.num_queries, r.kv_begin,
               r.kv_begin + r.prefix_tokens + r.num_rows, plan.num_kv_indices);
    const int32_t* slots = plan.kv_slots + r.kv_begin;
    for (int32_t i = 0; i < r.num_rows; ++i) {
      const int32_t keys = r.prefix_tokens + i + 1;
      const size_t row = static_cast<size_t>(r.row_begin + i);
      scores.resize(static_cast<size_t>(keys));
      for (int32_t head = 0; head < dims.num_q_heads; ++head) {
        const size_t kv_head = static_cast<size_t>(head / group);
        const float* q_vec = q + (row * dims.num_q_heads + head) * head_dim;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int32_t k = 0; k < keys; ++k) {
          const float* k_vec =
              k_cache + static_cast<size_t>(slots[k]) * kv_stride + kv_head * head_dim;
          float dot = 0.0f;
          for (size_t d = 0; d < head_dim; ++d) dot += q_vec[d] * k_vec[d];
          scores[k] = dot * dims.softmax_scale;
          max_score = std::max(max_score, scores[k]);
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int32_t k = 0; k < keys; ++k) {
          const float weight = std::exp(scores[k] - max_score);
          sum += weight;
          const float* v_vec =
              v_cache + static_cast<size_t>(slots[k]) * kv_stride + kv_head * head_dim;
          for (size_t d = 0; d < head_dim; ++d) acc[d] += weight * v_vec[d];
        }
        float* dst = out + (row * dims.num_q_heads + head) * head_dim;
        for (size_t d = 0; d < head_dim; ++d) dst[d] = acc[d] / sum;
        if (lse_out != nullptr) lse_out[row * dims.num_q_heads + head] = max_score + std::log(sum);
      }
    }
  }
}

}  // namespace deft::kernels
