#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/float_convert.cuh"
#include "kernels/rope.h"

namespace deft::kernels {

namespace {

constexpr int kThreads = 256;

// One thread per (token, head, i < head_dim / 2) pair; q heads first, then k heads.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const RopeDims dims, const int32_t* __restrict__ positions,
                const float* __restrict__ inv_freq, T* __restrict__ q, T* __restrict__ k) {
  const int32_t half = dims.head_dim / 2;
  const int32_t heads = dims.num_q_heads + dims.num_kv_heads;
  const int64_t pairs = int64_t{dims.num_tokens} * heads * half;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * kThreads) {
    const int32_t pair = static_cast<int32_t>(i % half);
    const int32_t head = static_cast<int32_t>((i / half) % heads);
    const int64_t token = i / (int64_t{half} * heads);
    T* x;
    if (head < dims.num_q_heads) {
      if (q == nullptr) continue;
      x = q + token * dims.q_token_stride + head * dims.head_dim;
    } else {
      if (k == nullptr) continue;
      x = k + token * dims.k_token_stride + (head - dims.num_q_heads) * dims.head_dim;
    }
    // fp32 product as Hugging Face computes it; accurate sincosf (angles reach 1e5 rad).
    const float angle = static_cast<float>(positions[token]) * inv_freq[pair];
    float s, c;
    sincosf(angle, &s, &c);
    const float x1 = to_float(x[pair]);
    const float x2 = to_float(x[pair + half]);
    x[pair] = from_float<T>(x1 * c - x2 * s);
    x[pair + half] = from_float<T>(x2 * c + x1 * s);
  }
}

}  // namespace

void launch_rope(const RopeDims& dims, DType dtype, const int32_t* positions, const float* inv_freq,
                 void* q, void* k, cudaStream_t stream) {
  DEFT_CHECK(dims.head_dim % 2 == 0, "launch_rope: odd head_dim %d", dims.head_dim);
  const int64_t pairs =
      int64_t{dims.num_tokens} * (dims.num_q_heads + dims.num_kv_heads) * (dims.head_dim / 2);
  if (pairs <= 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((pairs + kThreads - 1) / kThreads, 8192));
  if (dtype == DType::kBf16) {
    rope_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
        dims, positions, inv_freq, static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k));
  } else {
    rope_kernel<__half><<<blocks, kThreads, 0, stream>>>(
        dims, positions, inv_freq, static_cast<__half*>(q), static_cast<__half*>(k));
  }
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
