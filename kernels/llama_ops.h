// GPU kernels for the per-token steps of a Llama-family forward pass, around the cuBLAS GEMMs
// and the DeFT attention: embedding gather, RMSNorm, SiLU·mul, QKV bias + RoPE + KV write, and
// a seeded uniform fill for random weights. Contracts are the CPU twins' (kernels/llama_ops_cpu.h);
// activations are `dtype` (bf16/fp16), the residual stream and norm weights fp32, math in fp32
// with one rounding per output. No host synchronisation: every launch is graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/l2_discard.h"
#include "kernels/llama_ops_cpu.h"
#include "kernels/weight_prefetch.h"

namespace deft::kernels {

// table: [vocab][width] dtype; out: [num_tokens][width] fp32 (the residual stream).
void launch_embedding(int32_t num_tokens, int32_t width, DType dtype, const int32_t* tokens,
                      const void* table, float* out, cudaStream_t stream);

// x: fp32 residual (bias folded in place when add_bias is set); out: [num_rows][width] dtype.
// discard: dead buffers dropped from L2 once the kernel before is done (none may overlap x or
// out).
void launch_rms_norm(const RmsNormDims& dims, DType dtype, const int32_t* row_index, float* x,
                     const float* add_bias, const float* weight, void* out, cudaStream_t stream,
                     const WeightPrefetch& prefetch = {}, const L2Discard& discard = {});

// gate_up: [num_rows][2 * width] dtype; out: [num_rows][width] dtype.
void launch_silu_mul(int32_t num_rows, int32_t width, DType dtype, const void* gate_up, void* out,
                     cudaStream_t stream, const WeightPrefetch& prefetch = {});

// qkv, q_out, k_cache, v_cache: dtype; bias, inv_freq: fp32; positions, slots: device int32.
void launch_qkv_rope_write(const QkvRopeDims& dims, DType dtype, const int32_t* positions,
                           const int32_t* slots, const float* inv_freq, const void* qkv,
                           const float* bias, void* q_out, void* k_cache, void* v_cache,
                           cudaStream_t stream);

// out[i] = random_uniform_value(seed, i, scale, offset) rounded to dtype.
void launch_random_uniform(int64_t count, uint64_t seed, float scale, float offset, DType dtype,
                           void* out, cudaStream_t stream);

}  // namespace deft::kernels
