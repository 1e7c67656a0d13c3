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

// Bits [lo, hi] of a mask word (0 <= lo <= hi < 64).
__device__ __forceinline__ uint64_t bit_range(int lo, int hi) {
  const int count = hi - lo + 1;
  const uint64_t ones = count >= 64 ? ~uint64_t{0} : ((uint64_t{1} << count) - 1);
  return ones << lo;
}

// What a stage-1 CTA reads of its task, once (block-uniform).
struct Stage1Task {
  int task;
  int kv_head;
  int kv_begin;  // its run is kv_slots[kv_begin .. kv_begin + run_tokens)
  int run_tokens;
  int entry_begin;  // its entries start here
  int mask_begin;   // its mask words start here (masked tasks)
  bool masked;
  int group;          // GQA group size
  int num_rows;       // entries x group
  int num_tiles;      // KV tiles of kKvTileTokens
  int rows_per_pass;  // 16, 32 or 64
  int num_passes;
  int q_row_stride;  // elements between queries' rows of q and out
};

// A row pass over the CTA's warps (block-uniform except the warp's own fields).
struct Stage1Pass {
  int row0;  // the task's rows [row0, row0 + rows)
  int rows;
  int row_warps;       // warps that split the rows, 16 each (1, 2 or 4)
  int kv_splits;       // warps that split each tile's tokens (4 / row_warps)
  int warp_row_block;  // this warp's 16 rows
  int warp_split;      // this warp's share of a tile's tokens
  bool warp_has_rows;
  bool use_wgmma;   // all 4 warps on rows, warpgroup MMAs (sm_90a)
  uint64_t bits;    // mask bits of the pass's entries
  int full_tokens;  // leading tokens every row of the pass sees (scan_pass_mask)
};

// A thread's two rows of an MMA fragment (lane_row and lane_row + 8 of its warp's 16).
struct FragmentRows {
  int row_a;  // task rows
  int row_b;
  bool row_a_valid;
  bool row_b_valid;
  int bit_a;  // their mask bits; 64: past the task, sees nothing
  int bit_b;
};

// The online softmax state of a thread's two fragment rows: O [kHeadDim / 8 blocks][4] (the
// m16n8 accumulator layout), exponent bases (scaled scores, base 2) and its share of the running
// denominators.
template <int kOBlocks>
struct RowsState {
  float (&o_acc)[kOBlocks][4];
  float& max_a;
  float& max_b;
  float& sum_a;
  float& sum_b;
};

// Which scores of a thread's two rows are visible in a pass.
struct ScoreMask {
  int run_tokens;   // tokens at or past it are padding
  int full_tokens;  // tokens before it are seen by every row of the pass
  bool masked;      // per-token mask words apply
  int bit_a;        // FragmentRows' mask bits
  int bit_b;
  int lane_col;  // "threadID_in_group" of the fragment layouts
};

/// \brief Reads the CTA's task from the plan and picks its pass height (rows a pass).
/// Few rows spread every tile's tokens over the warps instead of leaving warps idle: a pass of at
/// most 16 rows is one warp's (4 warps x 16 tokens of each tile), of at most 32 two warps'. Each
/// pass picks its own warp layout (pass_layout), so a short last pass (e.g. 16 of 80 rows) splits
/// its tiles' tokens too instead of leaving 3 warps computing padding rows (the 64-row step is
/// bound by the SM's exp, MMA and shared-memory pipes, so wasted rows cost every CTA on the SM).
/// kWgmmaOnly pads every pass to 64 rows all the same: without the mma.sync code it measured
/// faster on every tree (deft_attention_wgmma_passes).
template <int kHeadDim, bool kWgmmaOnly>
__device__ __forceinline__ Stage1Task load_task(const Stage1Params& params, const Stage1Cta& cta) {
  const AttentionPlanView& plan = params.plan;
  Stage1Task task;
  task.task = cta.task;
  task.kv_head = cta.kv_head;
  task.kv_begin = plan.task_kv_begin[task.task];
  task.run_tokens = plan.task_kv_end[task.task] - task.kv_begin;
  task.entry_begin = plan.task_entry_begin[task.task];
  const int num_entries = plan.task_entry_begin[task.task + 1] - task.entry_begin;
  task.mask_begin = plan.task_mask_begin[task.task];
  task.masked = task.mask_begin >= 0;
  task.group = params.group_size;
  task.num_rows = num_entries * task.group;
  task.num_tiles = (task.run_tokens + kKvTileTokens - 1) / kKvTileTokens;
  task.rows_per_pass =
      kWgmmaOnly ? kStage1Warps * kMmaRows
                 : (task.num_rows <= kMmaRows
                        ? kMmaRows
                        : (task.num_rows <= 2 * kMmaRows ? 2 * kMmaRows : kStage1Warps * kMmaRows));
  task.num_passes = (task.num_rows + task.rows_per_pass - 1) / task.rows_per_pass;
  task.q_row_stride = params.num_q_heads * kHeadDim;
  return task;
}

