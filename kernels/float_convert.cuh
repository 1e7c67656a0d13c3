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

}  // namespace deft::kernels
