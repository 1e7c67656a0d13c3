// Dropping dead scratch from L2 (sm_80+): discard.global.L2 invalidates a 128-byte line without
// writing it back, so data that a kernel has read for the last time (stage 1's partials, the
// gate/up GEMM's output) does not go out to DRAM later, in the middle of the next GEMM's weight
// stream. The line's contents are undefined afterwards; its next writer rewrites it whole.
#pragma once

namespace deft::kernels::detail {

inline constexpr int kL2LineBytes = 128;

// `line` must be kL2LineBytes-aligned, and every read of it (by any thread) done.
__device__ __forceinline__ void discard_l2_line(const void* line) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(line) : "memory");
#endif
}

}  // namespace deft::kernels::detail
