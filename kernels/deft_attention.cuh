// DeFT tree-attention kernels (templates; included only by kernels/deft_attention.cu, which
// instantiates the few (dtype, head_dim) combinations in one place).
//
// Stage 1: one CTA (4 warps) per (task, KV head, row slice). The CTA's rows are the task's
// entries x the KV head's GQA group (row = entry_local * group_size + head_in_group), so the
// task's KV tiles are read once for every query head that uses them. A pass handles up to 64
// rows (4 warps x 16 rows of an m16n8k16 MMA); tasks with fewer rows split each KV tile among
// the warps instead (rows <= 16: 4 warps x 16 tokens of every 64-token tile), and the warps'
// softmax states are merged through shared memory at the end of the pass.
// KV tiles of 64 tokens are gathered through kv_slots (paged KV; each tile's slots copied into
// shared memory a tile ahead) with cp.async into a double-buffered, swizzled shared-memory ring;
// QK^T and PV run on tensor cores with fp32 accumulation: a 64-row pass on warpgroup MMAs
// (wgmma, sm_90a: Q and P from registers, K and V straight from shared memory; a tile in two
// 32-token halves, one half's softmax overlapping the other half's MMAs), fewer rows on
// mma.sync (on sm_90a only in plans whose every task has at most 16 rows: the kWgmmaPasses
// kernel pads short passes to 64 rows instead); per-token 64-bit mask words mask scores; tiles
// no row of the pass sees are never loaded; online softmax in base 2 whose O rescale waits
// until a row's maximum grew by more than 2^8 (kRescaleSlack). Rows whose query has a single
// partial write the final output directly, the others write partial O (normalised, rounded to
// the attention's dtype as the output is: stage 2 then reads half the bytes of fp32 partials)
// and LSE (fp32, natural log).
//
// Stage 2: one warp per (query, head); queries with a single partial return at once; the others
// merge their partials: out = sum_i exp(lse_i - max) o_i / sum_i exp(lse_i - max).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_params.h"
#include "kernels/cp_async.cuh"
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
// KV tiles in the shared-memory ring. 3 stages (2 CTAs per SM instead of 3) measured 4-35 %
// slower on every snapshot of bench/kernel_attention_bench (H100, 2026-11-23).
inline constexpr int kStages = 2;
inline constexpr int kStage2Warps = 4;    // heads per stage-2 CTA
inline constexpr int kStage2Threads = kStage2Warps * 32;

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

// Bits [lo, hi] of a mask word (0 <= lo <= hi < 64).
__device__ __forceinline__ uint64_t bit_range(int lo, int hi) {
  const int count = hi - lo + 1;
  const uint64_t ones = count >= 64 ? ~uint64_t{0} : ((uint64_t{1} << count) - 1);
  return ones << lo;
}

// ---- stage 1 ----------------------------------------------------------------------------------

