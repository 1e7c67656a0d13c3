// Dropping dead scratch from L2 (sm_80+): discard.global.L2 invalidates a 128-byte line without
// writing it back, so data that a kernel has read for the last time (stage 1's partials, the
// gate/up GEMM's output, the step's dead activations and logits) does not go out to DRAM later,
// in the middle of the next GEMM's weight stream. The line's contents are undefined afterwards;
// its next writer rewrites it whole.
#pragma once

#include <cstdint>

#include "kernels/l2_discard.h"

namespace deft::kernels::detail {

inline constexpr int kL2LineBytes = 128;

// `line` must be kL2LineBytes-aligned, and every read of it (by any thread) done.
__device__ __forceinline__ void discard_l2_line(const void* line) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(line) : "memory");
#endif
}

// The whole lines of [base, base + bytes), thread `thread` of `threads` taking every threads-th
// one (a partial first or last line is kept). Every read of the range must be done.
__device__ __forceinline__ void discard_l2_range(const void* base, int64_t bytes, int64_t thread,
                                                 int64_t threads) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
  const uintptr_t first = (begin + kL2LineBytes - 1) / kL2LineBytes;
  const uintptr_t end = (begin + static_cast<uintptr_t>(bytes)) / kL2LineBytes;
  for (uintptr_t line = first + thread; line < end; line += threads) {
    discard_l2_line(reinterpret_cast<const void*>(line * kL2LineBytes));
  }
}

// discard_l2_range over each range of `discard`.
__device__ __forceinline__ void discard_l2_ranges(const L2Discard& discard, int64_t thread,
                                                  int64_t threads) {
#pragma unroll
  for (int r = 0; r < L2Discard::kMaxRanges; ++r) {
    if (discard.base[r] != nullptr) {
      discard_l2_range(discard.base[r], discard.bytes[r], thread, threads);
    }
  }
}

}  // namespace deft::kernels::detail
