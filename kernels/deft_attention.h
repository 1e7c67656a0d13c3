// Host API of the DeFT tree-attention kernels (GPU). Executes an AttentionPlanView (see
// kernels/attention_params.h) whose arrays live in device memory:
//   stage 1: one CTA per (task, KV head [, row slice]) loads the task's KV once and computes
//            every query head of that KV head's GQA group for every entry of the task;
//            writes partial O + LSE, or the final output for queries with a single partial;
//   stage 2: per (query, head) with more than one partial, merges the partials.
// Launch shapes depend only on the plan's sizes and there is no host synchronisation inside a
// launch, so a step's launches can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/deft_schedule.h"  // stage 1's grid, which DevicePlan builds and uploads
#include "kernels/device_buffer.h"
#include "kernels/dtype.h"
#include "kernels/weight_prefetch.h"

namespace deft::kernels {

// Sizes a padded plan is laid out for (DevicePlan::upload_padded): at least the plan's counts.
struct PlanCapacity {
  int32_t queries = 0;
  int32_t tasks = 0;
  int32_t entries = 0;
  int32_t kv_indices = 0;
  int32_t mask_words = 0;
  // Stage 1's CTAs (AttentionPlanView::stage1_ctas): at least the tasks x the row slices of the
  // largest task (deft_attention_row_slices, kernels/deft_schedule.h) x the KV heads. 0: none,
  // the plan is not for the DeFT kernels.
  int32_t stage1_ctas = 0;

  bool holds(const AttentionPlanView& plan) const {
    return plan.num_queries <= queries && plan.num_tasks <= tasks && plan.num_entries <= entries &&
           plan.num_kv_indices <= kv_indices && plan.num_mask_words <= mask_words;
  }
};

// What the host knows of an uploaded plan's shape (DevicePlan::shape()); sizes the launches.
struct PlanShape {
  int32_t max_task_entries = 0;   // largest task_entry_begin[t + 1] - task_entry_begin[t]
  int32_t max_query_entries = 0;  // largest query_entry_begin[q + 1] - query_entry_begin[q]
  // Set by the caller, not the plan: every stage-1 pass on warpgroup MMAs whatever the plan's
  // largest task (deft_attention_wgmma_passes), so that a row's arithmetic depends only on its
  // task's KV run and the prefix of it the row sees, never on how many rows share its pass or
  // plan (the mma.sync passes of small plans split a tile's tokens among warps, another order).
  // Stage 2 merges a query's partials in plan order whatever its batch. With a deterministic
  // plan (engine::PlannerOptions::deterministic) a row's output is then bitwise the same in any
  // step. Needs the sm_90a code (deft_attention_batch_invariant_available).
  bool batch_invariant = false;
};

// The shape of a plan whose arrays are host memory (null entry arrays: no entries).
PlanShape plan_shape(const AttentionPlanView& host_plan);

// A plan copied to the GPU: all arrays packed into ONE device buffer, uploaded with one async
// copy from a pinned staging buffer. One upload per step serves every layer. The step's other
// inputs (`extra`: token ids, positions, ...) may ride along in the same copy: one host call a
// step instead of two.
class DevicePlan {
 public:
  DevicePlan();
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;