// kWgmmaPasses (deft_attention_wgmma_passes): every pass runs on warpgroup MMAs, short ones
// padded to 64 rows, and the kernel keeps no mma.sync path (where compiled for sm_90a;
// elsewhere it is the general kernel).
template <typename T, int kHeadDim, bool kWgmmaPasses>
__global__ void __launch_bounds__(kStage1Threads, 3)
    deft_attention_stage1_kernel(const __grid_constant__ Stage1Params params) {
  constexpr bool kWgmmaOnly = kWgmmaPasses && DEFT_HAS_WGMMA;
  using Smem = Stage1Smem<kHeadDim>;
  using Traits = ElemTraits<T>;
  constexpr int kKSteps = kHeadDim / 16;       // k-steps of QK^T
  constexpr int kOBlocks = kHeadDim / 8;       // n-blocks of the O accumulator
  constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per KV row

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned blocks (the swizzle acts on address bits 4-9).
  unsigned char* const smem =
      smem_raw + ((Smem::kAlignSlack - (smem_address(smem_raw) & (Smem::kAlignSlack - 1))) &
                  (Smem::kAlignSlack - 1));

  // Stage 2 may be scheduled once every stage-1 CTA runs (it waits for our results itself).
  // Stage 1 itself is launched dependent on the kernel before it (the KV write): it reads only
  // the plan until wait_for_prerequisite_grid() below.
  allow_dependent_launch();

  const AttentionPlanView& plan = params.plan;
  // Grid: one dimension, a CTA per (task, KV head, row slice) with work, longest first
  // (build_stage1_ctas). A task has as many slices as its rows need: a grid of the launch's
  // widest task's slices for every task left most CTAs of a plan of many small tasks idle.
  const Stage1Cta cta = plan.stage1_ctas[blockIdx.x];
  const int task = cta.task;
  if (task < 0) return;  // padding
  const int slice = cta.slice;
  const int kv_head = cta.kv_head;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_row = lane / 4;  // "groupID" of the MMA fragment layouts
  const int lane_col = lane % 4;  // "threadID_in_group"

  const int kv_begin = plan.task_kv_begin[task];
  const int run_tokens = plan.task_kv_end[task] - kv_begin;
  const int entry_begin = plan.task_entry_begin[task];
  const int num_entries = plan.task_entry_begin[task + 1] - entry_begin;
  const int mask_begin = plan.task_mask_begin[task];
  const bool masked = mask_begin >= 0;
  const int group = params.group_size;
  const int num_rows = num_entries * group;
  const int num_tiles = (run_tokens + kKvTileTokens - 1) / kKvTileTokens;

  // Few rows: spread every tile's tokens over the warps instead of leaving warps idle.
  // A pass holds up to 64 rows; each pass picks its own warp layout, so a short last pass (e.g.
  // 16 of 80 rows) splits its tiles' tokens over the warps instead of leaving 3 warps computing
  // padding rows (the 64-row step is bound by the SM's exp, MMA and shared-memory pipes, so
  // wasted rows cost every CTA on the SM). The kWgmmaPasses kernel pads them to 64 rows all the
  // same: without the mma.sync code it measured faster on every tree (deft_attention.h).
  const int rows_per_pass =
      kWgmmaOnly ? kStage1Warps * kMmaRows
                 : (num_rows <= kMmaRows ? kMmaRows
                                         : (num_rows <= 2 * kMmaRows ? 2 * kMmaRows
                                                                     : kStage1Warps * kMmaRows));
  const int num_passes = (num_rows + rows_per_pass - 1) / rows_per_pass;

  const T* q = static_cast<const T*>(params.q);
  const int q_row_stride = params.num_q_heads * kHeadDim;

  // This thread's part of every KV tile copy: the 16-byte chunk copy_part of head kv_head in the
  // slots of tile tokens copy_token, copy_token + kTokenStride, ... Those tokens are 8k rows
  // apart, so their swizzled destinations are copy_dst + 8k rows (the swizzle pattern repeats
  // every 8 rows), and a slot's source is slot * slot_bytes + part_offset bytes into the cache.
  constexpr int kTokenStride = kStage1Threads / kChunksPerRow;
  constexpr int kSlotsPerThread = kKvTileTokens / kTokenStride;
  static_assert(kKvTileTokens % kTokenStride == 0 && kTokenStride % 8 == 0, "tile rows per thread");
  const int copy_part = threadIdx.x % kChunksPerRow;
  const int copy_token = threadIdx.x / kChunksPerRow;
  const int part_offset = (kv_head * kHeadDim + copy_part * 8) * static_cast<int>(sizeof(T));
  const int slot_bytes = params.num_kv_heads * kHeadDim * static_cast<int>(sizeof(T));
  const uint32_t copy_dst =
      smem_address(smem) + swizzled_offset(copy_token, copy_part, kKvTileTokens);

  for (int pass = slice; pass < num_passes; pass += cta.slices) {
    const int pass_row0 = pass * rows_per_pass;
    const int pass_rows = min(rows_per_pass, num_rows - pass_row0);
    const int row_warps =
        kWgmmaOnly ? kStage1Warps
                   : (pass_rows <= kMmaRows ? 1 : (pass_rows <= 2 * kMmaRows ? 2 : 4));
    const int kv_splits = kStage1Warps / row_warps;
    const int warp_row_block = warp % row_warps;
    const int warp_split = warp / row_warps;
    // With 4 row warps and 33-48 rows, the fourth warp has no row: it skips the math (but takes
    // part in the warpgroup MMAs of the 64-row path).
    const bool warp_has_rows = warp_row_block * kMmaRows < pass_rows;
    // 64-row passes (all 4 warps on rows) run on warpgroup MMAs where compiled for sm_90a.
    const bool use_wgmma = DEFT_HAS_WGMMA && row_warps == kStage1Warps;
    // Entries (mask bits) this pass covers: a tile none of them sees is skipped.
    const uint64_t pass_bits =
        masked ? bit_range(pass_row0 / group, (pass_row0 + pass_rows - 1) / group) : ~uint64_t{0};

    // Masked tasks: the tiles some row of this pass sees, found once per pass (a warp's 32
    // tokens lie in one tile), and how many leading tokens every row of the pass sees: their
    // steps skip the per-element mask tests as unmasked ones do (the top of a token tree that
    // all of a group's queries share; a masked tile costs about two unmasked ones).
    uint32_t* needed = reinterpret_cast<uint32_t*>(smem + Smem::kNeededOffset);
    int* const full_end = reinterpret_cast<int*>(smem + Smem::kFullEndOffset);
    int full_tokens = run_tokens;
    if (masked) {
      const int scan_tokens = min(run_tokens, Smem::kNeededTiles * kKvTileTokens);
      if (threadIdx.x < Smem::kNeededWords) needed[threadIdx.x] = 0;
      if (threadIdx.x == 0) *full_end = scan_tokens;
      __syncthreads();
      for (int base = warp * 32; base < scan_tokens; base += kStage1Threads) {
        const int token = base + lane;
        const uint64_t bits =
            token < scan_tokens ? plan.mask_words[mask_begin + token] & pass_bits : pass_bits;
        const bool seen = token < scan_tokens && bits != 0;
        const uint32_t partly = __ballot_sync(0xffffffffu, bits != pass_bits);
        if (__any_sync(0xffffffffu, seen) && lane == 0) {
          const int t = base / kKvTileTokens;
          atomicOr(needed + t / 32, 1u << (t % 32));
        }
        if (partly != 0 && lane == 0) atomicMin(full_end, base + __ffs(partly) - 1);
      }
      __syncthreads();
      full_tokens = *full_end;
    }
    // First tile at or after `tile` that some row of this pass sees (block-uniform).
    auto next_needed_tile = [&](int tile) {
      if (!masked) return min(tile, num_tiles);
      for (; tile < num_tiles; ++tile) {
        if (tile >= Smem::kNeededTiles || ((needed[tile / 32] >> (tile % 32)) & 1)) return tile;
      }
      return num_tiles;
    };

    // The slots of tile `tile` into the slot ring's `stage`, one 4-byte copy a token (zeros past
    // the task's tokens), a tile ahead of its KV copies: loaded from global memory next to those
    // copies, a tile waited a full memory round trip before its copies could be issued.
    // (The loop reads a stage's slots one iteration after their copy was issued: its wait for
    // all but kStages - 2 groups covers that only with two stages.)
    static_assert(kStages == 2, "the slot ring is one tile ahead");
    int32_t* const slot_ring = reinterpret_cast<int32_t*>(smem + Smem::kSlotRingOffset);
    auto prefetch_slots = [&](int tile, int stage) {
      if (threadIdx.x < kKvTileTokens) {
        const int token = tile * kKvTileTokens + threadIdx.x;
        const bool valid = token < run_tokens;
        cp_async_small<4>(smem_address(slot_ring + stage * kKvTileTokens + threadIdx.x),
                          plan.kv_slots + kv_begin + (valid ? token : 0), valid);
      }
    };
    // Tile `tile` (K, V and, in masked tasks, its mask words) into `stage`, its slots already in
    // the slot ring's `stage`: each thread copies the same 16-byte part of kSlotsPerThread tokens
    // (see copy_part), their slots read first, all at once.
    auto load_tile = [&](int tile, int stage) {
      const int token0 = tile * kKvTileTokens;
      int slots[kSlotsPerThread];
#pragma unroll
      for (int i = 0; i < kSlotsPerThread; ++i) {
        slots[i] = slot_ring[stage * kKvTileTokens + copy_token + i * kTokenStride];
      }
      const uint32_t k_dst = copy_dst + stage * Smem::kStageBytes;
#pragma unroll
      for (int i = 0; i < kSlotsPerThread; ++i) {
        const bool valid = token0 + copy_token + i * kTokenStride < run_tokens;
        const int64_t offset = static_cast<int64_t>(slots[i]) * slot_bytes + part_offset;
        const uint32_t dst = k_dst + i * kTokenStride * kSwizzleRowBytes;
        cp_async_16(dst, static_cast<const char*>(params.k_cache) + offset, valid);
        cp_async_16(dst + Smem::kTileBytes, static_cast<const char*>(params.v_cache) + offset,
                    valid);
      }
      if (masked && threadIdx.x < kKvTileTokens) {
        const int token = token0 + threadIdx.x;
        const bool valid = token < run_tokens;
        uint64_t* mask_tile =
            reinterpret_cast<uint64_t*>(smem + Smem::kMaskOffset) + stage * kKvTileTokens;
        cp_async_small<8>(smem_address(mask_tile + threadIdx.x),
                          plan.mask_words + mask_begin + (valid ? token : 0), valid);
      }
    };

    // The ring holds kStages tiles: the one computed and up to kStages - 1 in flight. upcoming[i]
    // is the i-th needed tile after the computed one; the k-th tile of the pass uses stage k %
    // kStages. The pass's first tiles are in flight while Q loads.
    int upcoming[kStages];
    upcoming[0] = next_needed_tile(0);
#pragma unroll
    for (int i = 1; i < kStages; ++i) upcoming[i] = next_needed_tile(upcoming[i - 1] + 1);

    // Resolve each row's destination once per pass (not per output element in the epilogue:
    // those dependent plan loads made short CTAs latency-bound).
    int32_t* row_target = reinterpret_cast<int32_t*>(smem + Smem::kRowTargetOffset);
    if (threadIdx.x < pass_rows) {
      const int entry = entry_begin + (pass_row0 + threadIdx.x) / group;
      const int query = plan.entry_query[entry];
      const bool single_partial =
          plan.query_entry_begin[query + 1] - plan.query_entry_begin[query] == 1;
      row_target[threadIdx.x] = single_partial ? ~query : entry;
    }

    // The plan (row targets, the first tiles' slots) is read before waiting for the kernel
    // before, which a programmatic launch overlaps; so is the first tile when its tokens hold
    // KV from before the step (the kernel before is the step's KV write).
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      if (upcoming[i] < num_tiles) prefetch_slots(upcoming[i], i);
    }
    cp_async_commit();
    static_assert(kStages == 2, "one tile is loaded before the loop");
    // Its tokens' KV predates the step (AttentionPlanView::task_kv_ready).
    const bool first_tile_ready =
        upcoming[0] < num_tiles && plan.task_kv_ready != nullptr &&
        min(run_tokens, (upcoming[0] + 1) * kKvTileTokens) <= plan.task_kv_ready[task];
    // Q, the KV and our outputs: the kernel before is done.
    if (!first_tile_ready) wait_for_prerequisite_grid();
    cp_async_wait<0>();
    __syncthreads();  // the slots are in the ring
    if (upcoming[0] < num_tiles) load_tile(upcoming[0], 0);
    cp_async_commit();
    if (first_tile_ready) wait_for_prerequisite_grid();

    // This thread's two fragment rows (lane_row and lane_row + 8 of the warp's 16).
    const int row_a = pass_row0 + warp_row_block * kMmaRows + lane_row;
    const int row_b = row_a + 8;
    const bool row_a_valid = row_a < num_rows;
    const bool row_b_valid = row_b < num_rows;
    // Mask bit of each row (masked tasks have <= 64 entries); rows past the task see nothing
    // in masked tasks and are never written in any task.
    const int bit_a = row_a_valid ? row_a / group : 64;
    const int bit_b = row_b_valid ? row_b / group : 64;

    // Q fragments (A operand, row-major 16 x kHeadDim) straight from global memory.
    uint32_t q_frag[kKSteps][4];
    {
      const T* q_row_a = nullptr;
      const T* q_row_b = nullptr;
      if (row_a_valid) {
        const int query = plan.entry_query[entry_begin + row_a / group];
        q_row_a = q + static_cast<int64_t>(query) * q_row_stride +
                  (kv_head * group + row_a % group) * kHeadDim;
      }
      if (row_b_valid) {
        const int query = plan.entry_query[entry_begin + row_b / group];
        q_row_b = q + static_cast<int64_t>(query) * q_row_stride +
                  (kv_head * group + row_b % group) * kHeadDim;
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        const int col = kk * 16 + 2 * lane_col;
        q_frag[kk][0] = row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col) : 0u;
        q_frag[kk][1] = row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col) : 0u;
        q_frag[kk][2] = row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col + 8) : 0u;
        q_frag[kk][3] = row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col + 8) : 0u;
      }
    }

    float o_acc[kOBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kOBlocks; ++nb) {
      o_acc[nb][0] = o_acc[nb][1] = o_acc[nb][2] = o_acc[nb][3] = 0.0f;
    }
    float max_a = kNegInf, max_b = kNegInf;  // exponent bases (scaled scores, base 2)
    float sum_a = 0.0f, sum_b = 0.0f;        // this thread's share of the running denominators

    // Mask (tail tokens, mask bits) and online softmax update of a warp's 16 rows x (8 * kBlocks)
    // scores of the tokens starting at tile token `step_token0`. Scores stay unscaled until the
    // exponent: the maxima are taken on raw scores (softmax_scale > 0, see
    // deft_attention_supported, so the order is the same) and exp2(s * scale - max) is one FFMA
    // and one MUFU.EX2 (ftz: exponents below -126 give 0, as they should here). Steps every row
    // sees entirely (no mask, no tail: full_tokens) skip the per-element visibility tests.
    auto mask_scores = [&](auto& scores, const uint64_t* mask_tile, int token0, int step_token0) {
      constexpr int kBlocks = std::extent_v<std::remove_reference_t<decltype(scores)>>;
      const bool step_full = token0 + step_token0 + 8 * kBlocks <= full_tokens;
      if (!step_full) {
#pragma unroll
        for (int nb = 0; nb < kBlocks; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int token = step_token0 + nb * 8 + 2 * lane_col + (e & 1);
            const int bit = e < 2 ? bit_a : bit_b;
            bool visible = token0 + token < run_tokens;
            if (masked && visible) visible = bit < 64 && ((mask_tile[token] >> bit) & 1);
            if (!visible) scores[nb][e] = kNegInf;
          }
        }
      }
    };
    auto mask_and_softmax = [&](auto& scores, const uint64_t* mask_tile, int token0,
                                int step_token0) {
      mask_scores(scores, mask_tile, token0, step_token0);
      online_softmax_step(scores, o_acc, params.scale_log2, max_a, max_b, sum_a, sum_b);
    };

    // P's accumulator layout is the A-fragment layout of the PV MMA: tokens 16 * pair .. + 15.
    auto p_fragment = [](const auto& scores, int pair, uint32_t (&p_frag)[4]) {
      p_frag[0] = Traits::pack(scores[2 * pair][0], scores[2 * pair][1]);
      p_frag[1] = Traits::pack(scores[2 * pair][2], scores[2 * pair][3]);
      p_frag[2] = Traits::pack(scores[2 * pair + 1][0], scores[2 * pair + 1][1]);
      p_frag[3] = Traits::pack(scores[2 * pair + 1][2], scores[2 * pair + 1][3]);
    };

    // One warp step on mma.sync: 16 rows x (8 * kBlocks) tokens starting at tile token
    // `step_token0`: S = Q K^T, mask, online softmax update, O += P V.
    auto compute_step = [&](auto blocks_tag, uint32_t k_tile, uint32_t v_tile,
                            const uint64_t* mask_tile, int token0, int step_token0) {
      constexpr int kBlocks = decltype(blocks_tag)::value;  // n-blocks of 8 tokens, even
      const int matrix = lane / 8;  // which 8x8 matrix of an x4 ldmatrix this lane addresses
      const int matrix_row = lane % 8;

      float scores[kBlocks][4];
#pragma unroll
      for (int nb = 0; nb < kBlocks; ++nb) {
        scores[nb][0] = scores[nb][1] = scores[nb][2] = scores[nb][3] = 0.0f;
      }
#pragma unroll
      for (int pair = 0; pair < kBlocks / 2; ++pair) {
        const int token = step_token0 + pair * 16 + (matrix >> 1) * 8 + matrix_row;
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          uint32_t k_frag[4];
          ldmatrix_x4(k_frag,
                      k_tile + swizzled_offset(token, 2 * kk + (matrix & 1), kKvTileTokens));
          Traits::mma(scores[2 * pair], q_frag[kk], k_frag[0], k_frag[1]);
          Traits::mma(scores[2 * pair + 1], q_frag[kk], k_frag[2], k_frag[3]);
        }
      }
      mask_and_softmax(scores, mask_tile, token0, step_token0);
      // O += P V, 16 tokens at a time.
