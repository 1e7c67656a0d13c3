// CUDA graphs of the CUDA runner's decode steps (models/llama_cuda.h): which steps replay a graph,
// the bucket of step shapes one graph serves, the bucket's padded plan, capture and replay, and
// the least-recently-used cache of graphs.
//
// A decode step is ~130 launches of mostly small kernels (32 layers x RMSNorm, QKV GEMM,
// bias + RoPE + KV write, attention stage 1/2, O GEMM, RMSNorm, gate/up GEMM, SiLU·mul, down
// GEMM): ~1 ms of a Llama-3-8B step on the H100 was launch-bound (bench/results/e2e_step-*).
// A graph replays the launches of one *bucket* of step shapes with fixed kernel parameters:
//   - query rows and logit rows rounded up to a row bucket (gemm_row_bucket: 1, 2, 4, 8, then
//     multiples of 8 up to 64, then 128 and 256: padding 20 rows to 32 cost ~170 µs of GEMM time
//     per Llama-3-8B step, bench/results/gemm_tune-h100-notes.md); padded rows
//     read token 0 at position 0, write their K/V into a spare slot past the pool (the runner's
//     sink slot) and see nothing in attention; padded logit rows repeat row 0 and sample greedily
//     (models/step_staging.h lays them out);
//   - the plan's task count rounded up to a bucket (task_bucket: < 12.5 % of empty tasks, which
//     stage 1's CTAs skip at once), stage 1's row slices (CTAs per task and KV head), whether
//     stage 1 runs every pass on warpgroup MMAs (kernels::deft_attention_wgmma_passes) and
//     whether stage 2 runs are part of the key; the plan is staged padded
//     (DevicePlan::stage_padded) in the graph's own buffers, sized by power-of-two capacities
//     that grow (and re-capture) when a step of the bucket needs more;
//   - the copy of the step's inputs with its plan (one pinned-to-device copy, the graph's first
//     node) and everything from the embedding through the LM head and the sampling kernel are
//     captured; the downloads of logits / tokens stay outside (async copies after the launch).
// The first step of a bucket runs the padded launches uncaptured (kernel loading, cuBLAS
// heuristics, attribute setup happen outside any capture), the second captures and replays.
// Padding changes the GEMMs' row counts, so a graph step's logits equal the eager step's within
// bf16 rounding (cuBLAS may pick another kernel for another M), and equal bit for bit the
// padded launches run uncaptured (tests/gpu/llama_cuda_graph_test.cc).
//
// Use, per step: fits_step_graph() -> StepGraphCache::entry(step_graph_key(...)) ->
// StepGraph::stage() -> (reserve buffers) -> StepGraph::bind_buffers() -> StepGraphCache::run().
// Every step of a graph must end with a stream synchronisation before the next is staged (the
// captured copy reads the staging buffer when the graph runs).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "kernels/attention_params.h"
#include "kernels/deft_attention.h"
#include "kernels/deft_schedule.h"
#include "kernels/dtype.h"
#include "models/llama_cuda.h"
#include "models/step_timer.h"

namespace deft::models {

// Steps of up to this many query rows and logit rows replay graphs.
inline constexpr int32_t kMaxGraphRows = 256;

// Whether a step of `rows` query rows and `logit_rows` logit rows (padded to their row buckets,
// which must fit the runner's `max_rows`) with or without prefill runs can replay a graph.
bool fits_step_graph(int32_t rows, int32_t logit_rows, int32_t max_rows, bool has_prefill_runs);

// The bucket of step shapes one graph serves: everything its captured launches depend on.
struct StepGraphKey {
  int32_t rows = 0, logit_rows = 0, tasks = 0, row_slices = 0;
  // Stage 2's batch (kernels::deft_attention_stage2_batch): which stage-2 kernel the graph
  // captured, chosen for the plan's most partials of a query; 0: the graph has no stage 2.
  int32_t stage2_batch = 0;
  // wgmma_passes: which stage-1 kernel the graph captured.
  bool sample = false, wgmma_passes = false;
  bool operator==(const StepGraphKey&) const = default;
};

// The bucket of a step on `plan` (host arrays) with `logit_rows` logit rows, sampling on the GPU
// or not, for attention of `dims` in `dtype` (`deft_kernels`: the DeFT kernels, else the generic
// one, whose graphs have no row slices, stage 2 or wgmma passes; `batch_invariant`: the runner's
// deterministic mode, kernels::PlanShape::batch_invariant).
StepGraphKey step_graph_key(const kernels::AttentionPlanView& plan, int32_t logit_rows, bool sample,
                            const kernels::AttentionDims& dims, kernels::DType dtype,
                            bool deft_kernels, bool batch_invariant = false);

// One bucket's graph, its padded plan, and the buffers its captured parameters point into.
struct StepGraph {
  StepGraphKey key;
  kernels::PlanCapacity capacity;
  kernels::DevicePlan plan;  // this bucket's padded plan
  cudaGraphExec_t exec = nullptr;
  bool seen = false;  // its first step ran the padded launches uncaptured
  // Buffers the step's launches use (bind_buffers), which a captured graph's parameters point
  // into (the plan's staging and device buffers: the graph's first node copies the one to the
  // other).
  const void* partial_out = nullptr;
  const void* workspace = nullptr;
  const void* plan_staging = nullptr;
  const void* plan_device = nullptr;
  size_t plan_bytes = 0;
  uint64_t last_used = 0;

  StepGraph() = default;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  ~StepGraph();
  void drop();

  // Lays `plan` (host arrays) and the step's `inputs` (DevicePlan's extra bytes) out padded to
  // the bucket in this graph's staging buffer; no CUDA call (the copy to the device is the
  // graph's first node, or run()'s before the uncaptured first step). A plan the capacity does
  // not hold grows it (dropping the captured graph).
  void stage(const kernels::AttentionPlanView& plan, const kernels::AttentionDims& dims,
             std::span<const unsigned char> inputs);
  // Records the buffers this step's launches use besides the plan's: the attention partials and
  // the sampling workspace. A graph captured on other buffers (these, or the plan's staging or
  // device buffer, or another staged size) is dropped.
  void bind_buffers(const void* partial_out, const void* workspace);
};

// The graphs of the buckets seen, at most max_graphs (the least recently used dropped first),
// and the counts reported as CudaGraphStats.
class StepGraphCache {
 public:
  void set_max_graphs(int32_t max_graphs) { max_graphs_ = max_graphs; }
  // The bucket's entry, made when new (evicting the least recently used once `stream` has
  // synchronised).
  StepGraph& entry(const StepGraphKey& key, cudaStream_t stream);
  // Drops every graph; the caller has synchronised the stream they run on.
  void clear();

  // Runs the step staged in `graph` on `stream`; `launch_step` launches its kernels (embedding
  // through the LM head and sampling). A bucket's first step copies the staged plan and runs
  // launch_step() uncaptured; the second captures `timer`'s start event (as the graph's first
  // node), the copy and launch_step(), and replays the graph; later steps replay it.
  void run(StepGraph& graph, cudaStream_t stream, StepTimer& timer,
           absl::FunctionRef<void()> launch_step);
  // A step launched one by one outside any graph.
  void count_eager_step() { ++stats_.eager_steps; }
  const CudaGraphStats& stats() const { return stats_; }

 private:
  int32_t max_graphs_ = 32;
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<StepGraph>> graphs_;
  CudaGraphStats stats_;
};

}  // namespace deft::models