/// \brief Row pass `pass`: its rows and how they lie over the warps (full_tokens: the run's).
template <bool kWgmmaOnly>
__device__ __forceinline__ Stage1Pass pass_layout(const Stage1Task& task, int pass, int warp) {
  Stage1Pass p;
  p.row0 = pass * task.rows_per_pass;
  p.rows = min(task.rows_per_pass, task.num_rows - p.row0);
  p.row_warps =
      kWgmmaOnly ? kStage1Warps : (p.rows <= kMmaRows ? 1 : (p.rows <= 2 * kMmaRows ? 2 : 4));
  p.kv_splits = kStage1Warps / p.row_warps;
  p.warp_row_block = warp % p.row_warps;
  p.warp_split = warp / p.row_warps;
  // With 4 row warps and 33-48 rows, the fourth warp has no row: it skips the math (but takes
  // part in the warpgroup MMAs of the 64-row path).
  p.warp_has_rows = p.warp_row_block * kMmaRows < p.rows;
  // 64-row passes (all 4 warps on rows) run on warpgroup MMAs where compiled for sm_90a.
  p.use_wgmma = DEFT_HAS_WGMMA && p.row_warps == kStage1Warps;
  // Entries (mask bits) this pass covers: a tile none of them sees is skipped.
  p.bits = task.masked ? bit_range(p.row0 / task.group, (p.row0 + p.rows - 1) / task.group)
                       : ~uint64_t{0};
  p.full_tokens = task.run_tokens;
  return p;
}

