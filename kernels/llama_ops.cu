#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/float_convert.cuh"
#include "kernels/llama_ops.h"

namespace deft::kernels {

namespace {

constexpr int kThreads = 256;

int grid_for(int64_t items) {
  return static_cast<int>(std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1, 65536));
}

// Runs `body` with the element type of `dtype`.
template <typename Body>
void with_type(DType dtype, Body&& body) {
  if (dtype == DType::kBf16) {
    body(__nv_bfloat16{});
  } else {
    body(__half{});
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    embedding_kernel(int32_t num_tokens, int32_t width, const int32_t* __restrict__ tokens,
                     const T* __restrict__ table, float* __restrict__ out) {
  const int64_t total = int64_t{num_tokens} * width;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t t = i / width;
    out[i] = to_float(table[int64_t{tokens[t]} * width + (i - t * width)]);
  }
}

// One block per output row: sum of squares in fp32 (block reduction), then the scaled row.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const RmsNormDims dims, const int32_t* __restrict__ row_index,
                    float* __restrict__ x, const float* __restrict__ add_bias,
                    const float* __restrict__ weight, T* __restrict__ out) {
  __shared__ float warp_sums[kThreads / 32];
  const int32_t i = blockIdx.x;
  const int64_t r = row_index != nullptr ? row_index[i] : i;
  float* in = x + r * dims.width;
  float sum = 0.0f;
  for (int32_t c = threadIdx.x; c < dims.width; c += kThreads) {
    float v = in[c];
    if (add_bias != nullptr) {
      v += add_bias[c];
      in[c] = v;
    }
    sum += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float inv_rms = rsqrtf(warp_sums[0] / dims.width + dims.eps);
  T* dst = out + int64_t{i} * dims.width;
  for (int32_t c = threadIdx.x; c < dims.width; c += kThreads) {
    dst[c] = from_float<T>(weight[c] * (in[c] * inv_rms));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(int32_t num_rows, int32_t width, const T* __restrict__ gate_up,
                    T* __restrict__ out) {
  const int64_t total = int64_t{num_rows} * width;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const float gate = to_float(gate_up[r * 2 * width + c]);
    const float up = to_float(gate_up[r * 2 * width + width + c]);
    out[i] = from_float<T>(gate / (1.0f + __expf(-gate)) * up);
  }
}

// One thread per (token, head, i < head_dim / 2): q heads, then k heads (rotated), then v heads
// (copied); elements i and i + head_dim / 2 of the head.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    qkv_rope_write_kernel(const QkvRopeDims dims, const int32_t* __restrict__ positions,
                          const int32_t* __restrict__ slots, const float* __restrict__ inv_freq,
                          const T* __restrict__ qkv, const float* __restrict__ bias,
                          T* __restrict__ q_out, T* __restrict__ k_cache, T* __restrict__ v_cache) {
  // The attention after it may start reading its plan (it waits for us before Q and the KV).
  detail::allow_dependent_launch();
  const int32_t half = dims.head_dim / 2;
  const int32_t heads = dims.num_q_heads + 2 * dims.num_kv_heads;
  const int32_t width = heads * dims.head_dim;
  const int64_t kv_size = int64_t{dims.num_kv_heads} * dims.head_dim;
  const int64_t total = int64_t{dims.num_tokens} * heads * half;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * kThreads) {
    const int32_t pair = static_cast<int32_t>(i % half);
    const int32_t head = static_cast<int32_t>((i / half) % heads);
    const int64_t token = i / (int64_t{half} * heads);
    const int32_t c1 = head * dims.head_dim + pair;
    const int32_t c2 = c1 + half;
    float x1 = to_float(qkv[token * width + c1]);
    float x2 = to_float(qkv[token * width + c2]);
    if (bias != nullptr) {
      x1 += bias[c1];
      x2 += bias[c2];
    }
    const int32_t slot = slots[token];
    T* dst;
    if (head < dims.num_q_heads) {
      dst = q_out + token * dims.num_q_heads * dims.head_dim + head * dims.head_dim;
    } else if (slot < 0) {
      continue;
    } else if (head < dims.num_q_heads + dims.num_kv_heads) {
      dst = k_cache + slot * kv_size + (head - dims.num_q_heads) * dims.head_dim;
    } else {
      dst =
          v_cache + slot * kv_size + (head - dims.num_q_heads - dims.num_kv_heads) * dims.head_dim;
      dst[pair] = from_float<T>(x1);
      dst[pair + half] = from_float<T>(x2);
      continue;
    }
    // fp32 angle as transformers computes it; accurate sincosf (angles reach 1e5 rad).
    const float angle = static_cast<float>(positions[token]) * inv_freq[pair];
    float s, c;
    sincosf(angle, &s, &c);
    dst[pair] = from_float<T>(x1 * c - x2 * s);
    dst[pair + half] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    random_uniform_kernel(int64_t count, uint64_t seed, float scale, float offset,
                          T* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * kThreads) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i) + 0x632be59bd9b4e019ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    // No FMA contraction, so the value is random_uniform_value's bit for bit.
    out[i] = from_float<T>(__fadd_rn(offset, __fmul_rn(scale, __fsub_rn(2.0f * u, 1.0f))));
  }
}

}  // namespace

