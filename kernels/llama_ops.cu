#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/device_info.h"
#include "kernels/float_convert.cuh"
#include "kernels/l2_discard.cuh"
#include "kernels/l2_prefetch.cuh"
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

// Sum of `value` over the block (kThreads threads); every thread gets the total.
__device__ __forceinline__ float block_sum(float value) {
  __shared__ float warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  value = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) value += warp_sums[w];
  return value;
}

__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + __expf(-gate)) * up;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }

// Launches `kernel` with programmatic stream serialization: it may be scheduled while the kernel
// before it drains, and waits for it (wait_for_prerequisite_grid) before touching its outputs.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, cudaStream_t stream,
                      Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  DEFT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
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
// The general form: any width and alignment, the row read twice (from L2 the second time).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const RmsNormDims dims, const int32_t* __restrict__ row_index,
                    float* __restrict__ x, const float* __restrict__ add_bias,
                    const float* __restrict__ weight, T* __restrict__ out,
                    const WeightPrefetch prefetch, const L2Discard discard) {
  // The GEMM after it may start streaming its weights (it waits for our output itself).
  detail::allow_dependent_launch();
  if (detail::prefetch_weight_rows(prefetch)) return;
  detail::wait_for_prerequisite_grid();
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
  const float inv_rms = rsqrtf(block_sum(sum) / dims.width + dims.eps);
  T* dst = out + int64_t{i} * dims.width;
  for (int32_t c = threadIdx.x; c < dims.width; c += kThreads) {
    dst[c] = from_float<T>(weight[c] * (in[c] * inv_rms));
  }
  detail::discard_l2_ranges(discard, int64_t{i} * kThreads + threadIdx.x,
                            int64_t{dims.num_rows} * kThreads);
}

// Rows of up to this many float4s per thread stay in registers (8192 wide at 256 threads).
constexpr int kNormVectors = 8;

// The common form (width a multiple of 4, 16-byte aligned rows, width <= 4 * kNormVectors *
// kThreads): the weights (and bias) are loaded before waiting for the kernel before (they do not
// depend on it), the row's float4s right after, so a decode step's norm is one short round trip
// (weights loaded after the sum would make it two); the row stays in registers between the sum
// and the scaling.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_vector_kernel(const RmsNormDims dims, const int32_t* __restrict__ row_index,
                           float* __restrict__ x, const float* __restrict__ add_bias,
                           const float* __restrict__ weight, T* __restrict__ out,
                           const WeightPrefetch prefetch, const L2Discard discard) {
  // The GEMM after it may start streaming its weights (it waits for our output itself).
  detail::allow_dependent_launch();
  if (detail::prefetch_weight_rows(prefetch)) return;
  const int32_t vectors = dims.width / 4;
  float4 w[kNormVectors], b[kNormVectors];
#pragma unroll
  for (int k = 0; k < kNormVectors; ++k) {
    const int32_t c = threadIdx.x + k * kThreads;
    if (c >= vectors) continue;
    w[k] = reinterpret_cast<const float4*>(weight)[c];
    if (add_bias != nullptr) b[k] = reinterpret_cast<const float4*>(add_bias)[c];
  }
  detail::wait_for_prerequisite_grid();
  const int32_t i = blockIdx.x;
  const int64_t r = row_index != nullptr ? row_index[i] : i;
  float4* in = reinterpret_cast<float4*>(x + r * dims.width);
  float4 v[kNormVectors];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormVectors; ++k) {
    const int32_t c = threadIdx.x + k * kThreads;
    if (c < vectors) v[k] = in[c];
  }
#pragma unroll
  for (int k = 0; k < kNormVectors; ++k) {
    const int32_t c = threadIdx.x + k * kThreads;
    if (c >= vectors) continue;
    if (add_bias != nullptr) {
      v[k] = make_float4(v[k].x + b[k].x, v[k].y + b[k].y, v[k].z + b[k].z, v[k].w + b[k].w);
      in[c] = v[k];
    }
    sum += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  }
  const float inv_rms = rsqrtf(block_sum(sum) / dims.width + dims.eps);
  T* dst = out + int64_t{i} * dims.width;
