// What a small kernel between two GEMMs pulls into L2 for the GEMM after it (RMSNorm, SiLU·mul,
// DeFT attention's stage 2; kernels/l2_prefetch.cuh issues it).
#pragma once

#include <cstdint>

namespace deft::kernels {

// The first `bytes_per_row` bytes of each of `rows` rows of `row_bytes` bytes from `base` (where a
// decode GEMM's CTAs start reading), issued by extra CTAs of the launch (one per SM) while the
// kernel's own CTAs run. base == nullptr: none. first_block is set by the launcher (where the
// extra CTAs start: in x, for a 2-D grid).
struct WeightPrefetch {
  const void* base = nullptr;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int32_t bytes_per_row = 0;
  int32_t first_block = 0;
};

// A launch's grid in x with `prefetch`'s CTAs after its own `own_blocks` (about one prefetch CTA
// per SM over the grid's `grid_y` rows): the prefetch to pass to the kernel (first_block set)
// and the grid's size in x. Aborts on a prefetch that breaks the contract above (a caller bug).
struct PrefetchGrid {
  WeightPrefetch prefetch;
  int32_t blocks = 0;
};
PrefetchGrid with_prefetch_ctas(const char* what, WeightPrefetch prefetch, int32_t own_blocks,
                                int32_t grid_y = 1);

}  // namespace deft::kernels
