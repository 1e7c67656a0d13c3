#include "models/step_graphs.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "models/gemm_tuner.h"
#include "spdlog/spdlog.h"

namespace deft::models {

using kernels::pow2_bucket;
using kernels::task_bucket;

bool fits_step_graph(int32_t rows, int32_t logit_rows, int32_t max_rows, bool has_prefill_runs) {
  return rows <= kMaxGraphRows && gemm_row_bucket(rows) <= max_rows &&
         logit_rows <= kMaxGraphRows && gemm_row_bucket(logit_rows) <= max_rows &&
         !has_prefill_runs;
}

StepGraphKey step_graph_key(const kernels::AttentionPlanView& plan, int32_t logit_rows, bool sample,
                            const kernels::AttentionDims& dims, kernels::DType dtype,
                            bool deft_kernels, bool batch_invariant) {
  const int32_t rows = plan.num_queries;
  kernels::PlanShape shape = kernels::plan_shape(plan);
  shape.batch_invariant = batch_invariant;
  const bool stage2 = deft_kernels && plan.num_entries > rows;
  return {.rows = gemm_row_bucket(rows),
          .logit_rows = gemm_row_bucket(logit_rows),
          .tasks = task_bucket(plan.num_tasks),
          .row_slices =
              deft_kernels ? kernels::deft_attention_row_slices(shape.max_task_entries, dims) : 0,
          .stage2_batch = stage2 ? kernels::deft_attention_stage2_batch(
                                       shape, gemm_row_bucket(rows), dims, dtype)
                                 : 0,
          .sample = sample,
          .wgmma_passes = deft_kernels && kernels::deft_attention_wgmma_passes(shape, dims)};
}

StepGraph::~StepGraph() {
  if (exec != nullptr) cudaGraphExecDestroy(exec);
}

void StepGraph::drop() {
  if (exec != nullptr) DEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
  exec = nullptr;
}

void StepGraph::stage(const kernels::AttentionPlanView& view, const kernels::AttentionDims& dims,
                      std::span<const unsigned char> inputs) {
  // Capacities grow to powers of two with 2x headroom (the captured graph, which holds the old
  // buffer's pointers, is dropped then).
  if (!capacity.holds(view) || capacity.queries != key.rows || capacity.tasks != key.tasks) {
    capacity = {.queries = key.rows,
                .tasks = key.tasks,
                // 2x headroom: a growing tree recaptures after growing 2-4x, not each doubling.
                .entries = std::max(capacity.entries, pow2_bucket(2 * view.num_entries)),
                .kv_indices = std::max(capacity.kv_indices, pow2_bucket(2 * view.num_kv_indices)),
                .mask_words = std::max(capacity.mask_words, pow2_bucket(2 * view.num_mask_words)),
                // Every task at the widest task's row slices, a CTA per KV head each (none
                // without the DeFT kernels).
                .stage1_ctas = key.tasks * key.row_slices * dims.num_kv_heads};
    drop();
  }
  // Staged only: the copy to the device is a node of the graph (no CUDA call before the
  // launch; the previous step's copy is done, as every step ends with a stream
  // synchronisation).
  plan.stage_padded(view, dims, capacity, inputs);
}

void StepGraph::bind_buffers(const void* partials, const void* sampling_workspace) {
  if (exec != nullptr && (partial_out != partials || workspace != sampling_workspace ||
                          plan_staging != plan.staging() || plan_device != plan.extra() ||
                          plan_bytes != plan.staged_bytes())) {
    drop();
  }
  partial_out = partials;
  workspace = sampling_workspace;
  plan_staging = plan.staging();
  plan_device = plan.extra();
  plan_bytes = plan.staged_bytes();
}

StepGraph& StepGraphCache::entry(const StepGraphKey& key, cudaStream_t stream) {
  ++clock_;
  for (const std::unique_ptr<StepGraph>& graph : graphs_) {
    if (graph->key == key) {
      graph->last_used = clock_;
      return *graph;
    }
  }
  if (static_cast<int32_t>(graphs_.size()) >= std::max(max_graphs_, 1)) {
    const auto oldest =
        std::min_element(graphs_.begin(), graphs_.end(),
                         [](const auto& a, const auto& b) { return a->last_used < b->last_used; });
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    graphs_.erase(oldest);
  }
  graphs_.push_back(std::make_unique<StepGraph>());
  graphs_.back()->key = key;
  graphs_.back()->last_used = clock_;
  stats_.cached_graphs = static_cast<int32_t>(graphs_.size());
  return *graphs_.back();
}

void StepGraphCache::clear() {
  graphs_.clear();
  stats_.cached_graphs = 0;
}

void StepGraphCache::run(StepGraph& graph, cudaStream_t stream, StepTimer& timer,
                         absl::FunctionRef<void()> launch_step) {
  if (graph.exec == nullptr && !graph.seen) {
    graph.seen = true;
    graph.plan.enqueue_copy(stream);
    launch_step();
    ++stats_.eager_steps;
    return;
  }
  if (graph.exec == nullptr) {
    const auto capture_start = std::chrono::steady_clock::now();
    cudaGraph_t captured = nullptr;
    DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    // External: a record node of its own (a plain record in a capture only orders streams).
    DEFT_CUDA_CHECK(cudaEventRecordWithFlags(timer.start_event(), stream, cudaEventRecordExternal));
    graph.plan.enqueue_copy(stream);
    launch_step();
    DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
    DEFT_CUDA_CHECK(cudaGraphInstantiate(&graph.exec, captured, 0));
    DEFT_CUDA_CHECK(cudaGraphDestroy(captured));
    ++stats_.captures;
    stats_.capture_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - capture_start)
            .count();
    const StepGraphKey& key = graph.key;
    spdlog::debug(
        "llama_cuda: captured the graph of {} rows, {} logit rows, {} tasks, {} row slices{}{}{}",
        key.rows, key.logit_rows, key.tasks, key.row_slices,
        key.stage2_batch > 0 ? absl::StrCat(", stage 2 (batch ", key.stage2_batch, ")")
                             : std::string(),
        key.sample ? ", sampling" : "", key.wgmma_passes ? ", wgmma passes" : "");
  }
  DEFT_CUDA_CHECK(cudaGraphLaunch(graph.exec, stream));
  ++stats_.graph_steps;
}

}  // namespace deft::models
