// CPU twin of the rotary position embedding kernel (kernels/rope.h), Hugging Face Llama
// "rotate_half" convention: for i < head_dim / 2, with angle = position * inv_freq[i] (fp32),
//   x[i]              <- x[i] * cos(angle) - x[i + head_dim/2] * sin(angle)
//   x[i + head_dim/2] <- x[i + head_dim/2] * cos(angle) + x[i] * sin(angle)
// Inverse frequencies come from the caller (models/ applies rope_theta and Llama 3 scaling).
#pragma once

#include <cstdint>

namespace deft::kernels {

struct RopeDims {
  int32_t num_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;  // even
  // Elements between consecutive tokens of q / k (num_heads * head_dim when packed).
  int64_t q_token_stride = 0;
  int64_t k_token_stride = 0;
};

// Rotates q [token][num_q_heads][head_dim] and k [token][num_kv_heads][head_dim] in place;
// token t uses positions[t]. Either of q, k may be null.
void rope_cpu(const RopeDims& dims, const int32_t* positions, const float* inv_freq, float* q,
              float* k);

}  // namespace deft::kernels
