#include "kernels/llama_ops_cpu.h"

#include <cmath>
#include <cstring>

namespace deft::kernels {

void embedding_cpu(int32_t num_tokens, int32_t width, const int32_t* tokens, const float* table,
                   float* out) {
  for (int32_t t = 0; t < num_tokens; ++t) {
    std::memcpy(out + static_cast<size_t>(t) * width,
                table + static_cast<size_t>(tokens[t]) * width, sizeof(float) * width);
  }
}

void rms_norm_cpu(const RmsNormDims& dims, const int32_t* row_index, float* x,
                  const float* add_bias, const float* weight, float* out) {
  for (int32_t i = 0; i < dims.num_rows; ++i) {
    const int32_t r = row_index != nullptr ? row_index[i] : i;
    float* in = x + static_cast<size_t>(r) * dims.width;
    if (add_bias != nullptr) {
      for (int32_t c = 0; c < dims.width; ++c) in[c] += add_bias[c];
    }
    double sum_squares = 0.0;
    for (int32_t c = 0; c < dims.width; ++c) sum_squares += double{in[c]} * in[c];
    const float inv_rms = 1.0f / std::sqrt(static_cast<float>(sum_squares / dims.width) + dims.eps);
    for (int32_t c = 0; c < dims.width; ++c) {
      out[static_cast<size_t>(i) * dims.width + c] = weight[c] * (in[c] * inv_rms);
    }
  }
}

void silu_mul_cpu(int32_t num_rows, int32_t width, const float* gate_up, float* out) {
  for (int32_t r = 0; r < num_rows; ++r) {
    const float* gate = gate_up + static_cast<size_t>(r) * 2 * width;
    const float* up = gate + width;
    for (int32_t i = 0; i < width; ++i) {
      out[static_cast<size_t>(r) * width + i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }
}

void qkv_rope_write_cpu(const QkvRopeDims& dims, const int32_t* positions, const int32_t* slots,
                        const float* inv_freq, const float* qkv, const float* bias, float* q_out,
                        float* k_cache, float* v_cache) {
  const int32_t half = dims.head_dim / 2;
  const int32_t width = dims.qkv_width();
  const int32_t q_size = dims.num_q_heads * dims.head_dim;
  const int32_t kv_size = dims.num_kv_heads * dims.head_dim;
  for (int32_t t = 0; t < dims.num_tokens; ++t) {
    const float* row = qkv + static_cast<size_t>(t) * width;
    const auto value = [&](int32_t c) { return row[c] + (bias != nullptr ? bias[c] : 0.0f); };
    const int32_t slot = slots[t];
    for (int32_t h = 0; h < dims.num_q_heads + dims.num_kv_heads; ++h) {
      const bool is_q = h < dims.num_q_heads;
      if (!is_q && slot < 0) continue;
      const int32_t base = h * dims.head_dim;  // k heads follow the q heads in the row
      float* dst = is_q ? q_out + static_cast<size_t>(t) * q_size + base
                        : k_cache + static_cast<size_t>(slot) * kv_size + (base - q_size);
      for (int32_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[t]) * inv_freq[i];
        const float c = std::cos(angle), s = std::sin(angle);
        const float x1 = value(base + i), x2 = value(base + i + half);
        dst[i] = x1 * c - x2 * s;
        dst[i + half] = x2 * c + x1 * s;
      }
    }
    if (slot < 0) continue;
    for (int32_t c = 0; c < kv_size; ++c) {
      v_cache[static_cast<size_t>(slot) * kv_size + c] = value(q_size + kv_size + c);
    }
  }
}

float random_uniform_value(uint64_t seed, uint64_t index, float scale, float offset) {
  // splitmix64 of (seed, index): cheap, stateless, identical on host and device.
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // exact: 24 bits
  return offset + scale * (2.0f * u - 1.0f);
}

void random_uniform_cpu(int64_t count, uint64_t seed, float scale, float offset, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = random_uniform_value(seed, static_cast<uint64_t>(i), scale, offset);
  }
}

}  // namespace deft::kernels
