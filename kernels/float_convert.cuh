// Conversions between the storage types of activations and KV (bf16, fp16) and fp32, shared by
// the element-wise kernels. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace deft::kernels {

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float(float x) {
  return __float2half_rn(x);
}

// Four consecutive values of T from one 8-byte load (src 8-byte aligned).
template <typename T>
__device__ __forceinline__ float4 load4(const T* src) {
  const uint2 bits = *reinterpret_cast<const uint2*>(src);
  const T* v = reinterpret_cast<const T*>(&bits);
  return make_float4(to_float(v[0]), to_float(v[1]), to_float(v[2]), to_float(v[3]));
}

// Four consecutive outputs rounded to T, one 8-byte store (dst 8-byte aligned).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  uint2 bits;
  T* y = reinterpret_cast<T*>(&bits);
  y[0] = from_float<T>(a);
  y[1] = from_float<T>(b);
  y[2] = from_float<T>(c);
  y[3] = from_float<T>(d);
  *reinterpret_cast<uint2*>(dst) = bits;
}

}  // namespace deft::kernels
