#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/kv_write.h"

namespace deft::kernels {

namespace {

constexpr int kThreads = 256;

// One thread per 16-byte chunk of a K or V row: 2-byte elements, head_dim % 8 == 0.
__global__ void __launch_bounds__(kThreads)
    kv_write_kernel(const int32_t* __restrict__ slots, const uint4* __restrict__ k_new,
                    const uint4* __restrict__ v_new, uint4* __restrict__ k_cache,
                    uint4* __restrict__ v_cache, int32_t num_tokens, int32_t row_chunks,
                    int64_t new_stride_chunks) {
  const int64_t chunks = int64_t{num_tokens} * row_chunks;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunks;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t token = i / row_chunks;
    const int64_t part = i % row_chunks;
    const int32_t slot = slots[token];
    if (slot < 0) continue;
    k_cache[int64_t{slot} * row_chunks + part] = k_new[token * new_stride_chunks + part];
    v_cache[int64_t{slot} * row_chunks + part] = v_new[token * new_stride_chunks + part];
  }
}

}  // namespace

void launch_kv_write(const KvWriteDims& dims, DType dtype, const int32_t* slots, const void* k_new,
                     const void* v_new, void* k_cache, void* v_cache, cudaStream_t stream) {
  const int64_t elem_bytes = static_cast<int64_t>(dtype_bytes(dtype));
  const int64_t row_bytes = int64_t{dims.num_kv_heads} * dims.head_dim * elem_bytes;
  const int64_t stride_bytes = dims.new_token_stride * elem_bytes;
  DEFT_CHECK(row_bytes % 16 == 0 && stride_bytes % 16 == 0,
             "launch_kv_write: rows of %lld bytes, stride %lld: need multiples of 16",
             static_cast<long long>(row_bytes), static_cast<long long>(stride_bytes));
  if (dims.num_tokens <= 0) return;
  const int32_t row_chunks = static_cast<int32_t>(row_bytes / 16);
  const int64_t chunks = int64_t{dims.num_tokens} * row_chunks;
  const int blocks = static_cast<int>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, 4096));
  kv_write_kernel<<<blocks, kThreads, 0, stream>>>(
      slots, static_cast<const uint4*>(k_new), static_cast<const uint4*>(v_new),
      static_cast<uint4*>(k_cache), static_cast<uint4*>(v_cache), dims.num_tokens, row_chunks,
      stride_bytes / 16);
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