/// \brief Finds the tiles some row of the pass sees and the tokens every row of it sees.
/// Masked tasks: a bit a tile in shared memory (Smem::kNeededOffset, [kNeededWords] words), a
/// warp's 32 tokens lying in one tile; returns how many leading tokens every row of the pass sees
/// (an unmasked task: all of its run). Steps within those skip the per-element mask tests as
/// unmasked ones do (the top of a token tree that all of a group's queries share; a masked tile
/// costs about two unmasked ones). Block-wide: every thread calls it (barriers).
template <typename Smem>
__device__ __forceinline__ int scan_pass_mask(const AttentionPlanView& plan, const Stage1Task& task,
                                              uint64_t pass_bits, unsigned char* smem, int warp,
                                              int lane) {
  uint32_t* needed = reinterpret_cast<uint32_t*>(smem + Smem::kNeededOffset);
  int* const full_end = reinterpret_cast<int*>(smem + Smem::kFullEndOffset);
  int full_tokens = task.run_tokens;
  if (task.masked) {
    const int scan_tokens = min(task.run_tokens, Smem::kNeededTiles * kKvTileTokens);
    if (threadIdx.x < Smem::kNeededWords) needed[threadIdx.x] = 0;
    if (threadIdx.x == 0) *full_end = scan_tokens;
    __syncthreads();
    for (int base = warp * 32; base < scan_tokens; base += kStage1Threads) {
      const int token = base + lane;
      const uint64_t bits =
          token < scan_tokens ? plan.mask_words[task.mask_begin + token] & pass_bits : pass_bits;
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
  return full_tokens;
}

/// \brief The first tile at or after `tile` that some row of the pass sees; num_tiles if none.
/// Reads scan_pass_mask's bits (tiles past Smem::kNeededTiles count as seen). Block-uniform.
template <typename Smem>
__device__ __forceinline__ int next_needed_tile(const Stage1Task& task, const unsigned char* smem,
                                                int tile) {
  if (!task.masked) return min(tile, task.num_tiles);
  const uint32_t* needed = reinterpret_cast<const uint32_t*>(smem + Smem::kNeededOffset);
  for (; tile < task.num_tiles; ++tile) {
    if (tile >= Smem::kNeededTiles || ((needed[tile / 32] >> (tile % 32)) & 1)) return tile;
  }
  return task.num_tiles;
}

/// \brief Resolves each row's destination once a pass: row_target [pass rows] in shared memory.
/// ~query when the row's query has a single partial (the final output row), else its entry (the
/// partial's row). Once a row, not per output element in the epilogue: those dependent plan loads
/// made short CTAs latency-bound.
template <typename Smem>
__device__ __forceinline__ void resolve_row_targets(const AttentionPlanView& plan,
                                                    const Stage1Task& task, const Stage1Pass& pass,
                                                    unsigned char* smem) {
  int32_t* row_target = reinterpret_cast<int32_t*>(smem + Smem::kRowTargetOffset);
  if (threadIdx.x < pass.rows) {
    const int entry = task.entry_begin + (pass.row0 + threadIdx.x) / task.group;
    const int query = plan.entry_query[entry];
    const bool single_partial =
        plan.query_entry_begin[query + 1] - plan.query_entry_begin[query] == 1;
    row_target[threadIdx.x] = single_partial ? ~query : entry;
  }
}

// This thread's part of the KV gather: a tile's slots go into a slot ring in shared memory a tile
// ahead of its K, V (and mask words) into the stage's swizzled tiles. Each thread copies the
// 16-byte chunk copy_part of head kv_head in the slots of tile tokens copy_token, copy_token +
// kTokenStride, ... Those tokens are 8k rows apart, so their swizzled destinations are copy_dst +
// 8k rows (the swizzle pattern repeats every 8 rows), and a slot's source is slot * slot_bytes +
// part_offset bytes into the cache (slot_bytes: a slot's K or V row, all KV heads). Built a
// pass: the slot ring's address is the pass's.
template <typename T, int kHeadDim>
struct KvTileLoader {
  using Smem = Stage1Smem<kHeadDim>;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per KV row
  static constexpr int kTokenStride = kStage1Threads / kChunksPerRow;
  static constexpr int kSlotsPerThread = kKvTileTokens / kTokenStride;
  static_assert(kKvTileTokens % kTokenStride == 0 && kTokenStride % 8 == 0, "tile rows per thread");
  // The slot ring is a tile ahead: the pipeline reads a stage's slots one iteration after their
  // copy was issued, and its wait for all but kStages - 2 groups covers that only with two stages.
  static_assert(kStages == 2, "the slot ring is one tile ahead");

  const Stage1Params& params;
  const Stage1Task& task;
  unsigned char* smem;
  int32_t* slot_ring;
  int copy_part;
  int copy_token;
  int part_offset;
  int slot_bytes;
  uint32_t copy_dst;

  __device__ __forceinline__ KvTileLoader(const Stage1Params& params_, const Stage1Task& task_,
                                          unsigned char* smem_, int slot_bytes_)
      : params(params_),
        task(task_),
        smem(smem_),
        slot_ring(reinterpret_cast<int32_t*>(smem_ + Smem::kSlotRingOffset)),
        copy_part(threadIdx.x % kChunksPerRow),
        copy_token(threadIdx.x / kChunksPerRow),
        part_offset((task_.kv_head * kHeadDim + copy_part * 8) * static_cast<int>(sizeof(T))),
        slot_bytes(slot_bytes_),
        copy_dst(smem_address(smem_) + swizzled_offset(copy_token, copy_part, kKvTileTokens)) {}

  /// \brief Copies tile `tile`'s KV slots into the slot ring's `stage` ([kStages][64] ints).
  /// One 4-byte cp.async a token, zeros past the task's tokens; a tile ahead of its KV copies:
  /// loaded from global memory next to those copies, a tile waited a full memory round trip before
  /// its copies could be issued.
  __device__ __forceinline__ void prefetch_slots(int tile, int stage) const {
    if (threadIdx.x < kKvTileTokens) {
      const int token = tile * kKvTileTokens + threadIdx.x;
      const bool valid = token < task.run_tokens;
      cp_async_small<4>(smem_address(slot_ring + stage * kKvTileTokens + threadIdx.x),
                        params.plan.kv_slots + task.kv_begin + (valid ? token : 0), valid);
    }
  }

  /// \brief Copies tile `tile`'s K, V (and mask words) into `stage`; its slots are in the ring.
  /// K, V: swizzled [64 tokens][kHeadDim] each; masked tasks: the tile's [64] mask words. Each
  /// thread copies the same 16-byte part of kSlotsPerThread tokens, their slots read first, all at
  /// once; zeros past the task's tokens.
  __device__ __forceinline__ void load_tile(int tile, int stage) const {
    const int token0 = tile * kKvTileTokens;
    int slots[kSlotsPerThread];
#pragma unroll
    for (int i = 0; i < kSlotsPerThread; ++i) {
      slots[i] = slot_ring[stage * kKvTileTokens + copy_token + i * kTokenStride];
    }
    const uint32_t k_dst = copy_dst + stage * Smem::kStageBytes;
#pragma unroll
    for (int i = 0; i < kSlotsPerThread; ++i) {
      const bool valid = token0 + copy_token + i * kTokenStride < task.run_tokens;
      const int64_t offset = static_cast<int64_t>(slots[i]) * slot_bytes + part_offset;
      const uint32_t dst = k_dst + i * kTokenStride * kSwizzleRowBytes;
      cp_async_16(dst, static_cast<const char*>(params.k_cache) + offset, valid);
      cp_async_16(dst + Smem::kTileBytes, static_cast<const char*>(params.v_cache) + offset, valid);
    }
    if (task.masked && threadIdx.x < kKvTileTokens) {
      const int token = token0 + threadIdx.x;
      const bool valid = token < task.run_tokens;
      uint64_t* mask_tile =
          reinterpret_cast<uint64_t*>(smem + Smem::kMaskOffset) + stage * kKvTileTokens;
      cp_async_small<8>(smem_address(mask_tile + threadIdx.x),
                        params.plan.mask_words + task.mask_begin + (valid ? token : 0), valid);
    }
  }
};

/// \brief Starts a pass's pipeline: the first tiles' slots and the first tile's KV in flight.
/// `upcoming`: the pass's first kStages needed tiles (num_tiles: none). The plan is read before
/// waiting for the kernel before (the step's KV write), which a programmatic launch overlaps; so
/// is the first tile when its tokens hold KV from before the step
/// (AttentionPlanView::task_kv_ready). On return the kernel before is done: Q, the KV and our
/// outputs may be touched.
template <typename T, int kHeadDim>
__device__ __forceinline__ void start_pass_pipeline(const KvTileLoader<T, kHeadDim>& kv,
                                                    const AttentionPlanView& plan,
                                                    const Stage1Task& task,
                                                    const int (&upcoming)[kStages]) {
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    if (upcoming[i] < task.num_tiles) kv.prefetch_slots(upcoming[i], i);
  }
  cp_async_commit();
  static_assert(kStages == 2, "one tile is loaded before the loop");
  const bool first_tile_ready =
      upcoming[0] < task.num_tiles && plan.task_kv_ready != nullptr &&
      min(task.run_tokens, (upcoming[0] + 1) * kKvTileTokens) <= plan.task_kv_ready[task.task];
  if (!first_tile_ready) wait_for_prerequisite_grid();
  cp_async_wait<0>();
  __syncthreads();  // the slots are in the ring
  if (upcoming[0] < task.num_tiles) kv.load_tile(upcoming[0], 0);
  cp_async_commit();
  if (first_tile_ready) wait_for_prerequisite_grid();
}

/// \brief This thread's two fragment rows of the pass (task rows) and their mask bits.
/// Masked tasks have at most 64 entries; rows past the task see nothing in masked tasks (bit 64)
/// and are never written.
__device__ __forceinline__ FragmentRows fragment_rows(const Stage1Task& task,
                                                      const Stage1Pass& pass, int lane_row) {
  FragmentRows rows;
  rows.row_a = pass.row0 + pass.warp_row_block * kMmaRows + lane_row;
  rows.row_b = rows.row_a + 8;
  rows.row_a_valid = rows.row_a < task.num_rows;
  rows.row_b_valid = rows.row_b < task.num_rows;
  rows.bit_a = rows.row_a_valid ? rows.row_a / task.group : 64;
  rows.bit_b = rows.row_b_valid ? rows.row_b / task.group : 64;
  return rows;
}

/// \brief Loads Q's A fragments of the warp's 16 rows straight from global memory.
/// q_frag [kHeadDim / 16 k-steps][4]: the row-major 16 x kHeadDim block; zeros for rows past the
/// task. q: [queries][num_q_heads][kHeadDim].
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_q_fragments(uint32_t (&q_frag)[kHeadDim / 16][4],
                                                 const Stage1Params& params, const Stage1Task& task,
                                                 const FragmentRows& rows, int lane_col,
                                                 const T* q) {
  const int q_row_stride = task.q_row_stride;
  const T* q_row_a = nullptr;
  const T* q_row_b = nullptr;
  if (rows.row_a_valid) {
    const int query = params.plan.entry_query[task.entry_begin + rows.row_a / task.group];
    q_row_a = q + static_cast<int64_t>(query) * q_row_stride +
              (task.kv_head * task.group + rows.row_a % task.group) * kHeadDim;
  }
  if (rows.row_b_valid) {
    const int query = params.plan.entry_query[task.entry_begin + rows.row_b / task.group];
    q_row_b = q + static_cast<int64_t>(query) * q_row_stride +
              (task.kv_head * task.group + rows.row_b % task.group) * kHeadDim;
  }
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const int col = kk * 16 + 2 * lane_col;
    q_frag[kk][0] = rows.row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col) : 0u;
    q_frag[kk][1] = rows.row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col) : 0u;
    q_frag[kk][2] = rows.row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col + 8) : 0u;
    q_frag[kk][3] = rows.row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col + 8) : 0u;
  }
}

