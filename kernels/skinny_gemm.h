// Weight-streaming GEMM for decode steps: y[rows][out] (= or +=) x[rows][in] · w[out][in]^T with
// few rows (rows <= kSkinnyGemmMaxRows per pass) against a large weight matrix, 16-bit operands
// (bf16/fp16), fp32 accumulation, y fp32 or `dtype`. Such a product is bound by reading w once,
// so the kernel streams w through the bulk tensor copy engine into a deep shared-memory ring
// (Hopper, sm_90a) and splits K over a thread-block cluster (reduced in distributed shared
// memory, deterministic) when the weight has too few rows to fill the GPU. It is launched as a
// programmatic dependent of the kernel before it and reads its first weights before that kernel
// ends. CPU twin: skinny_gemm_cpu (kernels/skinny_gemm_cpu.h). No host synchronisation, no
// device allocation: every launch is graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/skinny_gemm_cpu.h"

namespace deft::kernels {

// Rows of x one pass handles (8 mma columns of 8); more rows take several passes, each reading
// w again, so callers keep larger products on cuBLAS.
inline constexpr int32_t kSkinnyGemmMaxRows = 64;

// Whether this binary and device run the kernel (sm_90a machine code on a compute 9.0 GPU).
bool skinny_gemm_available();

// Whether launch_skinny_gemm can run this product: in % 8 == 0 and x, w 16-byte aligned (rows of
// w are read with 16-byte loads), rows in [1, 2 * kSkinnyGemmMaxRows].
bool skinny_gemm_supported(const SkinnyGemmDims& dims, const void* x, const void* w);

// x: [rows][in] dtype; w: [out][in] dtype; y: [rows][out], fp32 when y_fp32 else dtype.
// accumulate: y += x·w^T (read y, add in fp32, round once) instead of y = x·w^T.
// split_k: the grid is that many CTAs per 128-row tile of w (capped at two per SM), the work
// divided evenly among them; 0: two CTAs per SM. The results do not depend on it beyond fp32
// rounding, and a given split gives bit-identical results every time.
// Launches on one stream share a workspace (allocated on the stream's first launch, or by
// skinny_gemm_reserve); launches on other streams have their own.
// batch_invariant: every pass on the N = 64 MMA, also passes of <= 32 rows (which otherwise take
// N = 32). The grid depends only on w's shape and split_k, and each row of x is a column of its
// own in the MMAs, so a row's outputs are then the same bits whatever the other rows of the
// product and however many there are (the CUDA runner's deterministic mode).
void launch_skinny_gemm(const SkinnyGemmDims& dims, DType dtype, const void* x, const void* w,
                        void* y, bool y_fp32, bool accumulate, cudaStream_t stream,
                        int32_t split_k = 0, bool batch_invariant = false);

// SwiGLU fused into the product (a Llama MLP's gate/up and SiLU·mul in one launch):
// out[rows][width] = silu(g) * u, where g and u are x · w^T's columns [0, width) and
// [width, 2 * width) in fp32, rounded once to `dtype` (the unfused path rounds g and u first).
// w: [2 * width][in] dtype, gate rows then up rows. Same support as launch_skinny_gemm for
// {rows, in, 2 * width}; each 64-row tile of gate rows is read with the same 64 up rows.
void launch_skinny_gemm_swiglu(int32_t rows, int32_t in, int32_t width, DType dtype, const void* x,
                               const void* w, void* out, cudaStream_t stream,
                               bool batch_invariant = false);

// Whether w has enough 128-row tiles for one per SM, so that the grid gives each CTA whole
// tiles and no partial sums travel between CTAs (on the H100: the Llama-3-8B gate/up and LM head
// shapes, where the kernel beats cuBLAS; bench/results/skinny_gemm-h100-notes.md).
bool skinny_gemm_wide(const SkinnyGemmDims& dims);

// The grid launch_skinny_gemm uses for `dims` and `split_k`.
int32_t skinny_gemm_ctas(const SkinnyGemmDims& dims, int32_t split_k);

// Allocates `stream`'s workspace (once per stream and device: a few MB); launches captured into
// a CUDA graph need it first.
void skinny_gemm_reserve(cudaStream_t stream);

// Frees `stream`'s workspace on the current device, if it has one (before the stream is
// destroyed: a new stream may get the same handle). No launch of it may still be pending or be
// replayed later from a graph.
void skinny_gemm_release(cudaStream_t stream);

}  // namespace deft::kernels
