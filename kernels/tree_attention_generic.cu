#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/float_convert.cuh"
#include "kernels/tree_attention_generic.h"

namespace deft::kernels {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kPerLane = kGenericAttentionMaxHeadDim / 32;

// The task holding entry e: the last t with task_entry_begin[t] <= e.
__device__ int32_t task_of_entry(const AttentionPlanView& plan, int32_t e) {
  int32_t lo = 0, hi = plan.num_tasks - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (plan.task_entry_begin[mid] <= e) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    tree_attention_generic_kernel(const AttentionPlanView plan, const AttentionDims dims,
                                  const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache, T* __restrict__ out) {
  const int32_t lane = threadIdx.x % 32;
  const int64_t item = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= int64_t{plan.num_queries} * dims.num_q_heads) return;
  const int32_t query = static_cast<int32_t>(item / dims.num_q_heads);
  const int32_t head = static_cast<int32_t>(item % dims.num_q_heads);
  const int32_t kv_head = head / (dims.num_q_heads / dims.num_kv_heads);
  const int64_t kv_stride = int64_t{dims.num_kv_heads} * dims.head_dim;

  float q_reg[kPerLane], acc[kPerLane];
  const T* q_row = q + item * dims.head_dim;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int32_t d = lane + 32 * j;
    q_reg[j] = d < dims.head_dim ? to_float(q_row[d]) * dims.softmax_scale : 0.0f;
    acc[j] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  // Online softmax over one key (its K/V at `base`): the warp's dot product, then the update.
  const auto attend = [&](int64_t base) {
    float score = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int32_t d = lane + 32 * j;
      if (d < dims.head_dim) score += q_reg[j] * to_float(k_cache[base + d]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      score += __shfl_xor_sync(0xffffffffu, score, offset);
    }
    const float new_max = fmaxf(running_max, score);
    const float rescale = expf(running_max - new_max);
    const float weight = expf(score - new_max);
    running_sum = running_sum * rescale + weight;
    running_max = new_max;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int32_t d = lane + 32 * j;
      if (d < dims.head_dim) acc[j] = acc[j] * rescale + weight * to_float(v_cache[base + d]);
    }
  };
  for (int32_t i = plan.query_entry_begin[query]; i < plan.query_entry_begin[query + 1]; ++i) {
    const int32_t entry = plan.query_entries[i];
    const int32_t task = task_of_entry(plan, entry);
    const int32_t bit = entry - plan.task_entry_begin[task];
    const int32_t mask_begin = plan.task_mask_begin[task];
    const int32_t kv_begin = plan.task_kv_begin[task];
    for (int32_t k = kv_begin; k < plan.task_kv_end[task]; ++k) {
      if (mask_begin >= 0 && ((plan.mask_words[mask_begin + (k - kv_begin)] >> bit) & 1u) == 0) {
        continue;
      }
      const int64_t base = int64_t{plan.kv_slots[k]} * kv_stride + int64_t{kv_head} * dims.head_dim;
      attend(base);
    }
  }
  // A row of a prefill run (no entries): keys [0, prefix_tokens + i] of the run's key list.
  for (int32_t run = 0; run < plan.num_prefill_runs; ++run) {
    const PrefillRun r = plan.prefill_runs[run];
    if (query < r.row_begin || query >= r.row_begin + r.num_rows) continue;
    const int32_t keys = r.prefix_tokens + (query - r.row_begin) + 1;
    for (int32_t k = 0; k < keys; ++k) {
      const int64_t base =
          int64_t{plan.kv_slots[r.kv_begin + k]} * kv_stride + int64_t{kv_head} * dims.head_dim;
      attend(base);
    }
    break;
  }
  T* out_row = out + item * dims.head_dim;
  const float inv_sum = running_sum > 0.0f ? 1.0f / running_sum : 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int32_t d = lane + 32 * j;
    if (d < dims.head_dim) out_row[d] = from_float<T>(acc[j] * inv_sum);
  }
}

}  // namespace

void launch_tree_attention_generic(const AttentionPlanView& device_plan, const AttentionDims& dims,
                                   DType dtype, const void* q, const void* k_cache,
                                   const void* v_cache, void* out, cudaStream_t stream) {
  DEFT_CHECK(tree_attention_generic_supported(dims),
             "launch_tree_attention_generic: unsupported head_dim %d", dims.head_dim);
  const int64_t items = int64_t{device_plan.num_queries} * dims.num_q_heads;
  if (items == 0 || (device_plan.num_tasks == 0 && device_plan.num_prefill_runs == 0)) return;
  const int blocks = static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (dtype == DType::kBf16) {
    tree_attention_generic_kernel<__nv_bfloat16><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        device_plan, dims, static_cast<const __nv_bfloat16*>(q),
        static_cast<const __nv_bfloat16*>(k_cache), static_cast<const __nv_bfloat16*>(v_cache),
        static_cast<__nv_bfloat16*>(out));
  } else {
    tree_attention_generic_kernel<__half><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        device_plan, dims, static_cast<const __half*>(q), static_cast<const __half*>(k_cache),
        static_cast<const __half*>(v_cache), static_cast<__half*>(out));
  }
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