/// \brief Sets the scores a row does not see to -inf: tokens past the run, masked tokens.
/// scores [kBlocks][4] (fragment layout): a warp's 16 rows x (8 kBlocks) tokens from tile token
/// `step_token0` of the tile at run token `token0`; mask_tile: the tile's [64] mask words
/// (masked tasks). Steps every row sees entirely (before full_tokens) skip the tests.
template <int kBlocks>
__device__ __forceinline__ void mask_scores(float (&scores)[kBlocks][4], const ScoreMask& mask,
                                            const uint64_t* mask_tile, int token0,
                                            int step_token0) {
  const bool step_full = token0 + step_token0 + 8 * kBlocks <= mask.full_tokens;
  if (!step_full) {
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = step_token0 + nb * 8 + 2 * mask.lane_col + (e & 1);
        const int bit = e < 2 ? mask.bit_a : mask.bit_b;
        bool visible = token0 + token < mask.run_tokens;
        if (mask.masked && visible) visible = bit < 64 && ((mask_tile[token] >> bit) & 1);
        if (!visible) scores[nb][e] = kNegInf;
      }
    }
  }
}

/// \brief Packs P for PV: weights [kBlocks][4] (accumulator layout) -> A fragment [4] of a pair.
/// The pair is tokens 16 pair .. 16 pair + 15, rounded to T.
template <typename T, int kBlocks>
__device__ __forceinline__ void p_fragment(const float (&scores)[kBlocks][4], int pair,
                                           uint32_t (&p_frag)[4]) {
  using Traits = ElemTraits<T>;
  p_frag[0] = Traits::pack(scores[2 * pair][0], scores[2 * pair][1]);
  p_frag[1] = Traits::pack(scores[2 * pair][2], scores[2 * pair][3]);
  p_frag[2] = Traits::pack(scores[2 * pair + 1][0], scores[2 * pair + 1][1]);
  p_frag[3] = Traits::pack(scores[2 * pair + 1][2], scores[2 * pair + 1][3]);
}

/// \brief S = Q K^T on mma.sync for a warp's 16 rows x (8 kBlocks) tokens.
/// scores [kBlocks][4] (unscaled) from tile token `step_token0`; q_frag [kHeadDim / 16][4];
/// k_tile: the stage's swizzled K [64 tokens][kHeadDim] (shared-memory address).
template <typename T, int kHeadDim, int kBlocks>
__device__ __forceinline__ void qk_mma_sync(float (&scores)[kBlocks][4],
                                            const uint32_t (&q_frag)[kHeadDim / 16][4],
                                            uint32_t k_tile, int step_token0, int lane) {
  using Traits = ElemTraits<T>;
  const int matrix = lane / 8;  // which 8x8 matrix of an x4 ldmatrix this lane addresses
  const int matrix_row = lane % 8;
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb) {
    scores[nb][0] = scores[nb][1] = scores[nb][2] = scores[nb][3] = 0.0f;
  }
#pragma unroll
  for (int pair = 0; pair < kBlocks / 2; ++pair) {
    const int token = step_token0 + pair * 16 + (matrix >> 1) * 8 + matrix_row;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t k_frag[4];
      ldmatrix_x4(k_frag, k_tile + swizzled_offset(token, 2 * kk + (matrix & 1), kKvTileTokens));
      Traits::mma(scores[2 * pair], q_frag[kk], k_frag[0], k_frag[1]);
      Traits::mma(scores[2 * pair + 1], q_frag[kk], k_frag[2], k_frag[3]);
    }
  }
}

