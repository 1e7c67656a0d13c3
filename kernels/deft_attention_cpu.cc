#include "kernels/deft_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/check.h"
#include "kernels/prefill_attention_cpu.h"

namespace deft::kernels {
namespace {

// A malformed plan is a planner bug, not bad input: the checks below abort with a message in
// every build (DEFT_CHECK).

void check_dims(const AttentionDims& dims) {
  DEFT_CHECK(dims.num_q_heads > 0 && dims.num_kv_heads > 0 && dims.head_dim > 0 &&
                 dims.num_q_heads % dims.num_kv_heads == 0,
             "deft_attention_cpu: invalid dims: num_q_heads=%d num_kv_heads=%d head_dim=%d",
             dims.num_q_heads, dims.num_kv_heads, dims.head_dim);
}

// Rows of the plan's prefill runs (computed by prefill_attention_cpu, never by tasks).
std::vector<bool> prefill_rows(const AttentionPlanView& plan) {
  std::vector<bool> in_run(static_cast<size_t>(plan.num_queries), false);
  for (int32_t run = 0; run < plan.num_prefill_runs; ++run) {
    const PrefillRun& r = plan.prefill_runs[run];
    DEFT_CHECK(r.row_begin >= 0 && r.num_rows >= 0 && r.row_begin + r.num_rows <= plan.num_queries,
               "deft_attention_cpu: invalid plan: prefill run rows outside the plan (run %d, "
               "row_begin %d, rows %d, queries %d)",
               run, r.row_begin, r.num_rows, plan.num_queries);
    for (int32_t i = 0; i < r.num_rows; ++i) {
      DEFT_CHECK(!in_run[r.row_begin + i],
                 "deft_attention_cpu: invalid plan: row in two prefill runs (run %d, row %d)", run,
                 r.row_begin + i);
      in_run[r.row_begin + i] = true;
    }
  }
  return in_run;
}

// The reduction map must be consistent: query q's entries are exactly the entries whose row is q;
// a query has entries unless it is a row of a prefill run, and then it has none.
void check_reduction_map(const AttentionPlanView& plan) {
  const std::vector<bool> in_run = prefill_rows(plan);
  DEFT_CHECK(plan.query_entry_begin[0] == 0 &&
                 plan.query_entry_begin[plan.num_queries] == plan.num_entries,
             "deft_attention_cpu: invalid plan: query_entry_begin spans [%d, %d), not [0, %d)",
             plan.query_entry_begin[0], plan.query_entry_begin[plan.num_queries], plan.num_entries);
  for (int32_t query = 0; query < plan.num_queries; ++query) {
    const int32_t begin = plan.query_entry_begin[query];
    const int32_t end = plan.query_entry_begin[query + 1];
    DEFT_CHECK(end > begin || in_run[query],
               "deft_attention_cpu: invalid plan: query %d has no partial result (first entry %d)",
               query, begin);
    DEFT_CHECK(end <= begin || !in_run[query],
               "deft_attention_cpu: invalid plan: query %d of a prefill run has task entries "
               "(first entry %d)",
               query, begin);
    for (int32_t i = begin; i < end; ++i) {
      const int32_t entry = plan.query_entries[i];
      DEFT_CHECK(entry >= 0 && entry < plan.num_entries,
                 "deft_attention_cpu: invalid plan: query_entries[%d] = %d, outside [0, %d)", i,
                 entry, plan.num_entries);
      DEFT_CHECK(plan.entry_query[entry] == query,
                 "deft_attention_cpu: invalid plan: query_entries of query %d lists entry %d of "
                 "query %d",
                 query, entry, plan.entry_query[entry]);
    }
  }
}

}  // namespace

void deft_attention_stage1_cpu(const AttentionPlanView& plan, const AttentionDims& dims,
                               const float* q, const float* k_cache, const float* v_cache,
                               float* partial_out, float* partial_lse) {
  check_dims(dims);
  const int32_t head_dim = dims.head_dim;
  const int32_t group_size = dims.group_size();
  const size_t kv_token_stride = static_cast<size_t>(dims.num_kv_heads) * head_dim;
  const size_t q_row_stride = static_cast<size_t>(dims.num_q_heads) * head_dim;

  DEFT_CHECK(
      plan.task_entry_begin[0] == 0 && plan.task_entry_begin[plan.num_tasks] == plan.num_entries,
      "deft_attention_cpu: invalid plan: task_entry_begin spans [%d, %d), not [0, %d)",
      plan.task_entry_begin[0], plan.task_entry_begin[plan.num_tasks], plan.num_entries);

  std::vector<float> scores;
  std::vector<float> acc(head_dim);
  for (int32_t task = 0; task < plan.num_tasks; ++task) {
    const int32_t kv_begin = plan.task_kv_begin[task];
    const int32_t kv_end = plan.task_kv_end[task];
    const int32_t entry_begin = plan.task_entry_begin[task];
    const int32_t entry_end = plan.task_entry_begin[task + 1];
    const int32_t mask_begin = plan.task_mask_begin[task];
    const int32_t run_tokens = kv_end - kv_begin;
    DEFT_CHECK(kv_begin >= 0 && kv_end <= plan.num_kv_indices && run_tokens > 0,
               "deft_attention_cpu: invalid plan: task %d's KV run [%d, %d) out of [0, %d) or "
               "empty",
               task, kv_begin, kv_end, plan.num_kv_indices);
    DEFT_CHECK(entry_end >= entry_begin,
               "deft_attention_cpu: invalid plan: task %d's entries decrease (%d to %d)", task,
               entry_begin, entry_end);
    if (mask_begin != -1) {
      DEFT_CHECK(entry_end - entry_begin <= kMaskWordBits,
                 "deft_attention_cpu: invalid plan: masked task %d has %d entries, more than %d "
                 "mask bits",
                 task, entry_end - entry_begin, kMaskWordBits);
      DEFT_CHECK(mask_begin >= 0 && mask_begin + run_tokens <= plan.num_mask_words,
                 "deft_attention_cpu: invalid plan: task %d's mask words [%d, %d) out of [0, %d)",
                 task, mask_begin, mask_begin + run_tokens, plan.num_mask_words);
    }
    scores.resize(run_tokens);

    for (int32_t entry = entry_begin; entry < entry_end; ++entry) {
      const int32_t bit = entry - entry_begin;
      const int32_t row = plan.entry_query[entry];
      DEFT_CHECK(row >= 0 && row < plan.num_queries,
                 "deft_attention_cpu: invalid plan: entry_query[%d] = %d, outside [0, %d)", entry,
                 row, plan.num_queries);
      const auto visible = [&](int32_t i) {
        return mask_begin == -1 || ((plan.mask_words[mask_begin + i] >> bit) & 1u) != 0;
      };

      for (int32_t head = 0; head < dims.num_q_heads; ++head) {
        const int32_t kv_head = head / group_size;
        const float* q_vec = q + row * q_row_stride + static_cast<size_t>(head) * head_dim;

        // Pass 1: scaled scores of the visible tokens and their maximum.
        float max_score = -std::numeric_limits<float>::infinity();
        int32_t visible_tokens = 0;
        for (int32_t i = 0; i < run_tokens; ++i) {
          if (!visible(i)) continue;
          const int32_t slot = plan.kv_slots[kv_begin + i];
          DEFT_CHECK(slot >= 0, "deft_attention_cpu: invalid plan: kv_slots[%d] = %d", kv_begin + i,
                     slot);
          const float* k_vec =
              k_cache + slot * kv_token_stride + static_cast<size_t>(kv_head) * head_dim;
          float dot = 0.0f;
          for (int32_t d = 0; d < head_dim; ++d) dot += q_vec[d] * k_vec[d];
          scores[i] = dims.softmax_scale * dot;
          max_score = std::max(max_score, scores[i]);
          ++visible_tokens;
        }
        DEFT_CHECK(visible_tokens > 0,
                   "deft_attention_cpu: invalid plan: entry %d sees no token of its task %d", entry,
                   task);

        // Pass 2: softmax weights relative to the maximum, weighted sum of V.
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int32_t i = 0; i < run_tokens; ++i) {
          if (!visible(i)) continue;
          const int32_t slot = plan.kv_slots[kv_begin + i];
          const float* v_vec =
              v_cache + slot * kv_token_stride + static_cast<size_t>(kv_head) * head_dim;
          const float weight = std::exp(scores[i] - max_score);
          sum += weight;
          for (int32_t d = 0; d < head_dim; ++d) acc[d] += weight * v_vec[d];
        }

        float* out =
            partial_out + (static_cast<size_t>(entry) * dims.num_q_heads + head) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) out[d] = acc[d] / sum;
        partial_lse[static_cast<size_t>(entry) * dims.num_q_heads + head] =
            max_score + std::log(sum);
      }
    }
  }
}