  // Copies `host_plan` (host pointers) to the device on `stream`, with stage 1's grid for layers
  // of `dims` (build_stage1_ctas of kernels/deft_schedule.h: a CTA per task, KV head and row
  // slice; launch_deft_attention refuses other KV head counts). Buffers grow as needed and are
  // reused. Waits (host side) only for this object's previous upload to have left the staging
  // buffer, never for kernels. `extra` lands at extra() (16-byte aligned) before the plan's
  // arrays.
  void upload(const AttentionPlanView& host_plan, const AttentionDims& dims, cudaStream_t stream,
              std::span<const unsigned char> extra = {});
  // As upload(), laid out for `capacity` (which must hold the plan): tasks past num_tasks are
  // empty (no KV, no entries), queries past num_queries have no entries, and the view's counts
  // are the capacity's. Every plan uploaded with the same capacity gives the same view (same
  // pointers, same counts) once the buffer has that size, so launches captured in a CUDA graph
  // on one plan replay on the next (a padded query's output row is left as it was); so does
  // extra() for the same extra size.
  void upload_padded(const AttentionPlanView& host_plan, const AttentionDims& dims,
                     const PlanCapacity& capacity, cudaStream_t stream,
                     std::span<const unsigned char> extra = {});
  // upload_padded() in two halves, for a copy that is a node of a CUDA graph: stage_padded()
  // lays the plan out in the pinned staging buffer (no CUDA call, unless an upload() left a copy
  // in flight), enqueue_copy() copies what was staged to the device on `stream` (captured, it
  // becomes the graph's memcpy node, which reads the staging buffer when the graph runs). The
  // caller must not stage again while such a copy may still be running (e.g. synchronise the
  // stream after each launch of the graph). Buffers keep their addresses as long as the staged
  // size (capacity and extra size) does not grow: staging(), view() and staged_bytes() say where
  // they are and what a captured copy moves.
  void stage_padded(const AttentionPlanView& host_plan, const AttentionDims& dims,
                    const PlanCapacity& capacity, std::span<const unsigned char> extra = {});
  void enqueue_copy(cudaStream_t stream) const;
  const void* staging() const { return staging_.data(); }
  size_t staged_bytes() const { return staged_bytes_; }

  // Device pointers, valid once the copy on `stream` has run.
  const AttentionPlanView& view() const { return device_view_; }
  // Where the last upload's `extra` bytes are on the device.
  const unsigned char* extra() const { return device_.as<unsigned char>(); }
  // The plan's largest task and query (host copies): size the launch (PlanShape).
  const PlanShape& shape() const { return shape_; }
  // Host copy of the plan's prefill runs: sizes launch_prefill_attention's grid.
  std::span<const PrefillRun> prefill_runs() const { return host_prefill_runs_; }

 private:
  PinnedHostBuffer staging_;
  DeviceBuffer device_;
  cudaEvent_t upload_done_ = nullptr;
  bool upload_pending_ = false;
  AttentionPlanView device_view_;
  PlanShape shape_;
  std::vector<PrefillRun> host_prefill_runs_;
  std::vector<Stage1Cta> stage1_ctas_;  // built by each upload

  size_t staged_bytes_ = 0;

  void upload_sections(const AttentionPlanView& host_plan, const AttentionDims& dims,
                       const PlanCapacity* capacity, cudaStream_t stream,
                       std::span<const unsigned char> extra);
  // Returns once no upload()'s copy reads the staging buffer.
  void wait_for_staging();
  // Fills the staging buffer and the device view's pointers; no copy.
  void stage_sections(const AttentionPlanView& host_plan, const AttentionDims& dims,
                      const PlanCapacity* capacity, std::span<const unsigned char> extra);
};

// Scratch for stage 1's partial results: O [num_entries][num_q_heads][head_dim] in the
// attention's dtype (bf16 / fp16), LSE [num_entries][num_q_heads] fp32.
class DeftAttentionBuffers {
 public:
  static constexpr size_t kPartialElementBytes = dtype_bytes(DType::kBf16);  // fp16 alike
  void reserve(int32_t num_entries, const AttentionDims& dims);
  void* partial_out() const { return partial_out_.data(); }
  float* partial_lse() const { return partial_lse_.as<float>(); }
  size_t partial_out_bytes() const { return partial_out_.bytes(); }
  size_t partial_lse_bytes() const { return partial_lse_.bytes(); }