/// \brief One warp step on mma.sync: S = Q K^T, mask, online softmax update, O += P V.
/// A warp's 16 rows x (8 kBlocks) tokens from tile token `step_token0`; O [kHeadDim / 8][4] in
/// `state`. Scores stay unscaled until the exponent: the maxima are taken on raw scores
/// (softmax_scale > 0, see deft_attention_supported, so the order is the same) and exp2(s *
/// scale - max) is one FFMA and one MUFU.EX2 (ftz: exponents below -126 give 0, as they should
/// here).
template <typename T, int kHeadDim, int kBlocks>
__device__ __forceinline__ void mma_sync_step(const RowsState<kHeadDim / 8>& state,
                                              const uint32_t (&q_frag)[kHeadDim / 16][4],
                                              const ScoreMask& mask, float scale_log2, int lane,
                                              uint32_t k_tile, uint32_t v_tile,
                                              const uint64_t* mask_tile, int token0,
                                              int step_token0) {
  using Traits = ElemTraits<T>;
  const int matrix = lane / 8;  // which 8x8 matrix of an x4 ldmatrix this lane addresses
  const int matrix_row = lane % 8;
  float scores[kBlocks][4];
  qk_mma_sync<T, kHeadDim>(scores, q_frag, k_tile, step_token0, lane);
  mask_scores(scores, mask, mask_tile, token0, step_token0);
  online_softmax_step(scores, state.o_acc, scale_log2, state.max_a, state.max_b, state.sum_a,
                      state.sum_b);
  // O += P V, 16 tokens at a time (P's accumulator layout is the A-fragment layout of the MMA).
#pragma unroll
  for (int pair = 0; pair < kBlocks / 2; ++pair) {
    uint32_t p_frag[4];
    p_fragment<T>(scores, pair, p_frag);
    const int token = step_token0 + pair * 16 + (matrix & 1) * 8 + matrix_row;
#pragma unroll
    for (int nb2 = 0; nb2 < kHeadDim / 16; ++nb2) {
      uint32_t v_frag[4];
      ldmatrix_x4_trans(v_frag,
                        v_tile + swizzled_offset(token, 2 * nb2 + (matrix >> 1), kKvTileTokens));
      Traits::mma(state.o_acc[2 * nb2], p_frag, v_frag[0], v_frag[1]);
      Traits::mma(state.o_acc[2 * nb2 + 1], p_frag, v_frag[2], v_frag[3]);
    }
  }
}

/// \brief S = Q K^T on warpgroup MMAs for the pass's 64 rows, a commit group a 32-token half.
/// scores [2 halves][4][4] (a half: the m64n32 accumulator); q_frag [kHeadDim / 16][4]; k_desc:
/// the K tile's descriptor (K-major).
template <typename T, int kHeadDim>
__device__ __forceinline__ void qk_wgmma(float (&scores)[2][kKvTileTokens / 16][4],
                                         const uint32_t (&q_frag)[kHeadDim / 16][4],
                                         uint64_t k_desc) {
  using Smem = Stage1Smem<kHeadDim>;
  constexpr int kHalf = kKvTileTokens / 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      // 16 columns = 32 bytes into the column block (the swizzle acts on the absolute
      // address); a half starts 32 rows (4 swizzle atoms) down.
      const uint32_t offset =
          (kk / 4) * Smem::kBlockBytes + (kk % 4) * 32 + half * kHalf * kSwizzleRowBytes;
      wgmma_rs<T, kHalf, false>(scores[half], q_frag[kk], wgmma_descriptor_advance(k_desc, offset),
                                kk > 0);
    }
    wgmma_commit();
  }
}

/// \brief O += P V on warpgroup MMAs for one 32-token half of a tile, one commit group.
/// o_acc [kHeadDim / 8][4]; p_frag [2 k-steps][4] of the half's tokens; v_desc: the V tile's
/// descriptor (MN-major, column blocks Smem::kBlockBytes apart).
template <typename T, int kHeadDim>
__device__ __forceinline__ void pv_wgmma(float (&o_acc)[kHeadDim / 8][4],
                                         uint32_t (&p_frag)[kKvTileTokens / 32][4], uint64_t v_desc,
                                         int half) {
  constexpr int kHalf = kKvTileTokens / 2;
  wgmma_fence_operands(o_acc);
  wgmma_fence();
#pragma unroll
  for (int pair = 0; pair < kHalf / 16; ++pair) {
    const uint32_t offset = (half * kHalf + pair * 16) * kSwizzleRowBytes;
    wgmma_rs<T, kHeadDim, true>(o_acc, p_frag[pair], wgmma_descriptor_advance(v_desc, offset),
                                true);
  }
  wgmma_commit();
}

/// \brief Sums each row's denominator over its quad (the 4 lanes that hold its columns).
template <int kOBlocks>
__device__ __forceinline__ void reduce_row_sums(const RowsState<kOBlocks>& state) {
  state.sum_a += __shfl_xor_sync(0xffffffffu, state.sum_a, 1);
  state.sum_a += __shfl_xor_sync(0xffffffffu, state.sum_a, 2);
  state.sum_b += __shfl_xor_sync(0xffffffffu, state.sum_b, 1);
  state.sum_b += __shfl_xor_sync(0xffffffffu, state.sum_b, 2);
}

