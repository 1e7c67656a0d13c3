// Plain structs shared by every tree-attention kernel and its CPU twin: the shapes of one
// attention layer and the step's plan as flat arrays. Nothing here knows about trees: the
// planner in engine/ produces an AttentionPlanView, kernels only execute it ("plan, then run").
#pragma once

#include <cstdint>

namespace deft::kernels {

// Shapes of one attention layer.
struct AttentionDims {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;  // GQA: num_q_heads is a multiple of num_kv_heads
  int32_t head_dim = 0;
  float softmax_scale = 0.0f;  // usually 1 / sqrt(head_dim)

  int32_t group_size() const { return num_q_heads / num_kv_heads; }
};

// One mask word holds the visibility of one KV token for up to 64 queries of a task.
inline constexpr int32_t kMaskWordBits = 64;

// The step's attention plan: a list of tasks, each (a run of KV tokens, a group of queries).
//
// Memory layouts the plan indexes into:
//   q, out:            [num_queries][num_q_heads][head_dim]
//   k_cache, v_cache:  [num_slots][num_kv_heads][head_dim]   (slot = page * page_tokens + offset)
//   partial_out:       [num_entries][num_q_heads][head_dim]  (the CUDA kernels: bf16 / fp16 as
//                      q; the CPU twin: fp32)
//   partial_lse:       [num_entries][num_q_heads]            (fp32, natural log)
//
// Task t reads the KV tokens at slots kv_slots[task_kv_begin[t] .. task_kv_end[t]) for the
// queries of its entries [task_entry_begin[t], task_entry_begin[t + 1]); entry e is query row
// entry_query[e]. Stage 1 writes one partial result (normalised O and its log-sum-exp) per
// entry. Stage 2 merges, for each query q, the partials of entries
// query_entries[query_entry_begin[q] .. query_entry_begin[q + 1]).
//
// Prefill runs (optional, num_prefill_runs may be 0): a run is `num_rows` consecutive new tokens
// of one node on the consecutive query rows [row_begin, row_begin + num_rows). Its keys are
// kv_slots[kv_begin .. kv_begin + prefix_tokens + num_rows): first everything the run's first
// token sees before itself (ancestors and earlier tokens of its node), then the run's own slots.
// Row i of the run sees keys [0, prefix_tokens + i] (causal among the run's tokens). A run's rows
// have no entries: launch_prefill_attention (kernels/prefill_attention.h) computes them, while
// the tasks compute every other row.
//
// Masks: task_mask_begin[t] == -1 means every entry of the task sees every token of its run.
// Otherwise the task has at most kMaskWordBits entries and mask_words[task_mask_begin[t] + i]
// is the visibility word of its i-th KV token: bit j set <=> entry task_entry_begin[t] + j sees it.
// Every entry of a task sees at least one token of that task's run.
struct PrefillRun {
  int32_t row_begin = 0;
  int32_t num_rows = 0;
  int32_t kv_begin = 0;
  int32_t prefix_tokens = 0;
};

// One CTA of the CUDA kernels' stage 1 (the grid's table is built by build_stage1_ctas,
// kernels/deft_schedule.h, and uploaded by kernels::DevicePlan, not by the planner): task `task`'s
// KV head `kv_head`, row slice `slice` of the task's `slices` (as many as its rows need, at most
// 32); the slice runs the task's row passes slice, slice + slices, ... Padding: task -1.
struct alignas(16) Stage1Cta {
  int32_t task = -1;
  int32_t kv_head = 0;
  int32_t slice = 0;
  int32_t slices = 1;
};

struct AttentionPlanView {
  int32_t num_queries = 0;
  int32_t num_tasks = 0;
  int32_t num_entries = 0;
  int32_t num_kv_indices = 0;  // length of kv_slots
  int32_t num_mask_words = 0;  // length of mask_words

  const int32_t* kv_slots = nullptr;          // [num_kv_indices]
  const int32_t* task_kv_begin = nullptr;     // [num_tasks]
  const int32_t* task_kv_end = nullptr;       // [num_tasks]
  const int32_t* task_entry_begin = nullptr;  // [num_tasks + 1]
  const int32_t* task_mask_begin = nullptr;   // [num_tasks], -1 = no mask
  // Optional (null: none): per task, how many leading tokens of its run hold KV from before the
  // step, i.e. slots that no query of the step writes. A kernel launched behind the step's KV
  // write (a programmatic dependent launch) may read those before that write has finished.
  const int32_t* task_kv_ready = nullptr;      // [num_tasks]
  const uint64_t* mask_words = nullptr;        // [num_mask_words]
  const int32_t* entry_query = nullptr;        // [num_entries]
  const int32_t* query_entry_begin = nullptr;  // [num_queries + 1]
  const int32_t* query_entries = nullptr;      // [num_entries]

  int32_t num_prefill_runs = 0;
  const PrefillRun* prefill_runs = nullptr;  // [num_prefill_runs]

  // The CUDA kernels' stage-1 grid, CTA by CTA, for layers of stage1_kv_heads KV heads
  // (kernels::DevicePlan fills them; null on the host).
  int32_t stage1_kv_heads = 0;
  int32_t num_stage1_ctas = 0;
  const Stage1Cta* stage1_ctas = nullptr;  // [num_stage1_ctas]
};

}  // namespace deft::kernels
