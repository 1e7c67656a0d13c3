// Element types of activations and KV cache on the GPU. Host code passes a DType with untyped
// pointers (`const void*`) so public headers stay free of templates and CUDA types.
#pragma once

#include <cstddef>
#include <string_view>

namespace deft::kernels {

enum class DType { kBf16, kFp16 };

inline constexpr size_t dtype_bytes(DType) { return 2; }

inline constexpr std::string_view dtype_name(DType dtype) {
  return dtype == DType::kBf16 ? "bf16" : "fp16";
}

}  // namespace deft::kernels