void launch_embedding(int32_t num_tokens, int32_t width, DType dtype, const int32_t* tokens,
                      const void* table, float* out, cudaStream_t stream) {
  if (num_tokens <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    embedding_kernel<T><<<grid_for(int64_t{num_tokens} * width), kThreads, 0, stream>>>(
        num_tokens, width, tokens, static_cast<const T*>(table), out);
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_rms_norm(const RmsNormDims& dims, DType dtype, const int32_t* row_index, float* x,
                     const float* add_bias, const float* weight, void* out, cudaStream_t stream) {
  if (row_index != nullptr && add_bias != nullptr) {
    std::fprintf(stderr, "launch_rms_norm: add_bias with a row gather\n");
    std::abort();
  }
  if (dims.num_rows <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T><<<dims.num_rows, kThreads, 0, stream>>>(dims, row_index, x, add_bias, weight,
                                                               static_cast<T*>(out));
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_silu_mul(int32_t num_rows, int32_t width, DType dtype, const void* gate_up, void* out,
                     cudaStream_t stream) {
  if (num_rows <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_kernel<T><<<grid_for(int64_t{num_rows} * width), kThreads, 0, stream>>>(
        num_rows, width, static_cast<const T*>(gate_up), static_cast<T*>(out));
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_qkv_rope_write(const QkvRopeDims& dims, DType dtype, const int32_t* positions,
                           const int32_t* slots, const float* inv_freq, const void* qkv,
                           const float* bias, void* q_out, void* k_cache, void* v_cache,
                           cudaStream_t stream) {
  if (dims.head_dim % 2 != 0) {
    std::fprintf(stderr, "launch_qkv_rope_write: odd head_dim %d\n", dims.head_dim);
    std::abort();
  }
  const int64_t items =
      int64_t{dims.num_tokens} * (dims.num_q_heads + 2 * dims.num_kv_heads) * (dims.head_dim / 2);
  if (items <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    qkv_rope_write_kernel<T><<<grid_for(items), kThreads, 0, stream>>>(
        dims, positions, slots, inv_freq, static_cast<const T*>(qkv), bias, static_cast<T*>(q_out),
        static_cast<T*>(k_cache), static_cast<T*>(v_cache));
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_random_uniform(int64_t count, uint64_t seed, float scale, float offset, DType dtype,
                           void* out, cudaStream_t stream) {
  if (count <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    random_uniform_kernel<T><<<grid_for(count), kThreads, 0, stream>>>(count, seed, scale, offset,
                                                                       static_cast<T*>(out));
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