#pragma unroll
      for (int pair = 0; pair < kBlocks / 2; ++pair) {
        uint32_t p_frag[4];
        p_fragment(scores, pair, p_frag);
        const int token = step_token0 + pair * 16 + (matrix & 1) * 8 + matrix_row;
#pragma unroll
        for (int nb2 = 0; nb2 < kHeadDim / 16; ++nb2) {
          uint32_t v_frag[4];
          ldmatrix_x4_trans(v_frag,
                            v_tile + swizzled_offset(token, 2 * nb2 + (matrix >> 1),
                                                     kKvTileTokens));
          Traits::mma(o_acc[2 * nb2], p_frag, v_frag[0], v_frag[1]);
          Traits::mma(o_acc[2 * nb2 + 1], p_frag, v_frag[2], v_frag[3]);
        }
      }
    };

    // A whole 64-token tile for the pass's 64 rows on warpgroup MMAs: S = Q K^T from Q fragments
    // in registers and the K tile (K-major); P V from P fragments and the V tile (MN-major). The
    // tile is two halves of 32 tokens so that the tensor cores and the softmax overlap: the
    // first half's softmax runs while the second half's QK^T does, and the second half's softmax
    // while the first half's PV does (its O rescale waits for that PV).
    auto compute_tile_wgmma = [&](uint32_t k_tile, uint32_t v_tile, const uint64_t* mask_tile,
                                  int token0) {
      constexpr int kHalf = kKvTileTokens / 2;
      // Built once a tile; each MMA's operand start is a constant offset from these.
      const uint64_t k_desc = wgmma_descriptor(k_tile, 16, 8 * kSwizzleRowBytes);
      const uint64_t v_desc = wgmma_descriptor(v_tile, Smem::kBlockBytes, 8 * kSwizzleRowBytes);
      float scores[2][kHalf / 8][4];
      wgmma_fence();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          // 16 columns = 32 bytes into the column block (the swizzle acts on the absolute
          // address); a half starts 32 rows (4 swizzle atoms) down.
          const uint32_t offset =
              (kk / 4) * Smem::kBlockBytes + (kk % 4) * 32 + half * kHalf * kSwizzleRowBytes;
          wgmma_rs<T, kHalf, false>(scores[half], q_frag[kk],
                                    wgmma_descriptor_advance(k_desc, offset), kk > 0);
        }
        wgmma_commit();
      }
      // PV of one half: 16 tokens a k-step, two groups of 8 rows; column blocks
      // Smem::kBlockBytes apart.
      uint32_t p_frag[2][kHalf / 16][4];
      auto issue_pv = [&](int half) {
        wgmma_fence_operands(o_acc);
        wgmma_fence();
#pragma unroll
        for (int pair = 0; pair < kHalf / 16; ++pair) {
          const uint32_t offset = (half * kHalf + pair * 16) * kSwizzleRowBytes;
          wgmma_rs<T, kHeadDim, true>(o_acc, p_frag[half][pair],
                                      wgmma_descriptor_advance(v_desc, offset), true);
        }
        wgmma_commit();
      };
      float alpha_a, alpha_b;
      wgmma_wait<1>();  // the first half's scores (the second's QK^T still running)
      wgmma_fence_operands(scores[0]);
      mask_scores(scores[0], mask_tile, token0, 0);
      softmax_update(scores[0], params.scale_log2, max_a, max_b, sum_a, sum_b, alpha_a, alpha_b);
      rescale_rows(o_acc, alpha_a, alpha_b);  // no wgmma writes O now
