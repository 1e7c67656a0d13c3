// Hopper warpgroup MMA (wgmma, sm_90a): a warpgroup (4 warps, 128 threads) computes
// D[64 x N] += A[64 x 16] * B[16 x N] with A in registers (the DeFT stage-1 kernel) or in shared
// memory (the skinny GEMM) and B in shared memory, described by 64-bit matrix descriptors.
//
// Register layouts are those of mma.sync m16n8k16, stacked: warp w of the warpgroup holds rows
// 16w .. 16w + 15; A is the m16n8k16 A fragment (4 x 32-bit), D is N / 8 m16n8 accumulator
// blocks (4 floats each). So a kernel can switch a 64-row step between mma.sync and wgmma without
// changing its fragments.
//
// Shared-memory operands use the 128-byte swizzle: a block of rows of 128 bytes (64 bf16/fp16
// elements), 16-byte chunk c of row r stored at chunk c ^ (r % 8); blocks 1024-byte aligned.
// DEFT_HAS_WGMMA is 1 only when compiling for sm_90a; callers keep an mma.sync path otherwise.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DEFT_HAS_WGMMA 1
#else
#define DEFT_HAS_WGMMA 0
#endif

namespace deft::kernels::detail {

inline constexpr int kSwizzleRowBytes = 128;

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled operand whose rows are
// `row_chunks` chunks long: rows are split into 128-byte column blocks of `block_rows` rows each.
__device__ __forceinline__ int swizzled_offset(int row, int chunk, int block_rows) {
  return (chunk >> 3) * block_rows * kSwizzleRowBytes + row * kSwizzleRowBytes +
         (((chunk & 7) ^ (row & 7)) << 4);
}

// Shared-memory matrix descriptor, 128-byte swizzle. `leading_bytes`: for MN-major operands the
// distance between 64-element column blocks (ignored for K-major ones); `stride_bytes`: the
// distance between groups of 8 rows.
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (uint64_t{1} << 62);
}

// `descriptor` with its start address moved `bytes` (a multiple of 16) on. The start address is
// the low 14 bits (address / 16) and shared-memory addresses stay below 2^18, so the sum never
// carries out of it: one 32-bit add instead of rebuilding the descriptor.
__device__ __forceinline__ uint64_t wgmma_descriptor_advance(uint64_t descriptor, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

__device__ __forceinline__ void wgmma_fence() {
#if DEFT_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if DEFT_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending committed groups are still running (groups complete in order).
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if DEFT_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }

// Shared memory written by ordinary stores or cp.async becomes visible to wgmma's reads (the
// async proxy): each writing thread runs this after its writes, before the barrier.
__device__ __forceinline__ void fence_async_shared() {
#if DEFT_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving accesses to accumulators across wgmma issue and wait (the
// hardware writes them asynchronously in between).
template <int kBlocks>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kBlocks][4]) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i) {
    asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
  }
}

#define DEFT_WGMMA_D4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define DEFT_WGMMA_D16 DEFT_WGMMA_D4(0), DEFT_WGMMA_D4(1), DEFT_WGMMA_D4(2), DEFT_WGMMA_D4(3)
#define DEFT_WGMMA_D32                                                                      \
  DEFT_WGMMA_D16, DEFT_WGMMA_D4(4), DEFT_WGMMA_D4(5), DEFT_WGMMA_D4(6), DEFT_WGMMA_D4(7)
#define DEFT_WGMMA_D64                                                                          \
  DEFT_WGMMA_D32, DEFT_WGMMA_D4(8), DEFT_WGMMA_D4(9), DEFT_WGMMA_D4(10), DEFT_WGMMA_D4(11),     \
      DEFT_WGMMA_D4(12), DEFT_WGMMA_D4(13), DEFT_WGMMA_D4(14), DEFT_WGMMA_D4(15)
#define DEFT_WGMMA_REGS16 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20"
#define DEFT_WGMMA_REGS32                                                                   \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36"
#define DEFT_WGMMA_REGS64                                                                   \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "               \
  "{%64,%65,%66,%67}, %68"
// One wgmma of shape m64n<N>k16, A from registers; `accumulate` false: D = A * B.
#define DEFT_WGMMA_ASM(N, TYPE, TRANS_B, REGS, PRED_OPERAND, ...)                             \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED_OPERAND ", 0;\n"                             \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS              \
      ", p, 1, 1, " #TRANS_B ";\n}\n"                                                        \
      : __VA_ARGS__ /* the D operands */                                                     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor), "r"(accumulate ? 1 : 0))

