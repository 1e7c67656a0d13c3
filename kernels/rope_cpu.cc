#include "kernels/rope_cpu.h"

#include <cmath>

namespace deft::kernels {

namespace {

void rotate(float* x, int32_t half, float position, const float* inv_freq) {
  for (int32_t i = 0; i < half; ++i) {
    const float angle = position * inv_freq[i];  // fp32 product, as Hugging Face computes it
    const float c = std::cos(angle);
    const float s = std::sin(angle);
    const float x1 = x[i];
    const float x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

void rope_cpu(const RopeDims& dims, const int32_t* positions, const float* inv_freq, float* q,
              float* k) {
  const int32_t half = dims.head_dim / 2;
  for (int32_t token = 0; token < dims.num_tokens; ++token) {
    const auto position = static_cast<float>(positions[token]);
    for (int32_t head = 0; q != nullptr && head < dims.num_q_heads; ++head) {
      rotate(q + token * dims.q_token_stride + head * dims.head_dim, half, position, inv_freq);
    }
    for (int32_t head = 0; k != nullptr && head < dims.num_kv_heads; ++head) {
      rotate(k + token * dims.k_token_stride + head * dims.head_dim, half, position, inv_freq);
    }
  }
}

}  // namespace deft::kernels
