// Host API of the prefill attention kernel (GPU): the plan's prefill runs (kernels/
// attention_params.h: PrefillRun), each a run of new tokens of one node that sees its prefix in
// full and its own tokens causally. FlashAttention-2 style: one CTA per (64-row Q tile, KV head
// [, KV split]), rows = the tile's tokens x the KV head's GQA group, so each KV tile is loaded
// once (cp.async, double buffered, gathered through kv_slots) for every query head that uses it;
// QK^T and PV on tensor cores (mma.sync, fp32 accumulation), online softmax, causal masking only
// on the tiles that need it. Runs whose tiles are too few to fill the GPU split their keys over
// several CTAs whose partial results a merge kernel combines. Writes the same output rows as the
// DeFT kernels ([num_queries][num_q_heads][head_dim]), so a step mixes both: DeFT for the
// plan's tasks, this kernel for its prefill runs, in any order on one stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "kernels/attention_params.h"
#include "kernels/device_buffer.h"
#include "kernels/dtype.h"

namespace deft::kernels {

// Same shapes as the DeFT kernels: bf16/fp16, head_dim 64/128, any GQA group, scale > 0.
bool prefill_attention_supported(const AttentionDims& dims);

// How a launch cuts the work (host-side, from the runs' sizes): Q tiles and KV splits.
struct PrefillLaunchShape {
  int32_t q_tiles = 0;      // CTAs per KV head per split: sum over runs of ceil(rows x group / 64)
  int32_t kv_splits = 1;    // > 1: partial results + merge
  int32_t prefill_rows = 0; // sum of the runs' num_rows
};
PrefillLaunchShape prefill_launch_shape(std::span<const PrefillRun> host_runs,
                                        const AttentionDims& dims, int32_t num_sms);

// Scratch of the split-KV path: [kv_splits][prefill_rows][num_q_heads] x (head_dim + 1) fp32.
class PrefillAttentionBuffers {
 public:
  void reserve(const PrefillLaunchShape& shape, const AttentionDims& dims);
  float* scratch() const { return scratch_.as<float>(); }

 private:
  DeviceBuffer scratch_;
};

// Runs the prefill runs of `device_plan` (device pointers: prefill_runs, kv_slots) on `stream`.
// `host_runs` is the host copy of the same runs (sizes the grid; DevicePlan::prefill_runs()).
//   q:       [num_queries][num_q_heads][head_dim]   (dtype)
//   k_cache: [num_slots][num_kv_heads][head_dim]    (dtype), v_cache likewise
//   out:     [num_queries][num_q_heads][head_dim]   (dtype); only the runs' rows are written
// `buffers` must have been reserved for prefill_launch_shape(host_runs, dims, sms) when that
// shape has kv_splits > 1. No host synchronisation: capturable in a CUDA graph.
// Aborts on unsupported dims (check prefill_attention_supported at load time).
void launch_prefill_attention(const AttentionPlanView& device_plan,
                              std::span<const PrefillRun> host_runs, const AttentionDims& dims,
                              DType dtype, const void* q, const void* k_cache, const void* v_cache,
                              PrefillAttentionBuffers& buffers, void* out, cudaStream_t stream);

}  // namespace deft::kernels