#pragma unroll
  for (int k = 0; k < kNormVectors; ++k) {
    const int32_t c = threadIdx.x + k * kThreads;
    if (c >= vectors) continue;
    store4(dst + 4 * c, w[k].x * (v[k].x * inv_rms), w[k].y * (v[k].y * inv_rms),
           w[k].z * (v[k].z * inv_rms), w[k].w * (v[k].w * inv_rms));
  }
  detail::discard_l2_ranges(discard, int64_t{i} * kThreads + threadIdx.x,
                            int64_t{dims.num_rows} * kThreads);
}

// out = silu(gate) * up, one element per thread (any width).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(int32_t num_rows, int32_t width, const T* __restrict__ gate_up,
                    T* __restrict__ out, const WeightPrefetch prefetch) {
  detail::allow_dependent_launch();  // the GEMM after it, as above
  if (detail::prefetch_weight_rows(prefetch)) return;
  detail::wait_for_prerequisite_grid();
  const int64_t blocks = detail::own_blocks(prefetch);
  const int64_t total = int64_t{num_rows} * width;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total;
       i += blocks * kThreads) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    out[i] = from_float<T>(silu_mul(to_float(gate_up[r * 2 * width + c]),
                                    to_float(gate_up[r * 2 * width + width + c])));
  }
}