#pragma unroll
      for (int pair = 0; pair < kHalf / 16; ++pair) p_fragment(scores[0], pair, p_frag[0][pair]);
      issue_pv(0);
      wgmma_wait<1>();  // the second half's scores (the first half's PV still running)
      wgmma_fence_operands(scores[1]);
      mask_scores(scores[1], mask_tile, token0, kHalf);
      softmax_update(scores[1], params.scale_log2, max_a, max_b, sum_a, sum_b, alpha_a, alpha_b);
#pragma unroll
      for (int pair = 0; pair < kHalf / 16; ++pair) p_fragment(scores[1], pair, p_frag[1][pair]);
      wgmma_wait_all();  // the first half's PV: O may be rescaled
      wgmma_fence_operands(o_acc);
      rescale_rows(o_acc, alpha_a, alpha_b);
      issue_pv(1);
      wgmma_wait_all();
      wgmma_fence_operands(o_acc);
    };

    auto compute_tile = [&](int tile, int stage) {
      const uint32_t k_tile = smem_address(smem + stage * Smem::kStageBytes);
      const uint32_t v_tile = k_tile + Smem::kTileBytes;
      const uint64_t* mask_tile =
          reinterpret_cast<const uint64_t*>(smem + Smem::kMaskOffset) + stage * kKvTileTokens;
      const int token0 = tile * kKvTileTokens;
      if (use_wgmma) {
        compute_tile_wgmma(k_tile, v_tile, mask_tile, token0);
        return;
      }
      if constexpr (!kWgmmaOnly) {
        if (kv_splits == 1) {
          // Many rows: the whole 64-token tile in one step (more independent MMAs, one softmax
          // rescale per tile instead of four).
          compute_step(std::integral_constant<int, kKvTileTokens / 8>{}, k_tile, v_tile,
                       mask_tile, token0, 0);
          return;
        }
        // Few rows: the warps share the tile, 16 tokens each per step.
        for (int step = warp_split; step < kKvTileTokens / kStepTokens; step += kv_splits) {
          const int step_token0 = step * kStepTokens;
          if (token0 + step_token0 >= run_tokens) break;
          compute_step(std::integral_constant<int, kStepTokens / 8>{}, k_tile, v_tile, mask_tile,
                       token0, step_token0);
        }
      }
    };

    // Pipeline: the copies of the next kStages - 1 tiles overlap this tile's math.
    int stage = 0;
    while (upcoming[0] < num_tiles) {
      cp_async_wait<kStages - 2>();  // this tile's copy has landed
      fence_async_shared();          // this thread's copies become visible to wgmma's reads
      __syncthreads();
      // The stage of the tile computed last iteration is free: the kStages - 1'th tile ahead,
      // whose slots landed with this tile; the slots of the tile after it go to the slot ring's
      // entry of this stage (its tile is loaded into this stage next iteration).
      const int last = upcoming[kStages - 1];
      const int after = last < num_tiles ? next_needed_tile(last + 1) : num_tiles;
      if (last < num_tiles) load_tile(last, (stage + kStages - 1) % kStages);
      if (after < num_tiles) prefetch_slots(after, stage);
      cp_async_commit();
      if (use_wgmma || warp_has_rows) compute_tile(upcoming[0], stage);
      // The next iteration's barrier alone would order the overwrites of this stage, but without
      // this one the warps drift apart and stage 1 ran 1-3 % slower (H100, 2026-11-23).
      __syncthreads();
#pragma unroll
      for (int i = 0; i + 1 < kStages; ++i) upcoming[i] = upcoming[i + 1];
      upcoming[kStages - 1] = after;
      stage = (stage + 1) % kStages;
    }
    cp_async_wait<0>();
    __syncthreads();

    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);

    // Where pass row `pass_row` goes, resolved once a row: the output when its query has a single
    // partial, else the entry's partial, whose LSE is written here when `with_lse`. Values are
    // scaled by inv_sum (normalised). An entry that saw no token (a plan bug) yields zeros and
    // LSE -inf, never NaN.
    struct RowDestination {
      T* row;  // the output row or the partial O row
      float inv_sum;
    };
    auto row_destination = [&](int pass_row, float row_max, float row_sum, bool with_lse) {
      const int row = pass_row0 + pass_row;
      const int head = kv_head * group + row % group;
      const int target = row_target[pass_row];
      RowDestination dest{nullptr, row_sum > 0.0f ? 1.0f / row_sum : 0.0f};
      if (target < 0) {
        dest.row = static_cast<T*>(params.out) + static_cast<int64_t>(~target) * q_row_stride +
                   head * kHeadDim;
        return dest;
      }
      const int64_t partial_row = static_cast<int64_t>(target) * params.num_q_heads + head;
      dest.row = static_cast<T*>(params.partial_out) + partial_row * kHeadDim;
      if (with_lse) {
        // Natural-log LSE of the scaled scores: (base + log2(sum)) * ln(2).
        params.partial_lse[partial_row] =
            row_sum > 0.0f ? (row_max + log2f(row_sum)) * 0.69314718055994531f : kNegInf;
      }
      return dest;
    };
    if (kv_splits == 1) {
      // Each row's whole state is in its warp's registers: written from there.
      if (warp_has_rows) {
        const int pass_row_a = warp_row_block * kMmaRows + lane_row;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pass_row = pass_row_a + 8 * half;
          const bool valid = pass_row < pass_rows;  // the same for a lane quad
          const RowDestination dest =
              valid ? row_destination(pass_row, half == 0 ? max_a : max_b,
                                      half == 0 ? sum_a : sum_b, lane_col == 0)
                    : RowDestination{nullptr, 0.0f};
          uint32_t packed[kOBlocks];
#pragma unroll
          for (int nb = 0; nb < kOBlocks; ++nb) {
            packed[nb] = Traits::pack(o_acc[nb][2 * half] * dest.inv_sum,
                                      o_acc[nb][2 * half + 1] * dest.inv_sum);
          }
          store_quad_row(dest.row, packed, lane_col, valid);
        }
      }
    } else {
      // The warps' states of the same rows are merged through shared memory.
      float* merge_o = reinterpret_cast<float*>(smem);
      float* merge_max = merge_o + kStage1Warps * kMmaRows * kHeadDim;
      float* merge_sum = merge_max + kStage1Warps * kMmaRows;
      float* warp_o = merge_o + warp * kMmaRows * kHeadDim;
#pragma unroll
      for (int nb = 0; nb < kOBlocks; ++nb) {
        const int col = nb * 8 + 2 * lane_col;
        *reinterpret_cast<float2*>(warp_o + lane_row * kHeadDim + col) =
            make_float2(o_acc[nb][0], o_acc[nb][1]);
        *reinterpret_cast<float2*>(warp_o + (lane_row + 8) * kHeadDim + col) =
            make_float2(o_acc[nb][2], o_acc[nb][3]);
      }
      if (lane_col == 0) {
        merge_max[warp * kMmaRows + lane_row] = max_a;
        merge_max[warp * kMmaRows + lane_row + 8] = max_b;
        merge_sum[warp * kMmaRows + lane_row] = sum_a;
        merge_sum[warp * kMmaRows + lane_row + 8] = sum_b;
      }
      __syncthreads();

      constexpr int kQuads = kHeadDim / 4;  // float4 columns per row
      for (int item = threadIdx.x; item < pass_rows * kQuads; item += kStage1Threads) {
        const int pass_row = item / kQuads;
        const int col = (item % kQuads) * 4;
        const int row_block = pass_row / kMmaRows;
        const int block_row = pass_row % kMmaRows;
        float row_max = kNegInf;
        for (int split = 0; split < kv_splits; ++split) {
          const int w = row_block + split * row_warps;
          row_max = fmaxf(row_max, merge_max[w * kMmaRows + block_row]);
        }
        float row_sum = 0.0f;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row_max != kNegInf) {
          for (int split = 0; split < kv_splits; ++split) {
            const int w = row_block + split * row_warps;
            const float weight = exp2f(merge_max[w * kMmaRows + block_row] - row_max);
            row_sum += merge_sum[w * kMmaRows + block_row] * weight;
            const float4 o = *reinterpret_cast<const float4*>(
                merge_o + (w * kMmaRows + block_row) * kHeadDim + col);
            acc[0] += weight * o.x;
            acc[1] += weight * o.y;
            acc[2] += weight * o.z;
            acc[3] += weight * o.w;
          }
        }
        const RowDestination dest = row_destination(pass_row, row_max, row_sum, col == 0);
        *reinterpret_cast<uint2*>(dest.row + col) =
            make_uint2(Traits::pack(acc[0] * dest.inv_sum, acc[1] * dest.inv_sum),
                       Traits::pack(acc[2] * dest.inv_sum, acc[3] * dest.inv_sum));
      }
    }
    __syncthreads();  // the merge scratch is the next pass's KV ring
  }
}

