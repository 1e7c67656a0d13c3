// A plain GPU executor of an AttentionPlanView for the shapes the DeFT kernels are not built
// for (head_dim other than 64/128: the tiny test checkpoints and the embedded default model).
// One warp per (query, q head) walks that query's entries and their tasks' visible KV tokens
// with an online softmax (rows of the plan's prefill runs walk their run's keys): no partials,
// no stage 2, no tensor cores. Same contract and the same
// CPU twin as the DeFT kernels (kernels/deft_attention_cpu.h: deft_attention_cpu); correctness
// only: real models run the DeFT kernels.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention_params.h"
#include "kernels/dtype.h"

namespace deft::kernels {

// Largest head_dim the generic kernel takes (8 values per lane of a warp).
inline constexpr int32_t kGenericAttentionMaxHeadDim = 256;

inline bool tree_attention_generic_supported(const AttentionDims& dims) {
  return dims.head_dim > 0 && dims.head_dim <= kGenericAttentionMaxHeadDim &&
         dims.num_kv_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0;
}

// device_plan: device pointers; q, out: [num_queries][num_q_heads][head_dim]; caches
// [num_slots][num_kv_heads][head_dim]; all `dtype`. Aborts on unsupported dims.
void launch_tree_attention_generic(const AttentionPlanView& device_plan, const AttentionDims& dims,
                                   DType dtype, const void* q, const void* k_cache,
                                   const void* v_cache, void* out, cudaStream_t stream);

}  // namespace deft::kernels
