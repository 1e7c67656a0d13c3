// Stage 2 of DeFT attention: the tree-aware merge of each query's partial results (O rows in
// the attention's dtype, fp32 LSEs) that stage 1 (kernels/deft_attention.cuh) wrote, as
// FlashInfer's merge_states: out = sum_i exp(lse_i - max) o_i / sum_i exp(lse_i - max).
#pragma once

#include "kernels/deft_attention_common.cuh"

namespace deft::kernels::detail {

// ---- stage 2 ----------------------------------------------------------------------------------

// One warp per (query, head), kStage2Warps heads per CTA. A query's partials go 32 at a time (a
// lane each: its row, LSE and weight, broadcast by shuffles), their O rows kBatch at a time into
// registers. The first batch's loads go out together with the LSEs', so a query of up to kBatch
// partials costs one memory round trip after stage 1 (the plan's rows are read before the wait).
// Loading the LSEs first, then the rows 8 at a time, took four: 7.4 µs for 20 few-shot queries
// in the H100's decode step (ncu), where stage 2 sits between stage 1 and the O projection. A
// larger batch holds more registers (head_dim 128: 32 rows 96 a thread, 8 rows 48), so the launch
// picks the batch (stage2_choice_for in deft_attention.cu): the smallest that takes the plan's
// largest query in one trip among those whose grid fits on the GPU at once.
template <typename T, int kHeadDim, int kBatch>
__global__ void __launch_bounds__(kStage2Threads)
    deft_attention_stage2_kernel(const __grid_constant__ AttentionPlanView plan,
                                 const T* __restrict__ partial_out,
                                 const float* __restrict__ partial_lse, T* __restrict__ out,
                                 int32_t num_q_heads, const WeightPrefetch prefetch) {
  constexpr int kPerLane = kHeadDim / 32;  // 2 or 4 consecutive values per lane
  static_assert(kPerLane == 2 || kPerLane == 4, "head_dim 64 or 128");
  static_assert(kBatch > 0 && 32 % kBatch == 0, "batches tile a lane's 32 partials");
  // The next layer's stage 1 may be scheduled (it waits for us before touching our outputs).
  allow_dependent_launch();
  // The O projection's weights, once stage 1 is done (prefetch_weight_rows waits for it): during
  // stage 1 the prefetch slowed its KV reads more than it sped up the GEMM (H100;
  // bench/results/kernel_attention-h100-notes.md).
  if (prefetch_weight_rows(prefetch)) return;
  const int query = blockIdx.x;
  const int begin = plan.query_entry_begin[query];
  const int count = plan.query_entry_begin[query + 1] - begin;
  if (count <= 1) {  // written by stage 1 directly (or a prefill run's row: no entry)
    // One CTA waits for stage 1 whatever the plan, so this grid never completes before stage 1
    // (work after it in the stream relies on that even when no query needs a merge).
    if (blockIdx.x == 0 && blockIdx.y == 0) wait_for_prerequisite_grid();
    return;
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * kStage2Warps + warp;
  if (head >= num_q_heads) return;

  const auto partial_row = [&](int i) {
    return static_cast<int64_t>(plan.query_entries[begin + i]) * num_q_heads + head;
  };
  const int64_t first_row = lane < count ? partial_row(lane) : 0;

  wait_for_prerequisite_grid();  // stage 1's partials are visible from here on

  // This lane's columns of the O rows of partials [first, first + n) of a 32 (lanes' rows
  // my_row), all loads issued at once.
  // Kept packed until used (kPerLane / 2 words a row): a batch of 32 rows converted on load
  // would hold twice the registers and no longer have all its loads in flight at once.
  uint32_t o[kBatch][kPerLane / 2];
  const auto load_batch = [&](int64_t my_row, int first, int n) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t row = __shfl_sync(0xffffffffu, my_row, first + j);
      if (j < n) {
        const T* src = partial_out + row * kHeadDim + lane * kPerLane;
        if constexpr (kPerLane == 4) {
          const uint2 v = *reinterpret_cast<const uint2*>(src);
          o[j][0] = v.x;
          o[j][1] = v.y;
        } else {
          o[j][0] = *reinterpret_cast<const uint32_t*>(src);
        }
      }
    }
  };
  const float first_lse = lane < count ? partial_lse[first_row] : kNegInf;
  load_batch(first_row, 0, min(kBatch, count));
  // The maximum LSE (partials past the first 32: a further pass over their LSEs).
  float lse_max = first_lse;
  for (int i = lane + 32; i < count; i += 32) lse_max = fmaxf(lse_max, partial_lse[partial_row(i)]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
  }
  const float base = lse_max == kNegInf ? 0.0f : lse_max;

  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  float denom = 0.0f;
  int64_t my_row = first_row;
  float my_lse = first_lse;
  for (int chunk = 0; chunk < count; chunk += 32) {
    const int chunk_count = min(32, count - chunk);
    if (chunk > 0) {
      my_row = lane < chunk_count ? partial_row(chunk + lane) : 0;
      my_lse = lane < chunk_count ? partial_lse[my_row] : kNegInf;
    }
    const float my_weight = my_lse == kNegInf ? 0.0f : expf(my_lse - base);
    denom += my_weight;
    for (int first = 0; first < chunk_count; first += kBatch) {
      const int n = min(kBatch, chunk_count - first);
      if (chunk > 0 || first > 0) load_batch(my_row, first, n);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float weight = __shfl_sync(0xffffffffu, my_weight, first + j);
        if (j < n) {
#pragma unroll
          for (int w = 0; w < kPerLane / 2; ++w) {
            const float2 v = ElemTraits<T>::unpack(o[j][w]);
            acc[2 * w] += weight * v.x;
            acc[2 * w + 1] += weight * v.y;
          }
        }
      }
    }
    // This chunk's partial rows are dead (every lane's loads of them are in acc): each lane
    // drops its own row (whole 128-byte lines) from L2 unwritten.
    __syncwarp();
    if (lane < chunk_count) {
#pragma unroll
      for (int line = 0; line < kHeadDim * static_cast<int>(sizeof(T)) / kL2LineBytes; ++line) {
        discard_l2_line(partial_out + my_row * kHeadDim +
                        line * (kL2LineBytes / static_cast<int>(sizeof(T))));
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    denom += __shfl_xor_sync(0xffffffffu, denom, offset);
  }
  const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;
  T* out_row =
      out + (static_cast<int64_t>(query) * num_q_heads + head) * kHeadDim + lane * kPerLane;
  if constexpr (kPerLane == 4) {
    *reinterpret_cast<uint2*>(out_row) =
        make_uint2(ElemTraits<T>::pack(acc[0] * inv_denom, acc[1] * inv_denom),
                   ElemTraits<T>::pack(acc[2] * inv_denom, acc[3] * inv_denom));
  } else {
    *reinterpret_cast<uint32_t*>(out_row) =
        ElemTraits<T>::pack(acc[0] * inv_denom, acc[1] * inv_denom);
  }
}

}  // namespace deft::kernels::detail