// Where a pass row's normalised values go.
template <typename T>
struct RowDestination {
  T* row;  // the output row or the partial O row ([kHeadDim])
  float inv_sum;
};

/// \brief Where pass row `pass_row`'s O [kHeadDim] goes, and its 1 / sum; writes its LSE.
/// The output row when its query has a single partial (resolve_row_targets), else the entry's
/// partial row, whose LSE (natural log) is written here when `with_lse`. An entry that saw no
/// token (a plan bug) yields zeros and LSE -inf, never NaN.
template <typename T, int kHeadDim>
__device__ __forceinline__ RowDestination<T> row_destination(
    const Stage1Params& params, const Stage1Task& task, const Stage1Pass& pass,
    const int32_t* row_target, int pass_row, float row_max, float row_sum, bool with_lse) {
  const int q_row_stride = task.q_row_stride;
  const int row = pass.row0 + pass_row;
  const int head = task.kv_head * task.group + row % task.group;
  const int target = row_target[pass_row];
  RowDestination<T> dest{nullptr, row_sum > 0.0f ? 1.0f / row_sum : 0.0f};
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
}

/// \brief Stores the warp's state of its 16 rows in shared memory for the end-of-pass merge.
/// merge_o [4 warps][16][kHeadDim], merge_max and merge_sum [4 warps][16] (fp32).
template <int kHeadDim>
__device__ __forceinline__ void stash_rows_state(const RowsState<kHeadDim / 8>& state,
                                                 float* merge_o, float* merge_max, float* merge_sum,
                                                 int warp, int lane_row, int lane_col) {
  float* warp_o = merge_o + warp * kMmaRows * kHeadDim;
#pragma unroll
  for (int nb = 0; nb < kHeadDim / 8; ++nb) {
    const int col = nb * 8 + 2 * lane_col;
    *reinterpret_cast<float2*>(warp_o + lane_row * kHeadDim + col) =
        make_float2(state.o_acc[nb][0], state.o_acc[nb][1]);
    *reinterpret_cast<float2*>(warp_o + (lane_row + 8) * kHeadDim + col) =
        make_float2(state.o_acc[nb][2], state.o_acc[nb][3]);
  }
  if (lane_col == 0) {
    merge_max[warp * kMmaRows + lane_row] = state.max_a;
    merge_max[warp * kMmaRows + lane_row + 8] = state.max_b;
    merge_sum[warp * kMmaRows + lane_row] = state.sum_a;
    merge_sum[warp * kMmaRows + lane_row + 8] = state.sum_b;
  }
}

// ---- stage 1 ----------------------------------------------------------------------------------

