// Warming L2 with the first bytes of a weight matrix's rows (sm_90): a small kernel between two
// GEMMs (RMSNorm, SiLU·mul, DeFT attention's stage 2) leaves the DRAM idle while it runs and
// while the next GEMM launches and fills its pipeline; extra CTAs of that kernel (about one per
// SM, past its own grid) start the next GEMM's weight stream instead, one prefetch.global.L2 per
// 128-byte line, which no thread waits for. The kernel's own CTAs issue none: their loads would
// queue behind the prefetches.
#pragma once

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/weight_prefetch.h"

namespace deft::kernels::detail {

// Lines [cta, cta + ctas, ...) of `prefetch` (cta in [0, ctas)): one prefetch.global.L2 each.
__device__ __forceinline__ void prefetch_weight_lines(const WeightPrefetch& prefetch, int64_t cta,
                                                      int64_t ctas) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kLine = 128;
  const int64_t lines_per_row = (prefetch.bytes_per_row + kLine - 1) / kLine;
  const int64_t lines = prefetch.rows * lines_per_row;
  const int64_t stride = ctas * blockDim.x;
  for (int64_t i = cta * blockDim.x + threadIdx.x; i < lines; i += stride) {
    const int64_t row = i / lines_per_row;
    const int64_t offset = (i - row * lines_per_row) * kLine;
    if (offset >= prefetch.row_bytes) continue;
    const char* address =
        static_cast<const char*>(prefetch.base) + row * prefetch.row_bytes + offset;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(address));
  }
#else
  (void)prefetch;
  (void)cta;
  (void)ctas;
#endif
}

// True for a CTA of the prefetch part of the grid (blockIdx.x >= first_block, every blockIdx.y of
// those columns): it waits for the kernel before and issues its share of `prefetch`'s lines, and
// does nothing else. The wait matters behind a kernel that lets its dependents start at once (the
// skinny GEMM): prefetched during that kernel's own weight stream, the lines took DRAM time from
// it and were evicted by it before the GEMM after this kernel read them. Behind a cuBLAS GEMM
// (which lets them start only when it ends) it returns at once.
__device__ __forceinline__ bool prefetch_weight_rows(const WeightPrefetch& prefetch) {
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  if (prefetch.base == nullptr || block < prefetch.first_block) return false;
  wait_for_prerequisite_grid();
  prefetch_weight_lines(prefetch, int64_t{block - prefetch.first_block} * gridDim.y + blockIdx.y,
                        (static_cast<int64_t>(gridDim.x) - prefetch.first_block) * gridDim.y);
  return true;
}

// CTAs of the kernel's own part of the grid (the stride of a grid-stride loop over its work).
__device__ __forceinline__ int64_t own_blocks(const WeightPrefetch& prefetch) {
  return prefetch.base != nullptr ? prefetch.first_block : gridDim.x;
}

}  // namespace deft::kernels::detail