 private:
  DeviceBuffer partial_out_;
  DeviceBuffer partial_lse_;
};

// True for the (dtype, head_dim, group size) combinations the kernels are built for:
// bf16/fp16, head_dim 64/128, any group size (1, 2, 4, 8 tested), softmax_scale > 0.
bool deft_attention_supported(const AttentionDims& dims);

// Whether stage 1 runs every pass of a plan of `shape` on warpgroup MMAs (sm_90a), short passes
// padded to 64 rows, in its kernel without the mma.sync paths (less code, fewer registers live):
// true unless the plan's largest task has at most 16 rows (entries x group; single-query plans
// such as the sequence baseline's keep mma.sync, whose warps split each tile's tokens). On the
// H100 that kernel ran every tree of bench/kernel_attention_bench as fast or faster
// (few-shot b20 23.9 -> 22.6 µs, specdec p1000 t128 19.0 -> 16.3, reasoning 46.9 -> 42.7).
bool deft_attention_wgmma_passes(const PlanShape& shape, const AttentionDims& dims);

// Whether the current device runs stage 1's warpgroup-MMA passes (sm_90a machine code on a
// compute 9.0 GPU), which PlanShape::batch_invariant needs.
bool deft_attention_batch_invariant_available();

// The stage-2 batch launch_deft_attention picks when given 0, for a plan laid out for
// `num_queries` query rows (stage 2's grid) with `shape`. A caller that captures the launch in a
// CUDA graph keys the graph on it and passes it explicitly: a later plan that wants another batch
// (more or fewer partials per query) then gets its own graph instead of the captured choice.
int32_t deft_attention_stage2_batch(const PlanShape& shape, int32_t num_queries,
                                    const AttentionDims& dims, DType dtype);

// Whether launch_deft_attention runs stage 2. kIfMerging: when the plan's counts say a query has
// two partials (num_entries > num_queries, or the plan has prefill runs). A padded plan
// (DevicePlan::upload_padded) carries capacities, not counts, so its caller decides from the step's
// own counts: kAlways or kNever. Stage 2 is correct whenever it runs (a query with one partial
// returns at once).
enum class DeftStage2 { kIfMerging, kAlways, kNever };

// Runs both stages on `stream`. `device_plan` holds device pointers; `shape` is the plan's
// (DevicePlan::shape()): it sizes stage 1's grid and picks stage 2's batch.
//   q:        [num_queries][num_q_heads][head_dim]        (dtype)
//   k_cache:  [num_slots][num_kv_heads][head_dim]         (dtype), v_cache likewise
//   partial_out / partial_lse: [num_entries][num_q_heads][head_dim] (dtype) /
//                              [num_entries][num_q_heads] (fp32)
//   out:      [num_queries][num_q_heads][head_dim]        (dtype)
// stage2_batch: how many of a query's partial O rows stage 2 loads per memory round trip (32, 16
// or 8; a larger batch holds more registers, so fewer of its CTAs fit on the GPU at once); 0
// picks, among the batches whose grid fits on the GPU at once, the smallest that holds the
// plan's largest query in one trip, else the largest (else 8). Tests force each.
// prefetch: the weights of the GEMM after the attention (the O projection), pulled into L2 by
// extra CTAs of stage 2 once stage 1 is done (none when stage 2 does not run).
// Aborts on unsupported dims (a caller bug: check deft_attention_supported at load time).
void launch_deft_attention(const AttentionPlanView& device_plan, const PlanShape& shape,
                           const AttentionDims& dims, DType dtype, const void* q,
                           const void* k_cache, const void* v_cache, void* partial_out,
                           float* partial_lse, void* out, cudaStream_t stream,
                           DeftStage2 stage2 = DeftStage2::kIfMerging, int32_t stage2_batch = 0,
                           const WeightPrefetch& prefetch = {});

inline void launch_deft_attention(const DevicePlan& plan, const AttentionDims& dims, DType dtype,
                                  const void* q, const void* k_cache, const void* v_cache,
                                  const DeftAttentionBuffers& buffers, void* out,
                                  cudaStream_t stream, int32_t stage2_batch = 0) {
  launch_deft_attention(plan.view(), plan.shape(), dims, dtype, q, k_cache, v_cache,
                        buffers.partial_out(), buffers.partial_lse(), out, stream,
                        DeftStage2::kIfMerging, stage2_batch);
}

}  // namespace deft::kernels
