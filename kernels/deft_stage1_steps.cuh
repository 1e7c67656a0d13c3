// The named steps of a DeFT stage-1 CTA (kernels/deft_attention.cuh): what a CTA reads of its
// task and pass, the mask scan, the paged KV tile loader, Q fragments, QK / PV on mma.sync and
// on warpgroup MMAs, score masking, row sums and where a row's result goes. Each step says its
// contract and shapes; the kernel is the chain of them.
#pragma once

#include "kernels/deft_attention_common.cuh"

namespace deft::kernels::detail {

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

}  // namespace deft::kernels::detail
