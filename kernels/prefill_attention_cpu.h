// CPU twin of the prefill attention kernel (kernels/prefill_attention.h): for every prefill run
// of the plan, row i of the run attends to keys [0, prefix_tokens + i] of its key list, every
// query head h to KV head h / group_size, fp32 accumulation. Written for obviousness. It also
// serves deft_attention_cpu, which executes a whole plan (tasks and prefill runs).
#pragma once

#include "kernels/attention_params.h"

namespace deft::kernels {

// Writes out[row][head][:] for the rows of the plan's prefill runs only.
//   q, out: [num_queries][num_q_heads][head_dim]; k_cache, v_cache: [slots][num_kv_heads][head_dim]
void prefill_attention_cpu(const AttentionPlanView& plan, const AttentionDims& dims, const float* q,
                           const float* k_cache, const float* v_cache, float* out,
                           float* lse_out = nullptr);

}  // namespace deft::kernels
