// Host side of the prefill attention kernel: launch shape (Q tiles, KV splits), split scratch,
// and the one place that instantiates kernels/prefill_attention.cuh (bf16/fp16 x 64/128).
#include <algorithm>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/per_device.h"
#include "kernels/prefill_attention.cuh"
#include "kernels/prefill_attention.h"

namespace deft::kernels {

namespace {

// Split-KV: CTAs wanted per SM before a launch counts as filling the GPU (3 CTAs of 64 rows fit
// an SM), the fewest key tiles a split keeps (4 x 64 keys: below that the merge costs more than
// the parallelism gains), and the most splits.
constexpr int32_t kTargetCtasPerSm = 3;
constexpr int32_t kMinTilesPerSplit = 4;
constexpr int32_t kMaxSplits = 16;

template <typename T, int kHeadDim>
void launch_typed(const detail::PrefillParams& params, const PrefillLaunchShape& shape,
                  int32_t num_kv_heads, cudaStream_t stream) {
  auto* kernel = &detail::prefill_attention_kernel<T, kHeadDim>;
  constexpr int kSmemBytes = detail::PrefillSmem<kHeadDim>::kBytes;
  static PerDevice<bool> smem_configured;  // a function attribute is per device
  smem_configured.get([&] {
    DEFT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  });
  const dim3 grid(static_cast<unsigned>(shape.q_tiles), static_cast<unsigned>(num_kv_heads),
                  static_cast<unsigned>(shape.kv_splits));
  kernel<<<grid, detail::kPrefillThreads, kSmemBytes, stream>>>(params);
  DEFT_CUDA_CHECK_LAUNCH();
  if (shape.kv_splits > 1) {
    const dim3 merge_grid(
        static_cast<unsigned>(shape.prefill_rows),
        static_cast<unsigned>((params.num_q_heads + detail::kPrefillMergeWarps - 1) /
                              detail::kPrefillMergeWarps));
    detail::prefill_attention_merge_kernel<T, kHeadDim>
        <<<merge_grid, detail::kPrefillMergeWarps * 32, 0, stream>>>(params);
    DEFT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool prefill_attention_supported(const AttentionDims& dims) {
  return (dims.head_dim == 64 || dims.head_dim == 128) && dims.softmax_scale > 0.0f &&
         dims.num_kv_heads > 0 && dims.num_q_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0;
}

PrefillLaunchShape prefill_launch_shape(std::span<const PrefillRun> host_runs,
                                        const AttentionDims& dims, int32_t num_sms) {
  PrefillLaunchShape shape;
  const int64_t group = dims.group_size();
  int32_t max_key_tiles = 0;
  for (const PrefillRun& run : host_runs) {
    shape.q_tiles += static_cast<int32_t>((run.num_rows * group + detail::kPrefillRows - 1) /
                                          detail::kPrefillRows);
    shape.prefill_rows += run.num_rows;
    max_key_tiles =
        std::max(max_key_tiles, (run.prefix_tokens + run.num_rows + detail::kKvTileTokens - 1) /
                                    detail::kKvTileTokens);
  }
  const int64_t ctas = int64_t{shape.q_tiles} * dims.num_kv_heads;
  const int64_t target = int64_t{num_sms} * kTargetCtasPerSm;
  if (ctas > 0 && ctas < target) {
    const int64_t wanted = (target + ctas - 1) / ctas;
    shape.kv_splits = static_cast<int32_t>(std::clamp<int64_t>(
        std::min<int64_t>(wanted, max_key_tiles / kMinTilesPerSplit), 1, kMaxSplits));
  }
  return shape;
}

void PrefillAttentionBuffers::reserve(const PrefillLaunchShape& shape, const AttentionDims& dims) {
  if (shape.kv_splits <= 1) return;
  const size_t rows = static_cast<size_t>(shape.kv_splits) * shape.prefill_rows * dims.num_q_heads;
  scratch_.reserve(rows * (dims.head_dim + 1) * sizeof(float));
}

void launch_prefill_attention(const AttentionPlanView& device_plan,
                              std::span<const PrefillRun> host_runs, const AttentionDims& dims,
                              DType dtype, const void* q, const void* k_cache, const void* v_cache,
                              PrefillAttentionBuffers& buffers, void* out, cudaStream_t stream) {
  DEFT_CHECK(prefill_attention_supported(dims),
             "launch_prefill_attention: unsupported head_dim %d, heads %d / %d KV or "
             "softmax_scale %g <= 0",
             dims.head_dim, dims.num_q_heads, dims.num_kv_heads, dims.softmax_scale);
  if (host_runs.empty()) return;
  DEFT_CHECK(static_cast<int32_t>(host_runs.size()) == device_plan.num_prefill_runs,
             "launch_prefill_attention: %zu host prefill runs, %d in the device plan",
             host_runs.size(), device_plan.num_prefill_runs);
  const PrefillLaunchShape shape = prefill_launch_shape(host_runs, dims, current_device_sm_count());
  if (shape.q_tiles == 0) return;
  buffers.reserve(shape, dims);

  detail::PrefillParams params{};
  params.runs = device_plan.prefill_runs;
  params.num_runs = device_plan.num_prefill_runs;
  params.kv_slots = device_plan.kv_slots;
  params.q = q;
  params.k_cache = k_cache;
  params.v_cache = v_cache;
  params.out = out;
  params.scratch = buffers.scratch();
  params.prefill_rows = shape.prefill_rows;
  params.kv_splits = shape.kv_splits;
  params.num_q_heads = dims.num_q_heads;
  params.num_kv_heads = dims.num_kv_heads;
  params.group_size = dims.group_size();
  params.scale_log2 = dims.softmax_scale * 1.4426950408889634f;

  const auto run = [&](auto type_tag, auto head_dim_tag) {
    launch_typed<decltype(type_tag), decltype(head_dim_tag)::value>(params, shape,
                                                                    dims.num_kv_heads, stream);
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dtype == DType::kBf16) {
    dims.head_dim == 64 ? run(__nv_bfloat16{}, D64{}) : run(__nv_bfloat16{}, D128{});
  } else {
    dims.head_dim == 64 ? run(__half{}, D64{}) : run(__half{}, D128{});
  }
}

}  // namespace deft::kernels
