// How stage 1 of the DeFT kernels cuts a plan's work and maps it onto the SMs (host side, no
// CUDA): the row slices a task's rows need, the grid's table of CTAs in the order the GPU should
// start them, the buckets a graph-replayed plan is padded to, and how many CTAs the GPU holds at
// once. Kept apart from the kernels that
// run the grid (kernels/deft_attention.cuh), as FlashInfer keeps attention/scheduler.cuh apart
// from its kernels. The planner's wave estimate (engine/attention_planner.cc, wave_chunk_tokens)
// counts CTAs and their work with the same arithmetic: change the two together.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/dtype.h"

namespace deft::kernels {

// Stage 1's geometry (the kernels static_assert theirs against it): KV tiles of 64 tokens, row
// passes of up to 64 rows (entries x GQA group: 4 warps x 16 MMA rows).
inline constexpr int32_t kStage1TileTokens = 64;
inline constexpr int32_t kStage1PassRows = 64;
// Row slices (CTAs per task and KV head): a task with many rows is split over up to this many
// CTAs, each re-reading the task's KV (mostly from L2) for its rows. 32 = 256 entries x group 8 /
// 64 rows: every pass its own CTA.
inline constexpr int32_t kMaxRowSlices = 32;
// A CTA's work in tiles, as the grid orders CTAs: its task's tiles, a masked one counted twice
// (the kernel tests each score's mask bit: bench/results/kernel_attention-h100-notes.md), + this
// fixed cost.
inline constexpr int32_t kStage1CtaOverheadTiles = 2;

// Stage 1's CTAs per KV head (row slices) for a task of `max_task_entries` entries, or at most
// for a plan whose largest task has that many (each task has its own: Stage1Cta): its row passes
// at `dims`' GQA group, at most kMaxRowSlices.
int32_t deft_attention_row_slices(int32_t max_task_entries, const AttentionDims& dims);

// Stage 1's grid for a plan whose arrays are host memory (AttentionPlanView::stage1_ctas), into
// `ctas` (replaced): each task on the row slices its rows need at `dims`' GQA group
// (deft_attention_row_slices of its entries), one CTA per (KV head, slice), the longest first
// (tiles, a masked one counted twice, + kStage1CtaOverheadTiles; ties in task, KV head, slice
// order): on grids of more than one wave the longest chains then start in the first wave and
// short CTAs fill in at the end (H100: reasoning 35.7 -> 33.2 us, few-shot b50 33.3 -> 31.6;
// one-wave grids unchanged). DevicePlan uploads it.
void build_stage1_ctas(const AttentionPlanView& host_plan, const AttentionDims& dims,
                       std::vector<Stage1Cta>& ctas);

// Graph buckets: a CUDA graph replays one launch shape for every step of its bucket, so a plan is
// padded to its bucket's capacity (DevicePlan::upload_padded; models/step_graphs.h keys graphs by
// these). `count` rounded up to a power of two (0 and 1 stay):
int32_t pow2_bucket(int32_t count);
// Task counts: powers of two up to 16, then 8 buckets per octave (< 12.5 % of empty tasks).
int32_t task_bucket(int32_t count);

// Stage-1 CTAs the current device holds at once (SMs x CTAs per SM for `dims` and `dtype`; 0 for
// unsupported dims): a grid larger than this runs in more than one wave. The planner sizes chunks
// by it (engine::PlannerOptions::wave). An occupancy query of the kernel: defined with the kernels
// (kernels/deft_attention.cu), in builds with CUDA only.
int32_t deft_attention_resident_ctas(const AttentionDims& dims, DType dtype);

}  // namespace deft::kernels