// ---- stage 2 ----------------------------------------------------------------------------------

// One warp per (query, head), kStage2Warps heads per CTA. A query's partials go 32 at a time (a
// lane each: its row, LSE and weight, broadcast by shuffles), their O rows kBatch at a time into
// registers. The first batch's loads go out together with the LSEs', so a query of up to kBatch
// partials costs one memory round trip after stage 1 (the plan's rows are read before the wait).
// Loading the LSEs first, then the rows 8 at a time, took four: 7.4 µs for 20 few-shot queries
// in the decode step (ncu, H100, 2026-11-23), where stage 2 sits between stage 1 and the O
// projection. A larger batch holds more registers (head_dim 128: 32 rows 96 a thread, 8 rows
// 48), so the launch picks the batch (stage2_kernel_for in deft_attention.cu): the smallest that
// takes the plan's largest query in one trip among those whose grid fits on the GPU at once.
template <typename T, int kHeadDim, int kBatch>
__global__ void __launch_bounds__(kStage2Threads)
    deft_attention_stage2_kernel(const __grid_constant__ AttentionPlanView plan,
                                 const T* __restrict__ partial_out,
                                 const float* __restrict__ partial_lse, T* __restrict__ out,
                                 int32_t num_q_heads, const WeightPrefetch prefetch) {
  constexpr int kPerLane = kHeadDim / 32;  // 2 or 4 consecutive values per lane
  static_assert(kPerLane == 2 || kPerLane == 4, "head_dim 64 or 128");
  static_assert(kBatch > 0 && 32 % kBatch == 0, "batches tile a lane's 32 partials");
  // The next layer's stage 1 may be scheduled (it waits for us before touching our outputs).
  allow_dependent_launch();
  // The O projection's weights, once stage 1 is done (prefetch_weight_rows waits for it): during
  // stage 1 the prefetch slowed its KV reads more than it sped up the GEMM (H100, 2026-11-24,
  // session 18).
  if (prefetch_weight_rows(prefetch)) return;
  const int query = blockIdx.x;
  const int begin = plan.query_entry_begin[query];
  const int count = plan.query_entry_begin[query + 1] - begin;
  if (count <= 1) {  // written by stage 1 directly (or a prefill run's row: no entry)
    // One CTA waits for stage 1 whatever the plan, so this grid never completes before stage 1
    // (work after it in the stream relies on that even when no query needs a merge).
    if (blockIdx.x == 0 && blockIdx.y == 0) wait_for_prerequisite_grid();
    return;
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * kStage2Warps + warp;
  if (head >= num_q_heads) return;

  const auto partial_row = [&](int i) {
    return static_cast<int64_t>(plan.query_entries[begin + i]) * num_q_heads + head;
  };
  const int64_t first_row = lane < count ? partial_row(lane) : 0;

  wait_for_prerequisite_grid();  // stage 1's partials are visible from here on

  // This lane's columns of the O rows of partials [first, first + n) of a 32 (lanes' rows
  // my_row), all loads issued at once.
  // Kept packed until used (kPerLane / 2 words a row): a batch of 32 rows converted on load
  // would hold twice the registers and no longer have all its loads in flight at once.
  uint32_t o[kBatch][kPerLane / 2];
  const auto load_batch = [&](int64_t my_row, int first, int n) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t row = __shfl_sync(0xffffffffu, my_row, first + j);
      if (j < n) {
        const T* src = partial_out + row * kHeadDim + lane * kPerLane;
        if constexpr (kPerLane == 4) {
          const uint2 v = *reinterpret_cast<const uint2*>(src);
          o[j][0] = v.x;
          o[j][1] = v.y;
        } else {
          o[j][0] = *reinterpret_cast<const uint32_t*>(src);
        }
      }
    }
  };
  const float first_lse = lane < count ? partial_lse[first_row] : kNegInf;
  load_batch(first_row, 0, min(kBatch, count));
  // The maximum LSE (partials past the first 32: a further pass over their LSEs).
  float lse_max = first_lse;
  for (int i = lane + 32; i < count; i += 32) lse_max = fmaxf(lse_max, partial_lse[partial_row(i)]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
  }
  const float base = lse_max == kNegInf ? 0.0f : lse_max;

  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  float denom = 0.0f;
  int64_t my_row = first_row;
  float my_lse = first_lse;
  for (int chunk = 0; chunk < count; chunk += 32) {
    const int chunk_count = min(32, count - chunk);
    if (chunk > 0) {
      my_row = lane < chunk_count ? partial_row(chunk + lane) : 0;
      my_lse = lane < chunk_count ? partial_lse[my_row] : kNegInf;
    }
    const float my_weight = my_lse == kNegInf ? 0.0f : expf(my_lse - base);
    denom += my_weight;
    for (int first = 0; first < chunk_count; first += kBatch) {
      const int n = min(kBatch, chunk_count - first);
      if (chunk > 0 || first > 0) load_batch(my_row, first, n);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float weight = __shfl_sync(0xffffffffu, my_weight, first + j);
        if (j < n) {
#pragma unroll
          for (int w = 0; w < kPerLane / 2; ++w) {
            const float2 v = ElemTraits<T>::unpack(o[j][w]);
            acc[2 * w] += weight * v.x;
            acc[2 * w + 1] += weight * v.y;
          }
        }
      }
    }
    // This chunk's partial rows are dead (every lane's loads of them are in acc): each lane
    // drops its own row (whole 128-byte lines) from L2 unwritten.
    __syncwarp();
    if (lane < chunk_count) {
#pragma unroll
      for (int line = 0; line < kHeadDim * static_cast<int>(sizeof(T)) / kL2LineBytes; ++line) {
        discard_l2_line(partial_out + my_row * kHeadDim +
                        line * (kL2LineBytes / static_cast<int>(sizeof(T))));
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    denom += __shfl_xor_sync(0xffffffffu, denom, offset);
  }
  const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;
  T* out_row =
      out + (static_cast<int64_t>(query) * num_q_heads + head) * kHeadDim + lane * kPerLane;
  if constexpr (kPerLane == 4) {
    *reinterpret_cast<uint2*>(out_row) =
        make_uint2(ElemTraits<T>::pack(acc[0] * inv_denom, acc[1] * inv_denom),
                   ElemTraits<T>::pack(acc[2] * inv_denom, acc[3] * inv_denom));
  } else {
    *reinterpret_cast<uint32_t*>(out_row) =
        ElemTraits<T>::pack(acc[0] * inv_denom, acc[1] * inv_denom);
  }
}

}  // namespace deft::kernels::detail