// kWgmmaPasses (deft_attention_wgmma_passes): every pass runs on warpgroup MMAs, short ones
// padded to 64 rows, and the kernel keeps no mma.sync path (where compiled for sm_90a;
// elsewhere it is the general kernel).
//
// A CTA runs the row passes of its slice of a task (Stage1Cta), each pass as the chain
//   pass_layout -> scan_pass_mask -> resolve_row_targets -> start_pass_pipeline ->
//   load_q_fragments -> per needed tile: KvTileLoader (the tiles ahead) + compute_tile
//   (qk_wgmma / qk_mma_sync, mask_scores, softmax_update, pv_wgmma / PV) ->
//   reduce_row_sums -> rows written (stash_rows_state + merge when the warps split the tiles).
// The tile steps are closures over the pass's registers (o_acc, bases, sums): written as
// functions taking them by reference, they compiled to other register allocations (up to 40
// more instructions a kernel), so the closures stay and call the named steps.
template <typename T, int kHeadDim, bool kWgmmaPasses>
__global__ void __launch_bounds__(kStage1Threads, 3)
    deft_attention_stage1_kernel(const __grid_constant__ Stage1Params params) {
  constexpr bool kWgmmaOnly = kWgmmaPasses && DEFT_HAS_WGMMA;
  using Smem = Stage1Smem<kHeadDim>;
  using Traits = ElemTraits<T>;
  constexpr int kKSteps = kHeadDim / 16;  // k-steps of QK^T
  constexpr int kOBlocks = kHeadDim / 8;  // n-blocks of the O accumulator

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned blocks (the swizzle acts on address bits 4-9).
  unsigned char* const smem =
      smem_raw + ((Smem::kAlignSlack - (smem_address(smem_raw) & (Smem::kAlignSlack - 1))) &
                  (Smem::kAlignSlack - 1));

  // Stage 2 may be scheduled once every stage-1 CTA runs (it waits for our results itself).
  // Stage 1 itself is launched dependent on the kernel before it (the KV write): it reads only
  // the plan until start_pass_pipeline waits for that kernel.
  allow_dependent_launch();

  const AttentionPlanView& plan = params.plan;
  // Grid: one dimension, a CTA per (task, KV head, row slice) with work, longest first
  // (build_stage1_ctas). A task has as many slices as its rows need: a grid of the launch's
  // widest task's slices for every task left most CTAs of a plan of many small tasks idle.
  const Stage1Cta cta = plan.stage1_ctas[blockIdx.x];
  if (cta.task < 0) return;  // padding
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_row = lane / 4;  // "groupID" of the MMA fragment layouts
  const int lane_col = lane % 4;  // "threadID_in_group"
  const Stage1Task task = load_task<kHeadDim, kWgmmaOnly>(params, cta);

  const T* q = static_cast<const T*>(params.q);
  const int slot_bytes = params.num_kv_heads * kHeadDim * static_cast<int>(sizeof(T));

  for (int pass_index = cta.slice; pass_index < task.num_passes; pass_index += cta.slices) {
    Stage1Pass pass = pass_layout<kWgmmaOnly>(task, pass_index, warp);
    pass.full_tokens = scan_pass_mask<Smem>(plan, task, pass.bits, smem, warp, lane);
    const KvTileLoader<T, kHeadDim> kv(params, task, smem, slot_bytes);

    // The ring holds kStages tiles: the one computed and up to kStages - 1 in flight. upcoming[i]
    // is the i-th needed tile after the computed one; the k-th tile of the pass uses stage k %
    // kStages. The pass's first tiles are in flight while Q loads.
    int upcoming[kStages];
    upcoming[0] = next_needed_tile<Smem>(task, smem, 0);
#pragma unroll
    for (int i = 1; i < kStages; ++i) {
      upcoming[i] = next_needed_tile<Smem>(task, smem, upcoming[i - 1] + 1);
    }
    int32_t* row_target = reinterpret_cast<int32_t*>(smem + Smem::kRowTargetOffset);
    resolve_row_targets<Smem>(plan, task, pass, smem);
    start_pass_pipeline(kv, plan, task, upcoming);

    const FragmentRows rows = fragment_rows(task, pass, lane_row);
    uint32_t q_frag[kKSteps][4];
    load_q_fragments<T, kHeadDim>(q_frag, params, task, rows, lane_col, q);

    float o_acc[kOBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kOBlocks; ++nb) {
      o_acc[nb][0] = o_acc[nb][1] = o_acc[nb][2] = o_acc[nb][3] = 0.0f;
    }
    float max_a = kNegInf, max_b = kNegInf;  // exponent bases (scaled scores, base 2)
    float sum_a = 0.0f, sum_b = 0.0f;        // this thread's share of the running denominators
    const RowsState<kOBlocks> state{o_acc, max_a, max_b, sum_a, sum_b};
    const ScoreMask mask{task.run_tokens, pass.full_tokens, task.masked,
                         rows.bit_a,      rows.bit_b,       lane_col};

    auto p_fragment = [](const auto& scores, int pair, uint32_t(&p_frag)[4]) {
      ::deft::kernels::detail::p_fragment<T>(scores, pair, p_frag);
    };

    // One warp step on mma.sync: 16 rows x (8 * kBlocks) tokens from tile token `step_token0`.
    auto compute_step = [&](auto blocks_tag, uint32_t k_tile, uint32_t v_tile,
                            const uint64_t* mask_tile, int token0, int step_token0) {
      constexpr int kBlocks = decltype(blocks_tag)::value;  // n-blocks of 8 tokens, even
      mma_sync_step<T, kHeadDim, kBlocks>(state, q_frag, mask, params.scale_log2, lane, k_tile,
                                          v_tile, mask_tile, token0, step_token0);
    };

    // A whole 64-token tile for the pass's 64 rows on warpgroup MMAs (Q and P from registers, K
    // and V from the stage's tiles). The tile is two halves of 32 tokens so that the tensor cores
    // and the softmax overlap: the first half's softmax runs while the second half's QK^T does,
    // and the second half's softmax while the first half's PV does (its O rescale waits for that
    // PV).
    auto compute_tile_wgmma = [&](uint32_t k_tile, uint32_t v_tile, const uint64_t* mask_tile,
                                  int token0) {
      constexpr int kHalf = kKvTileTokens / 2;
      // Built once a tile; each MMA's operand start is a constant offset from these.
      const uint64_t k_desc = wgmma_descriptor(k_tile, 16, 8 * kSwizzleRowBytes);
      const uint64_t v_desc = wgmma_descriptor(v_tile, Smem::kBlockBytes, 8 * kSwizzleRowBytes);
      float scores[2][kHalf / 8][4];
      wgmma_fence();
      qk_wgmma<T, kHeadDim>(scores, q_frag, k_desc);
      uint32_t p_frag[2][kHalf / 16][4];
      float alpha_a, alpha_b;
      wgmma_wait<1>();  // the first half's scores (the second's QK^T still running)
      wgmma_fence_operands(scores[0]);
      ::deft::kernels::detail::mask_scores(scores[0], mask, mask_tile, token0, 0);
      softmax_update(scores[0], params.scale_log2, max_a, max_b, sum_a, sum_b, alpha_a, alpha_b);
      rescale_rows(o_acc, alpha_a, alpha_b);  // no wgmma writes O now
#pragma unroll
      for (int pair = 0; pair < kHalf / 16; ++pair) p_fragment(scores[0], pair, p_frag[0][pair]);
      pv_wgmma<T, kHeadDim>(o_acc, p_frag[0], v_desc, 0);
      wgmma_wait<1>();  // the second half's scores (the first half's PV still running)
      wgmma_fence_operands(scores[1]);
      ::deft::kernels::detail::mask_scores(scores[1], mask, mask_tile, token0, kHalf);
      softmax_update(scores[1], params.scale_log2, max_a, max_b, sum_a, sum_b, alpha_a, alpha_b);
#pragma unroll
      for (int pair = 0; pair < kHalf / 16; ++pair) p_fragment(scores[1], pair, p_frag[1][pair]);
      wgmma_wait_all();  // the first half's PV: O may be rescaled
      wgmma_fence_operands(o_acc);
      rescale_rows(o_acc, alpha_a, alpha_b);
      pv_wgmma<T, kHeadDim>(o_acc, p_frag[1], v_desc, 1);
      wgmma_wait_all();
      wgmma_fence_operands(o_acc);
    };

    // The pass's work on tile `tile` (run tokens from tile * 64), held in `stage`.
    auto compute_tile = [&](int tile, int stage) {
      const uint32_t k_tile = smem_address(smem + stage * Smem::kStageBytes);
      const uint32_t v_tile = k_tile + Smem::kTileBytes;
      const uint64_t* mask_tile =
          reinterpret_cast<const uint64_t*>(smem + Smem::kMaskOffset) + stage * kKvTileTokens;
      const int token0 = tile * kKvTileTokens;
      if (pass.use_wgmma) {
        compute_tile_wgmma(k_tile, v_tile, mask_tile, token0);
        return;
      }
      if constexpr (!kWgmmaOnly) {
        if (pass.kv_splits == 1) {
          // Many rows: the whole 64-token tile in one step (more independent MMAs, one softmax
          // rescale per tile instead of four).
          compute_step(std::integral_constant<int, kKvTileTokens / 8>{}, k_tile, v_tile, mask_tile,
                       token0, 0);
          return;
        }
        // Few rows: the warps share the tile, 16 tokens each per step.
        for (int step = pass.warp_split; step < kKvTileTokens / kStepTokens;
             step += pass.kv_splits) {
          const int step_token0 = step * kStepTokens;
          if (token0 + step_token0 >= task.run_tokens) break;
          compute_step(std::integral_constant<int, kStepTokens / 8>{}, k_tile, v_tile, mask_tile,
                       token0, step_token0);
        }
      }
    };

    // Pipeline: the copies of the next kStages - 1 tiles overlap this tile's math.
    int stage = 0;
    while (upcoming[0] < task.num_tiles) {
      cp_async_wait<kStages - 2>();  // this tile's copy has landed
      fence_async_shared();          // this thread's copies become visible to wgmma's reads
      __syncthreads();
      // The stage of the tile computed last iteration is free: the kStages - 1'th tile ahead,
      // whose slots landed with this tile; the slots of the tile after it go to the slot ring's
      // entry of this stage (its tile is loaded into this stage next iteration).
      const int last = upcoming[kStages - 1];
      const int after =
          last < task.num_tiles ? next_needed_tile<Smem>(task, smem, last + 1) : task.num_tiles;
      if (last < task.num_tiles) kv.load_tile(last, (stage + kStages - 1) % kStages);
      if (after < task.num_tiles) kv.prefetch_slots(after, stage);
      cp_async_commit();
      if (pass.use_wgmma || pass.warp_has_rows) compute_tile(upcoming[0], stage);
      // The next iteration's barrier alone would order the overwrites of this stage, but without
      // this one the warps drift apart and stage 1 ran 1-3 % slower
      // (bench/results/kernel_attention-h100-notes.md).
      __syncthreads();
#pragma unroll
      for (int i = 0; i + 1 < kStages; ++i) upcoming[i] = upcoming[i + 1];
      upcoming[kStages - 1] = after;
      stage = (stage + 1) % kStages;
    }
    cp_async_wait<0>();
    __syncthreads();

    reduce_row_sums(state);
    using RowDestination = ::deft::kernels::detail::RowDestination<T>;
    auto row_destination = [&](int pass_row, float row_max, float row_sum, bool with_lse) {
      return ::deft::kernels::detail::row_destination<T, kHeadDim>(
          params, task, pass, row_target, pass_row, row_max, row_sum, with_lse);
    };
    if (pass.kv_splits == 1) {
      // Each row's whole state is in its warp's registers: written from there, a quad's 64 bytes
      // at once.
      if (pass.warp_has_rows) {
        const int pass_row_a = pass.warp_row_block * kMmaRows + lane_row;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pass_row = pass_row_a + 8 * half;
          const bool valid = pass_row < pass.rows;  // the same for a lane quad
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
      // The warps' states of the same rows are merged through shared memory (the KV ring).
      float* merge_o = reinterpret_cast<float*>(smem);
      float* merge_max = merge_o + kStage1Warps * kMmaRows * kHeadDim;
      float* merge_sum = merge_max + kStage1Warps * kMmaRows;
      stash_rows_state<kHeadDim>(state, merge_o, merge_max, merge_sum, warp, lane_row, lane_col);
      __syncthreads();

      constexpr int kQuads = kHeadDim / 4;  // float4 columns per row
      for (int item = threadIdx.x; item < pass.rows * kQuads; item += kStage1Threads) {
        const int pass_row = item / kQuads;
        const int col = (item % kQuads) * 4;
        const int row_block = pass_row / kMmaRows;
        const int block_row = pass_row % kMmaRows;
        float row_max = kNegInf;
        for (int split = 0; split < pass.kv_splits; ++split) {
          const int w = row_block + split * pass.row_warps;
          row_max = fmaxf(row_max, merge_max[w * kMmaRows + block_row]);
        }
        float row_sum = 0.0f;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row_max != kNegInf) {
          for (int split = 0; split < pass.kv_splits; ++split) {
            const int w = row_block + split * pass.row_warps;
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
// in the H100's decode step (ncu), where stage 2 sits between stage 1 and the O projection. A
// larger batch holds more registers (head_dim 128: 32 rows 96 a thread, 8 rows 48), so the launch
// picks the batch (stage2_choice_for in deft_attention.cu): the smallest that takes the plan's
// largest query in one trip among those whose grid fits on the GPU at once.
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
  // stage 1 the prefetch slowed its KV reads more than it sped up the GEMM (H100;
  // bench/results/kernel_attention-h100-notes.md).
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
