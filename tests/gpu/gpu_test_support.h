// Helpers shared by the GPU tests (header only): device detection, 16-bit element conversion,
// random tensors already rounded to the element type, host/device copies, relative error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/dtype.h"

namespace deft::kernels {

inline bool cuda_device_visible() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define DEFT_SKIP_WITHOUT_GPU() \
  if (!cuda_device_visible()) GTEST_SKIP() << "no CUDA device visible"

inline uint32_t fresh_seed() { return std::random_device{}(); }

// ---- 16-bit element helpers -------------------------------------------------------------------

inline uint16_t to_bits(float x, DType dtype) {
  if (dtype == DType::kBf16) return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
  return __half_raw(__float2half_rn(x)).x;
}

inline float from_bits(uint16_t bits, DType dtype) {
  if (dtype == DType::kBf16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

inline uint16_t nan_bits(DType dtype) { return dtype == DType::kBf16 ? 0x7fc0 : 0x7e00; }

// Random values already rounded to `dtype`: `bits` for the GPU, `values` for the references.
struct Tensor16 {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};

inline Tensor16 random_tensor(size_t count, DType dtype, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Tensor16 t;
  t.bits.resize(count);
  t.values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    t.bits[i] = to_bits(normal(rng), dtype);
    t.values[i] = from_bits(t.bits[i], dtype);
  }
  return t;
}

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buffer(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) {
    DEFT_CUDA_CHECK(
        cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return buffer;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer, size_t count) {
  std::vector<T> host(count);
  DEFT_CUDA_CHECK(cudaMemcpy(host.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

struct Comparison {
  double relative_error = 0.0;
  int64_t nan_count = 0;
};

inline Comparison compare(const std::vector<float>& out, const std::vector<double>& ref) {
  double diff = 0.0, norm = 0.0;
  Comparison c;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i])) {
      ++c.nan_count;
      continue;
    }
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  c.relative_error = std::sqrt(diff / std::max(norm, 1e-30));
  return c;
}

inline double tolerance(DType dtype) { return dtype == DType::kBf16 ? 1e-2 : 3e-3; }

}  // namespace deft::kernels