// The same, 8 elements (16 bytes) per thread, for widths that are a multiple of 8 on 16-byte
// aligned buffers.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_vector_kernel(int32_t num_rows, int32_t width, const T* __restrict__ gate_up,
                           T* __restrict__ out, const WeightPrefetch prefetch) {
  detail::allow_dependent_launch();  // the GEMM after it, as above
  if (detail::prefetch_weight_rows(prefetch)) return;
  detail::wait_for_prerequisite_grid();
  const int64_t blocks = detail::own_blocks(prefetch);
  const int32_t vectors_per_row = width / 8;
  const int64_t total = int64_t{num_rows} * vectors_per_row;
  // gate_up is dead once read: a whole warp's 512-byte spans of gate and up (32 consecutive
  // vectors of one row, when rows hold whole spans and the buffer is aligned to them) are
  // dropped from L2 unwritten.
  constexpr int kSpanBytes = 32 * 16;
  const bool discard = vectors_per_row % 32 == 0 && (width * sizeof(T)) % kSpanBytes == 0 &&
                       reinterpret_cast<uintptr_t>(gate_up) % kSpanBytes == 0;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total;
       i += blocks * kThreads) {
    const int64_t r = i / vectors_per_row;
    const int64_t c = (i - r * vectors_per_row) * 8;
    const uint4 gate_bits = *reinterpret_cast<const uint4*>(gate_up + r * 2 * width + c);
    const uint4 up_bits = *reinterpret_cast<const uint4*>(gate_up + r * 2 * width + width + c);
    const T* gate = reinterpret_cast<const T*>(&gate_bits);
    const T* up = reinterpret_cast<const T*>(&up_bits);
    uint4 result;
    T* y = reinterpret_cast<T*>(&result);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = from_float<T>(silu_mul(to_float(gate[j]), to_float(up[j])));
    *reinterpret_cast<uint4*>(out + r * width + c) = result;
    if (discard && __activemask() == 0xffffffffu) {
      __syncwarp();  // every lane's loads are done (their values are in `result`)
      constexpr int kSpanLines = kSpanBytes / detail::kL2LineBytes;
      if (lane < 2 * kSpanLines) {
        // The first kSpanLines lanes drop gate's span, the next up's; a span starts at lane 0's
        // column, c - 8 * lane (the warp's vectors are consecutive in one row).
        const int32_t line = lane % kSpanLines;
        const T* span = gate_up + r * 2 * width + (lane < kSpanLines ? 0 : width) + c - 8 * lane;
        detail::discard_l2_line(reinterpret_cast<const char*>(span) + line * detail::kL2LineBytes);
      }
    }
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
  detail::wait_for_prerequisite_grid();
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

// Heads per block of the vector QKV kernel: a block is (token, run of heads), so a decode step
// of few tokens still spreads over many SMs.
constexpr int kRopeHeadsPerBlock = 8;
constexpr int kRopeThreads = 128;
constexpr int kRopeMaxHalf = 128;  // head_dim <= 256

// The same as qkv_rope_write_kernel, 4 consecutive pairs a thread with 8-byte loads and stores,
// each angle's sine and cosine computed once per block (not once per head). For head_dim / 2 a
// multiple of 4, at most kRopeMaxHalf, and 8-byte aligned buffers. A thread's items (at most
// kRopeItemsPerThread) are loaded before the table is built, so the block waits on one memory
// round trip instead of two (positions, then the QKV row).
constexpr int kRopeItemsPerThread = kRopeHeadsPerBlock * (kRopeMaxHalf / 4) / kRopeThreads;

template <typename T>
__global__ void __launch_bounds__(kRopeThreads)
    qkv_rope_write_vector_kernel(const QkvRopeDims dims, const int32_t* __restrict__ positions,
                                 const int32_t* __restrict__ slots,
                                 const float* __restrict__ inv_freq, const T* __restrict__ qkv,
                                 const float* __restrict__ bias, T* __restrict__ q_out,
                                 T* __restrict__ k_cache, T* __restrict__ v_cache) {
  __shared__ float cos_table[kRopeMaxHalf], sin_table[kRopeMaxHalf];
  detail::wait_for_prerequisite_grid();
  // The attention after it may start reading its plan (it waits for us before Q and the KV).
  detail::allow_dependent_launch();
  const int32_t token = blockIdx.x;
  const int32_t half = dims.head_dim / 2;
  const int32_t heads = dims.num_q_heads + 2 * dims.num_kv_heads;
  const int32_t first_head = blockIdx.y * kRopeHeadsPerBlock;
  const int32_t last_head = min(heads, first_head + kRopeHeadsPerBlock);
  const int32_t quads = half / 4;
  const int32_t items = (last_head - first_head) * quads;
  const T* row = qkv + int64_t{token} * heads * dims.head_dim;
  float4 x1[kRopeItemsPerThread], x2[kRopeItemsPerThread];
#pragma unroll
  for (int k = 0; k < kRopeItemsPerThread; ++k) {
    const int32_t item = threadIdx.x + k * kRopeThreads;
    if (item >= items) continue;
    const int32_t c1 = (first_head + item / quads) * dims.head_dim + (item % quads) * 4;
    x1[k] = load4(row + c1);
    x2[k] = load4(row + c1 + half);
  }
  const int32_t slot = slots[token];
  if (threadIdx.x < half && first_head < dims.num_q_heads + dims.num_kv_heads) {
    // fp32 angle as transformers computes it; accurate sincosf (angles reach 1e5 rad).
    const float angle = static_cast<float>(positions[token]) * inv_freq[threadIdx.x];
    sincosf(angle, &sin_table[threadIdx.x], &cos_table[threadIdx.x]);
  }
  __syncthreads();
  const int64_t kv_size = int64_t{dims.num_kv_heads} * dims.head_dim;
#pragma unroll
  for (int k = 0; k < kRopeItemsPerThread; ++k) {
    const int32_t item = threadIdx.x + k * kRopeThreads;
    if (item >= items) continue;
    const int32_t head = first_head + item / quads;
    const int32_t pair = (item % quads) * 4;
    const int32_t c1 = head * dims.head_dim + pair;
    float4 a = x1[k], b = x2[k];
    if (bias != nullptr) {
      a.x += bias[c1], a.y += bias[c1 + 1], a.z += bias[c1 + 2], a.w += bias[c1 + 3];
      b.x += bias[c1 + half], b.y += bias[c1 + half + 1], b.z += bias[c1 + half + 2],
          b.w += bias[c1 + half + 3];
    }
    T* dst;
    if (head < dims.num_q_heads) {
      dst = q_out + (int64_t{token} * dims.num_q_heads + head) * dims.head_dim;
    } else if (slot < 0) {
      continue;
    } else if (head < dims.num_q_heads + dims.num_kv_heads) {
      dst = k_cache + slot * kv_size + (head - dims.num_q_heads) * dims.head_dim;
    } else {
      dst =
          v_cache + slot * kv_size + (head - dims.num_q_heads - dims.num_kv_heads) * dims.head_dim;
      store4(dst + pair, a.x, a.y, a.z, a.w);
      store4(dst + pair + half, b.x, b.y, b.z, b.w);
      continue;
    }
    const float4 c = *reinterpret_cast<const float4*>(cos_table + pair);
    const float4 s = *reinterpret_cast<const float4*>(sin_table + pair);
    store4(dst + pair, a.x * c.x - b.x * s.x, a.y * c.y - b.y * s.y, a.z * c.z - b.z * s.z,
           a.w * c.w - b.w * s.w);
    store4(dst + pair + half, b.x * c.x + a.x * s.x, b.y * c.y + a.y * s.y, b.z * c.z + a.z * s.z,
           b.w * c.w + a.w * s.w);
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
                     const float* add_bias, const float* weight, void* out, cudaStream_t stream,
                     const WeightPrefetch& prefetch, const L2Discard& discard) {
  DEFT_CHECK(row_index == nullptr || add_bias == nullptr,
             "launch_rms_norm: add_bias with a row gather");
  const PrefetchGrid grid = with_prefetch_ctas("launch_rms_norm", prefetch, dims.num_rows);
  if (dims.num_rows <= 0) return;
  const bool vector = dims.width % 4 == 0 && dims.width <= 4 * kNormVectors * kThreads &&
                      aligned16(x) && aligned16(weight) && aligned16(out) &&
                      (add_bias == nullptr || aligned16(add_bias));
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_dependent(vector ? &rms_norm_vector_kernel<T> : &rms_norm_kernel<T>,
                     dim3(static_cast<unsigned>(grid.blocks)), kThreads, stream, dims, row_index, x,
                     add_bias, weight, static_cast<T*>(out), grid.prefetch, discard);
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_silu_mul(int32_t num_rows, int32_t width, DType dtype, const void* gate_up, void* out,
                     cudaStream_t stream, const WeightPrefetch& prefetch) {
  const bool vector = width % 8 == 0 && aligned16(gate_up) && aligned16(out);
  const int64_t items = int64_t{num_rows} * (vector ? width / 8 : width);
  const PrefetchGrid grid = with_prefetch_ctas("launch_silu_mul", prefetch, grid_for(items));
  if (num_rows <= 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_dependent(vector ? &silu_mul_vector_kernel<T> : &silu_mul_kernel<T>,
                     dim3(static_cast<unsigned>(grid.blocks)), kThreads, stream, num_rows, width,
                     static_cast<const T*>(gate_up), static_cast<T*>(out), grid.prefetch);
  });
  DEFT_CUDA_CHECK_LAUNCH();
}

void launch_qkv_rope_write(const QkvRopeDims& dims, DType dtype, const int32_t* positions,
                           const int32_t* slots, const float* inv_freq, const void* qkv,
                           const float* bias, void* q_out, void* k_cache, void* v_cache,
                           cudaStream_t stream) {
  DEFT_CHECK(dims.head_dim % 2 == 0, "launch_qkv_rope_write: odd head_dim %d", dims.head_dim);
  const int64_t items =
      int64_t{dims.num_tokens} * (dims.num_q_heads + 2 * dims.num_kv_heads) * (dims.head_dim / 2);
  if (items <= 0) return;
  const int32_t half = dims.head_dim / 2;
  const bool vector = half % 4 == 0 && half <= kRopeMaxHalf && aligned8(qkv) && aligned8(q_out) &&
                      aligned8(k_cache) && aligned8(v_cache);
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Kernel = void (*)(QkvRopeDims, const int32_t*, const int32_t*, const float*, const T*,
                            const float*, T*, T*, T*);
    const Kernel kernel = vector ? &qkv_rope_write_vector_kernel<T> : &qkv_rope_write_kernel<T>;
    const int32_t heads = dims.num_q_heads + 2 * dims.num_kv_heads;
    const dim3 grid =
        vector ? dim3(static_cast<unsigned>(dims.num_tokens),
                      static_cast<unsigned>((heads + kRopeHeadsPerBlock - 1) / kRopeHeadsPerBlock))
               : dim3(static_cast<unsigned>(grid_for(items)));
    launch_dependent(kernel, grid, vector ? kRopeThreads : kThreads, stream, dims, positions, slots,
                     inv_freq, static_cast<const T*>(qkv), bias, static_cast<T*>(q_out),
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
