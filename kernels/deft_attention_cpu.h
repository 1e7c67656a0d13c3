// CPU twin of the DeFT tree-attention kernels: executes any AttentionPlanView exactly as the
// GPU kernels must (stage 1: partial attention + log-sum-exp per entry; stage 2: tree-aware
// reduction per query), with GQA and fp32 accumulation. Written for obviousness, not speed: it
// is the reference every GPU kernel is tested against and the attention of the CPU backend.
#pragma once

#include "kernels/attention_params.h"

namespace deft::kernels {

// Stage 1. For every entry e (query row entry_query[e] of task t) and every query head h:
// partial_out[e][h] = softmax-weighted sum of V over the task's visible tokens and
// partial_lse[e][h] = log(sum(exp(scale * q.k))) over those tokens (natural log).
// Query head h reads KV head h / group_size.
void deft_attention_stage1_cpu(const AttentionPlanView& plan, const AttentionDims& dims,
                               const float* q, const float* k_cache, const float* v_cache,
                               float* partial_out, float* partial_lse);

// Stage 2. For every query row with entries (prefill-run rows have none) and head, merges the
// partials of its entries: out = sum_i exp(lse_i - lse) * o_i with lse = log(sum_i exp(lse_i)).
// `lse_out` may be null.
void deft_attention_stage2_cpu(const AttentionPlanView& plan, const AttentionDims& dims,
                               const float* partial_out, const float* partial_lse, float* out,
                               float* lse_out);

// Both stages with internal scratch, then the plan's prefill runs (prefill_attention_cpu):
// out[num_queries][num_q_heads][head_dim].
void deft_attention_cpu(const AttentionPlanView& plan, const AttentionDims& dims, const float* q,
                        const float* k_cache, const float* v_cache, float* out,
                        float* lse_out = nullptr);

}  // namespace deft::kernels
