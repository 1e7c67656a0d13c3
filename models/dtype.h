// Element types of model weights (the three a Llama-family checkpoint may hold) and the
// scalar conversions between them. Half-precision values travel as raw uint16_t bit patterns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace deft::models {

enum class DType : uint8_t { kF32, kF16, kBF16 };

// safetensors spelling: "F32", "F16", "BF16".
std::string_view dtype_name(DType dtype);
// Parses the safetensors spelling; nullopt for anything else.
std::optional<DType> parse_dtype_name(std::string_view name);
constexpr size_t dtype_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// IEEE 754 binary16, subnormals included.
float fp16_to_float(uint16_t bits);
// Round to nearest even; overflow goes to infinity; NaN stays a NaN.
uint16_t float_to_fp16(float value);

// Element `index` of a packed array of `dtype` as float; `data` need not be aligned.
inline float load_as_float(const std::byte* data, DType dtype, size_t index) {
  if (dtype == DType::kF32) {
    float value;
    std::memcpy(&value, data + index * 4, sizeof(value));
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, data + index * 2, sizeof(bits));
  return dtype == DType::kBF16 ? bf16_to_float(bits) : fp16_to_float(bits);
}

}  // namespace deft::models
