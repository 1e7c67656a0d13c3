// Definitions shared by the DeFT attention kernels (deft_attention.cuh: stage 1,
// merge_states.cuh: stage 2) and the prefill kernel (prefill_attention.cuh): the stage
// geometry, stage 1's shared memory and parameters, element types (bf16 / fp16), PTX helpers
// and the base-2 online softmax. Device code only; included by .cuh files of kernels/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_params.h"
#include "kernels/cp_async.cuh"
#include "kernels/deft_schedule.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/l2_discard.cuh"
#include "kernels/l2_prefetch.cuh"
#include "kernels/wgmma.cuh"

namespace deft::kernels::detail {

inline constexpr float kNegInf = -INFINITY;

inline constexpr int kStage1Warps = 4;
inline constexpr int kStage1Threads = kStage1Warps * 32;
inline constexpr int kKvTileTokens = 64;  // tokens per cp.async tile
inline constexpr int kMmaRows = 16;       // rows of one warp's m16n8k16 tile
inline constexpr int kStepTokens = 16;    // tokens of one warp step (k of the PV MMA)
// KV tiles in the shared-memory ring. 3 stages (2 CTAs per SM instead of 3) ran 4-35 % slower on
// every snapshot of bench/kernel_attention_bench on the H100 (kernel notes:
// bench/results/kernel_attention-h100-notes.md).
inline constexpr int kStages = 2;
inline constexpr int kStage2Warps = 4;  // heads per stage-2 CTA
inline constexpr int kStage2Threads = kStage2Warps * 32;
// The work division (kernels/deft_schedule.h) sizes the grid by this geometry.
static_assert(kKvTileTokens == kStage1TileTokens && kStage1Warps * kMmaRows == kStage1PassRows,
              "deft_schedule.h's stage-1 geometry is the kernel's");

// Shared memory of stage 1: two stages of (K tile, V tile, mask words). A tile is kHeadDim / 64
// blocks of [64 tokens][128 bytes] in the 128-byte swizzle of kernels/wgmma.cuh: wgmma reads it
// through descriptors, and ldmatrix's 8 row addresses fall into distinct bank groups. The
// dynamic shared memory is aligned up to 1024 bytes in the kernel (kAlignSlack).
template <int kHeadDim>
struct Stage1Smem {
  static constexpr int kBlockBytes = kKvTileTokens * kSwizzleRowBytes;  // 64 columns of a tile
  static constexpr int kTileBytes = kKvTileTokens * kHeadDim * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
  static constexpr int kMaskOffset = kStages * kStageBytes;
  // Per row of the current pass: where its result goes (~query: final output, else entry).
  static constexpr int kRowTargetOffset = kMaskOffset + kStages * kKvTileTokens * 8;
  // Masked tasks: one bit per tile that some row of the pass sees (tiles past kNeededTiles are
  // always loaded).
  static constexpr int kNeededWords = 32;
  static constexpr int kNeededTiles = kNeededWords * 32;
  static constexpr int kNeededOffset = kRowTargetOffset + kStage1Warps * kMmaRows * 4;
  // The KV slots of the tile each stage will hold next, copied one tile ahead of the KV.
  static constexpr int kSlotRingOffset = kNeededOffset + kNeededWords * 4;
  // Masked tasks: the pass's leading tokens that every row of the pass sees (one int).
  static constexpr int kFullEndOffset = kSlotRingOffset + kStages * kKvTileTokens * 4;
  static constexpr int kAlignSlack = 1024;
  static constexpr int kBytes = kFullEndOffset + 16 + kAlignSlack;
  // The end-of-pass merge reuses the KV ring: per warp 16 rows of O, m and l (fp32).
  static constexpr int kMergeOBytes = kStage1Warps * kMmaRows * kHeadDim * 4;
  static constexpr int kMergeBytes = kMergeOBytes + 2 * kStage1Warps * kMmaRows * 4;
  static_assert(kMergeBytes <= kMaskOffset, "merge scratch must fit in the KV ring");
  static_assert(kHeadDim % 64 == 0, "tiles are whole 128-byte column blocks");
};

struct Stage1Params {
  AttentionPlanView plan;  // device pointers
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* partial_out;  // T
  float* partial_lse;
  void* out;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t group_size;
  float scale_log2;  // softmax_scale * log2(e)
};

// ---- element type traits ----------------------------------------------------------------------

template <typename T>
struct ElemTraits;

template <>
struct ElemTraits<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  // Two packed values (low half first) to fp32: exact, plain integer operations.
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ElemTraits<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(bits))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(bits >> 16))));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ---- PTX helpers ------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 2^x on the SFU with denormal results flushed to zero (exp2f adds range fix-ups around it).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A row's exponent base moves only when its maximum grew by more than this (base 2), so weights
// stay below 2^8 (exact in fp32, in range for bf16 and fp16 P) and the O rescale, 64-128
// multiplies a row, runs only a few times a task instead of on almost every tile.
inline constexpr float kRescaleSlack = 8.0f;