// D[64 x N] (+)= A[64 x 16] * B[16 x N]; kTransB: B is MN-major in shared memory (N contiguous),
// else K-major (K contiguous). N is 32, 64 or 128.
template <typename T, int kN, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 8][4], const uint32_t (&a)[4],
                                         uint64_t descriptor, bool accumulate) {
  static_assert(kN == 32 || kN == 64 || kN == 128, "wgmma_rs: N is 32, 64 or 128");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16");
#if DEFT_HAS_WGMMA
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  // The four (type, B layout) forms of one N; the D operands last.
#define DEFT_WGMMA_FORMS(N, REGS, PRED_OPERAND, ...)              \
  if constexpr (kBf16 && kTransB) {                                \
    DEFT_WGMMA_ASM(N, "bf16", 1, REGS, PRED_OPERAND, __VA_ARGS__); \
  } else if constexpr (kBf16) {                                    \
    DEFT_WGMMA_ASM(N, "bf16", 0, REGS, PRED_OPERAND, __VA_ARGS__); \
  } else if constexpr (kTransB) {                                  \
    DEFT_WGMMA_ASM(N, "f16", 1, REGS, PRED_OPERAND, __VA_ARGS__);  \
  } else {                                                         \
    DEFT_WGMMA_ASM(N, "f16", 0, REGS, PRED_OPERAND, __VA_ARGS__);  \
  }
  if constexpr (kN == 32) {
    DEFT_WGMMA_FORMS(32, DEFT_WGMMA_REGS16, "%21", DEFT_WGMMA_D16)
  } else if constexpr (kN == 64) {
    DEFT_WGMMA_FORMS(64, DEFT_WGMMA_REGS32, "%37", DEFT_WGMMA_D32)
  } else {
    DEFT_WGMMA_FORMS(128, DEFT_WGMMA_REGS64, "%69", DEFT_WGMMA_D64)
  }
#undef DEFT_WGMMA_FORMS
#else
  (void)d;
  (void)a;
  (void)descriptor;
  (void)accumulate;
  __trap();  // callers take the mma.sync path where wgmma is not compiled in
#endif
}

// One wgmma of shape m64n<N>k16 with A and B both K-major in shared memory (descriptors).
#define DEFT_WGMMA_SS_ASM(N, TYPE, REGS, PRED_OPERAND, ...)                                    \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED_OPERAND ", 0;\n"                             \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS              \
      ", p, 1, 1, 0, 0;\n}\n"                                                              \
      : __VA_ARGS__ /* the D operands */                                                     \
      : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate ? 1 : 0))
#define DEFT_WGMMA_SS_REGS16 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17"
#define DEFT_WGMMA_SS_REGS32                                                                \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33"

// D[64 x N] (+)= A[64 x 16] * B[16 x N], A and B K-major in shared memory. N is 32 or 64.
template <typename T, int kN>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 8][4], uint64_t descriptor_a,
                                         uint64_t descriptor_b, bool accumulate) {
  static_assert(kN == 32 || kN == 64, "wgmma_ss: N is 32 or 64");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16");
#if DEFT_HAS_WGMMA
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kN == 32 && kBf16) {
    DEFT_WGMMA_SS_ASM(32, "bf16", DEFT_WGMMA_SS_REGS16, "%18", DEFT_WGMMA_D16);
  } else if constexpr (kN == 32) {
    DEFT_WGMMA_SS_ASM(32, "f16", DEFT_WGMMA_SS_REGS16, "%18", DEFT_WGMMA_D16);
  } else if constexpr (kBf16) {
    DEFT_WGMMA_SS_ASM(64, "bf16", DEFT_WGMMA_SS_REGS32, "%34", DEFT_WGMMA_D32);
  } else {
    DEFT_WGMMA_SS_ASM(64, "f16", DEFT_WGMMA_SS_REGS32, "%34", DEFT_WGMMA_D32);
  }
#else
  (void)d;
  (void)descriptor_a;
  (void)descriptor_b;
  (void)accumulate;
  __trap();
#endif
}

#undef DEFT_WGMMA_SS_ASM
#undef DEFT_WGMMA_SS_REGS32
#undef DEFT_WGMMA_SS_REGS16
#undef DEFT_WGMMA_ASM
#undef DEFT_WGMMA_REGS64
#undef DEFT_WGMMA_REGS32
#undef DEFT_WGMMA_REGS16
#undef DEFT_WGMMA_D64
#undef DEFT_WGMMA_D32
#undef DEFT_WGMMA_D16
#undef DEFT_WGMMA_D4

}  // namespace deft::kernels::detail
