// Weight-streaming GEMM for decode steps: y[rows][out] (= or +=) x[rows][in] · w[out][in]^T with
// few rows (rows <= kSkinnyGemmMaxRows per pass) against a large weight matrix, 16-bit operands
// (bf16/fp16), fp32 accumulation, y fp32 or `dtype`. Such a product is bound by reading w once,
// so the kernel streams w with 16-byte loads straight into tensor-core fragments and splits K
// over a thread-block cluster (reduced in distributed shared memory, deterministic) when the
// weight has too few rows to fill the GPU. CPU twin: skinny_gemm_cpu (kernels/skinny_gemm_cpu.h).
// No host synchronisation, no allocation: every launch is graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/skinny_gemm_cpu.h"

namespace deft::kernels {

// Rows of x one pass handles (8 mma columns of 8); more rows take several passes, each reading
// w again, so callers keep larger products on cuBLAS.
inline constexpr int32_t kSkinnyGemmMaxRows = 64;

// Whether launch_skinny_gemm can run this product: in % 8 == 0 and x, w 16-byte aligned (rows of
// w are read with 16-byte loads), rows in [1, 2 * kSkinnyGemmMaxRows].
bool skinny_gemm_supported(const SkinnyGemmDims& dims, const void* x, const void* w);

// x: [rows][in] dtype; w: [out][in] dtype; y: [rows][out], fp32 when y_fp32 else dtype.
// accumulate: y += x·w^T (read y, add in fp32, round once) instead of y = x·w^T.
// split_k: CTAs (one cluster) sharing a 128-row slab of w along K; 0 picks it from the shape.
void launch_skinny_gemm(const SkinnyGemmDims& dims, DType dtype, const void* x, const void* w,
                        void* y, bool y_fp32, bool accumulate, cudaStream_t stream,
                        int32_t split_k = 0);

// The split launch_skinny_gemm picks for `dims` (1..8).
int32_t skinny_gemm_auto_split(const SkinnyGemmDims& dims);

}  // namespace deft::kernels