void deft_attention_stage2_cpu(const AttentionPlanView& plan, const AttentionDims& dims,
                               const float* partial_out, const float* partial_lse, float* out,
                               float* lse_out) {
  check_dims(dims);
  check_reduction_map(plan);
  const int32_t head_dim = dims.head_dim;
  for (int32_t query = 0; query < plan.num_queries; ++query) {
    const int32_t begin = plan.query_entry_begin[query];
    const int32_t end = plan.query_entry_begin[query + 1];
    if (end == begin) continue;  // a prefill run's row
    for (int32_t head = 0; head < dims.num_q_heads; ++head) {
      const auto lse_of = [&](int32_t i) {
        return partial_lse[static_cast<size_t>(plan.query_entries[i]) * dims.num_q_heads + head];
      };
      float max_lse = -std::numeric_limits<float>::infinity();
      for (int32_t i = begin; i < end; ++i) max_lse = std::max(max_lse, lse_of(i));
      float sum = 0.0f;
      for (int32_t i = begin; i < end; ++i) sum += std::exp(lse_of(i) - max_lse);
      const float lse = max_lse + std::log(sum);

      float* dst = out + (static_cast<size_t>(query) * dims.num_q_heads + head) * head_dim;
      for (int32_t d = 0; d < head_dim; ++d) dst[d] = 0.0f;
      for (int32_t i = begin; i < end; ++i) {
        const float weight = std::exp(lse_of(i) - lse);
        const float* src =
            partial_out +
            (static_cast<size_t>(plan.query_entries[i]) * dims.num_q_heads + head) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) dst[d] += weight * src[d];
      }
      if (lse_out != nullptr) lse_out[static_cast<size_t>(query) * dims.num_q_heads + head] = lse;
    }
  }
}

void deft_attention_cpu(const AttentionPlanView& plan, const AttentionDims& dims, const float* q,
                        const float* k_cache, const float* v_cache, float* out, float* lse_out) {
  check_dims(dims);
  std::vector<float> partial_out(static_cast<size_t>(plan.num_entries) * dims.num_q_heads *
                                 dims.head_dim);
  std::vector<float> partial_lse(static_cast<size_t>(plan.num_entries) * dims.num_q_heads);
  deft_attention_stage1_cpu(plan, dims, q, k_cache, v_cache, partial_out.data(),
                            partial_lse.data());
  deft_attention_stage2_cpu(plan, dims, partial_out.data(), partial_lse.data(), out, lse_out);
  prefill_attention_cpu(plan, dims, q, k_cache, v_cache, out, lse_out);
}

}  // namespace deft::kernels
