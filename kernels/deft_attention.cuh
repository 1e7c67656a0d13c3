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
// Stage 2 (kernels/merge_states.cuh): one warp per (query, head); queries with a single partial
// return at once; the others merge their partials. Stage 1's named steps live in
// kernels/deft_stage1_steps.cuh, what both stages and the prefill kernel share in
// kernels/deft_attention_common.cuh.
#pragma once

#include "kernels/deft_attention_common.cuh"
#include "kernels/deft_stage1_steps.cuh"

namespace deft::kernels::detail {

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

}  // namespace deft::kernels::detail