// One step of the online softmax over an MMA accumulator tile (rows a and b of each thread's
// fragment; a row's 4 threads reduce with shuffles): each row's exponent base (max_a / max_b,
// scores scaled to base 2) moves to the step's maximum when that exceeds it by more than
// kRescaleSlack, the scores become exp2 weights in place and the running sums grow. The base is
// not the exact maximum, but base + log2(sum) is the exact log-sum-exp all the same. Returns in
// alpha_a / alpha_b the factors the O accumulator must be scaled by (exactly 1 unless a row's
// base moved). Masked scores are -inf; a row that has seen nothing yet keeps base -inf and
// subtracts 0 (exp2(-inf) = 0).
template <int kBlocks>
__device__ __forceinline__ void softmax_update(float (&scores)[kBlocks][4], float scale,
                                               float& max_a, float& max_b, float& sum_a,
                                               float& sum_b, float& alpha_a, float& alpha_b) {
  float step_max_a = kNegInf, step_max_b = kNegInf;
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb) {
    step_max_a = fmaxf(step_max_a, fmaxf(scores[nb][0], scores[nb][1]));
    step_max_b = fmaxf(step_max_b, fmaxf(scores[nb][2], scores[nb][3]));
  }
  step_max_a = fmaxf(step_max_a, __shfl_xor_sync(0xffffffffu, step_max_a, 1));
  step_max_a = fmaxf(step_max_a, __shfl_xor_sync(0xffffffffu, step_max_a, 2));
  step_max_b = fmaxf(step_max_b, __shfl_xor_sync(0xffffffffu, step_max_b, 1));
  step_max_b = fmaxf(step_max_b, __shfl_xor_sync(0xffffffffu, step_max_b, 2));
  // -inf * scale = -inf; a row's first finite maximum always moves its base (-inf + slack).
  const float step_a = step_max_a * scale;
  const float step_b = step_max_b * scale;
  const bool move_a = step_a > max_a + kRescaleSlack;
  const bool move_b = step_b > max_b + kRescaleSlack;
  alpha_a = move_a ? fast_exp2(max_a - step_a) : 1.0f;
  alpha_b = move_b ? fast_exp2(max_b - step_b) : 1.0f;
  if (move_a) max_a = step_a;
  if (move_b) max_b = step_b;
  const float base_a = max_a == kNegInf ? 0.0f : max_a;
  const float base_b = max_b == kNegInf ? 0.0f : max_b;
  float step_sum_a = 0.0f, step_sum_b = 0.0f;
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb) {
    scores[nb][0] = fast_exp2(fmaf(scores[nb][0], scale, -base_a));
    scores[nb][1] = fast_exp2(fmaf(scores[nb][1], scale, -base_a));
    scores[nb][2] = fast_exp2(fmaf(scores[nb][2], scale, -base_b));
    scores[nb][3] = fast_exp2(fmaf(scores[nb][3], scale, -base_b));
    step_sum_a += scores[nb][0] + scores[nb][1];
    step_sum_b += scores[nb][2] + scores[nb][3];
  }
  sum_a = sum_a * alpha_a + step_sum_a;
  sum_b = sum_b * alpha_b + step_sum_b;
}

// Scales the O accumulator's rows a and b (skipped, warp-uniformly, when no row's maximum moved:
// rare once the maxima settle).
template <int kOBlocks>
__device__ __forceinline__ void rescale_rows(float (&o_acc)[kOBlocks][4], float alpha_a,
                                             float alpha_b) {
  if (__any_sync(0xffffffffu, alpha_a != 1.0f || alpha_b != 1.0f)) {
#pragma unroll
    for (int nb = 0; nb < kOBlocks; ++nb) {
      o_acc[nb][0] *= alpha_a;
      o_acc[nb][1] *= alpha_a;
      o_acc[nb][2] *= alpha_b;
      o_acc[nb][3] *= alpha_b;
    }
  }
}

// softmax_update, then the O accumulator rescaled at once. Shared by the DeFT and prefill kernels.
template <int kBlocks, int kOBlocks>
__device__ __forceinline__ void online_softmax_step(float (&scores)[kBlocks][4],
                                                    float (&o_acc)[kOBlocks][4], float scale,
                                                    float& max_a, float& max_b, float& sum_a,
                                                    float& sum_b) {
  float alpha_a, alpha_b;
  softmax_update(scores, scale, max_a, max_b, sum_a, sum_b, alpha_a, alpha_b);
  rescale_rows(o_acc, alpha_a, alpha_b);
}

// One row of an MMA accumulator, rounded and packed: lane `lane_col` of the row's quad holds
// columns 8 nb + 2 lane_col and + 1 in packed[nb]. Three shuffles per 4 blocks hand each lane a
// whole 8-column block, so it writes 16 bytes (a quad 64 contiguous bytes) instead of 4 bytes a
// block. Every lane of the warp calls it (shuffles); `row` is written only where `write`.
template <typename T, int kOBlocks>
__device__ __forceinline__ void store_quad_row(T* row, const uint32_t (&packed)[kOBlocks],
                                               int lane_col, bool write) {
  static_assert(kOBlocks % 4 == 0, "whole groups of 4 blocks");
#pragma unroll
  for (int g = 0; g < kOBlocks / 4; ++g) {
    const auto pick = [&](int j) {  // packed[4 g + j] for a lane-dependent j
      uint32_t r = packed[4 * g];
      r = j == 1 ? packed[4 * g + 1] : r;
      r = j == 2 ? packed[4 * g + 2] : r;
      return j == 3 ? packed[4 * g + 3] : r;
    };
    // From lane lane_col ^ k: its columns of block 4 g + lane_col.
    const uint32_t own = pick(lane_col);
    const uint32_t from1 = __shfl_xor_sync(0xffffffffu, pick(lane_col ^ 1), 1);
    const uint32_t from2 = __shfl_xor_sync(0xffffffffu, pick(lane_col ^ 2), 2);
    const uint32_t from3 = __shfl_xor_sync(0xffffffffu, pick(lane_col ^ 3), 3);
    uint32_t block[4];
#pragma unroll
    for (int source = 0; source < 4; ++source) {
      const int k = source ^ lane_col;
      block[source] = k == 0 ? own : (k == 1 ? from1 : (k == 2 ? from2 : from3));
    }
    if (write) {
      *reinterpret_cast<uint4*>(row + (4 * g + lane_col) * 8) =
          make_uint4(block[0], block[1], block[2], block[3]);
    }
  }
}

}  // namespace deft::kernels::detail
