// CPU twins of the small per-token kernels of a Llama-family forward pass (kernels/llama_ops.h):
// embedding gather, RMSNorm (with a bias folded into the residual and an optional row gather),
// SiLU·mul, QKV bias + RoPE + KV-cache write, and the seeded uniform fill used for random
// weights. fp32 throughout; the GPU kernels take 16-bit activations and round once per output.
#pragma once

#include <cstdint>

namespace deft::kernels {

// out[t][0..width) = table[tokens[t]][0..width).
void embedding_cpu(int32_t num_tokens, int32_t width, const int32_t* tokens, const float* table,
                   float* out);

struct RmsNormDims {
  int32_t num_rows = 0;  // rows written to `out`
  int32_t width = 0;
  float eps = 1e-6f;
};

// For output row i, with source row r = row_index ? row_index[i] : i:
//   if add_bias: x[r] += add_bias (written back: it is the residual stream);
//   out[i] = weight * x[r] * rsqrt(mean(x[r]^2) + eps)   (transformers' LlamaRMSNorm).
// add_bias must be null when row_index is given (a gathered row may repeat).
void rms_norm_cpu(const RmsNormDims& dims, const int32_t* row_index, float* x,
                  const float* add_bias, const float* weight, float* out);

// gate_up: [num_rows][2 * width] (gate in the first half, up in the second, as the fused
// gate/up projection writes them); out[r][i] = silu(gate[r][i]) * up[r][i].
void silu_mul_cpu(int32_t num_rows, int32_t width, const float* gate_up, float* out);

struct QkvRopeDims {
  int32_t num_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;  // even
  int32_t qkv_width() const { return (num_q_heads + 2 * num_kv_heads) * head_dim; }
};

// qkv: [num_tokens][q | k | v] as the fused QKV projection writes it; bias: [qkv_width] or null.
// Adds the bias, rotates q and k (rotate_half, angle = positions[t] * inv_freq[i] in fp32),
// writes q to q_out [num_tokens][num_q_heads][head_dim] and k, v to cache slot slots[t]
// (caches [num_slots][num_kv_heads][head_dim]); a negative slot writes no K/V.
void qkv_rope_write_cpu(const QkvRopeDims& dims, const int32_t* positions, const int32_t* slots,
                        const float* inv_freq, const float* qkv, const float* bias, float* q_out,
                        float* k_cache, float* v_cache);

// Value i of the seeded stream: offset + scale * (2u - 1), u in [0, 1) from a hash of (seed, i).
// The GPU kernel computes the same u bit for bit (it then rounds to 16 bits).
float random_uniform_value(uint64_t seed, uint64_t index, float scale, float offset);
void random_uniform_cpu(int64_t count, uint64_t seed, float scale, float offset, float* out);

}  // namespace deft::kernels
