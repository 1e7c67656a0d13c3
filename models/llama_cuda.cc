// The CUDA runner's forward pass and step (models/llama_cuda.h): launch_step() is the model, one
// layer loop from the embedding through the LM head and GPU sampling; run_step() checks a step,
// picks its CUDA graph bucket (models/step_graphs.h), stages its inputs with its plan
// (models/step_staging.h), launches or replays, and reads back logits or sampled tokens. Loading
// and the memory plan: llama_cuda_load.cc; the private state: llama_cuda_state.h.
#include "models/llama_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/deft_schedule.h"
#include "kernels/device_buffer.h"
#include "kernels/device_scope.h"
#include "kernels/llama_ops.h"
#include "kernels/prefill_attention.h"
#include "kernels/sampling.h"
#include "kernels/skinny_gemm.h"
#include "kernels/tree_attention_generic.h"
#include "models/llama_cuda_state.h"
#include "models/step_graphs.h"
#include "models/step_staging.h"
#include "models/step_timer.h"

namespace deft::models {

using kernels::DeviceBuffer;

void LlamaCudaRunner::State::launch_step(const ModelConfig& c, const StepLaunch& launch) {
  const int32_t rows = launch.rows;
  const int32_t logit_rows = launch.logit_rows;
  const int32_t hidden = c.hidden_size;
  const int32_t q_size = c.q_size();
  const int32_t qkv_width = q_size + 2 * c.kv_size();
  const int32_t intermediate = c.intermediate_size;
  const int32_t vocab = c.vocab_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int32_t* d_tokens = launch.inputs.tokens;
  const int32_t* d_positions = launch.inputs.positions;
  const int32_t* d_slots = launch.inputs.slots;
  const int32_t* d_logit_rows = launch.inputs.logit_rows;
  const kernels::DevicePlan& device_plan = *launch.plan;

  float* x = residual.as<float>();
  // Tensor parallel: the tokens arrive as rows of this rank's shard (others at its zero row), so
  // the sum over ranks is the embedding.
  kernels::launch_embedding(rows, hidden, dtype, d_tokens, embed.data(), x, stream);
  all_reduce_residual(x, rows, hidden);
  const kernels::QkvRopeDims qkv_dims{.num_tokens = rows,
                                      .num_q_heads = c.num_attention_heads,
                                      .num_kv_heads = c.num_key_value_heads,
                                      .head_dim = c.head_dim};
  const kernels::RmsNormDims norm_dims{.num_rows = rows, .width = hidden, .eps = eps};
  const size_t e = kernels::dtype_bytes(dtype);
  // The next GEMM's weights (out rows of in elements) for the small kernel before it to warm
  // L2: the first prefetch_bytes / out bytes of every row (whole 128-byte lines, at least one),
  // where each of the GEMM's CTAs starts reading.
  const auto prefetch = [&](const DeviceBuffer& weights, int64_t out, int64_t in) {
    if (prefetch_bytes == 0 || rows > kernels::kSkinnyGemmMaxRows) {
      return kernels::WeightPrefetch{};
    }
    const int64_t row_bytes = in * static_cast<int64_t>(e);
    const int64_t per_row = std::clamp<int64_t>(prefetch_bytes / out / 128 * 128, 128, row_bytes);
    return kernels::WeightPrefetch{.base = weights.data(),
                                   .rows = out,
                                   .row_bytes = row_bytes,
                                   .bytes_per_row = static_cast<int32_t>(per_row)};
  };
  // Activations read for the last time by a cuBLAS GEMM (the down projection's input, the
  // attention's output) or earlier (the QKV GEMM's output, Q): the RMSNorm after that GEMM drops
  // them from L2, so their write-back does not take DRAM time from the next GEMMs' weight
  // streams. Each is rewritten whole before it is read again.
  const kernels::L2Discard dead_after_mlp =
      kernels::L2Discard{}.add(act.data(), int64_t{rows} * intermediate * e);
  const kernels::L2Discard dead_after_attention =
      kernels::L2Discard{}
          .add(attn.data(), int64_t{rows} * q_size * e)
          .add(q.data(), int64_t{rows} * q_size * e)
          .add(qkv.data(), int64_t{rows} * qkv_width * e);
  kernels::PlanShape attention_shape = device_plan.shape();
  attention_shape.batch_invariant = batch_invariant;
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& layer = layers[l];
    kernels::launch_rms_norm(norm_dims, dtype, nullptr, x, nullptr, layer.input_norm.as<float>(),
                             normed.data(), stream, prefetch(layer.qkv, qkv_width, hidden),
                             l > 0 ? dead_after_mlp : kernels::L2Discard{});
    timer.mark(StepPhase::kOther);
    gemm(normed.data(), layer.qkv.data(), rows, hidden, qkv_width, qkv.data(), false, false);
    timer.mark(StepPhase::kGemm);
    kernels::launch_qkv_rope_write(qkv_dims, dtype, d_positions, d_slots, inv_freq.as<float>(),
                                   qkv.data(), layer.qkv_bias.as<float>(), q.data(),
                                   layer.k_cache.data(), layer.v_cache.data(), stream);
    timer.mark(StepPhase::kOther);
    if (skip_attention) {
      // set_attention_skipped (benchmarks): no attention; `attn` keeps what it holds.
    } else if (deft_kernels) {
      kernels::launch_deft_attention(
          device_plan.view(), attention_shape, dims, dtype, q.data(), layer.k_cache.data(),
          layer.v_cache.data(), partials.partial_out(), partials.partial_lse(), attn.data(), stream,
          launch.stage2, launch.stage2_batch, prefetch(layer.o_proj, hidden, q_size));
      // Rows of the plan's prefill runs (no DeFT entries): the tiled causal kernel (never in a
      // graph step: those have no prefill runs).
      kernels::launch_prefill_attention(device_plan.view(), device_plan.prefill_runs(), dims, dtype,
                                        q.data(), layer.k_cache.data(), layer.v_cache.data(),
                                        prefill_scratch, attn.data(), stream);
    } else {  // the generic kernel runs the plan's tasks and prefill runs
      kernels::launch_tree_attention_generic(device_plan.view(), dims, dtype, q.data(),
                                             layer.k_cache.data(), layer.v_cache.data(),
                                             attn.data(), stream);
    }
    timer.mark(StepPhase::kAttention);
    gemm(attn.data(), layer.o_proj.data(), rows, q_size, hidden, x, true, accumulates_residual());
    timer.mark(StepPhase::kGemm);
    all_reduce_residual(x, rows, hidden);
    timer.mark(StepPhase::kCopy);
    // The O projection's bias (Llama with attention_bias) is folded into the residual here.
    kernels::launch_rms_norm(norm_dims, dtype, nullptr, x, layer.o_bias.as<float>(),
                             layer.post_norm.as<float>(), normed.data(), stream,
                             prefetch(layer.gate_up, 2 * int64_t{intermediate}, hidden),
                             dead_after_attention);
    timer.mark(StepPhase::kOther);
    if (batch_invariant || on_skinny({.rows = rows, .in = hidden, .out = 2 * intermediate},
                                     normed.data(), layer.gate_up.data(), false)) {
      // gate/up on the skinny GEMM: SiLU·mul in its epilogue, no gate/up round trip.
      gemm_swiglu(normed.data(), layer.gate_up.data(), rows, hidden, intermediate, act.data());
      timer.mark(StepPhase::kGemm);
    } else {
      gemm(normed.data(), layer.gate_up.data(), rows, hidden, 2 * intermediate, gate_up.data(),
           false, false);
      timer.mark(StepPhase::kGemm);
      kernels::launch_silu_mul(rows, intermediate, dtype, gate_up.data(), act.data(), stream,
                               prefetch(layer.down, hidden, intermediate));
      timer.mark(StepPhase::kOther);
    }
    gemm(act.data(), layer.down.data(), rows, intermediate, hidden, x, true,
         accumulates_residual());
    timer.mark(StepPhase::kGemm);
    all_reduce_residual(x, rows, hidden);
    timer.mark(StepPhase::kCopy);
  }
  if (logit_rows == 0) return;

  // Final norm of the logit rows only (gathered), then the LM head in chunks of rows.
  kernels::launch_rms_norm({.num_rows = logit_rows, .width = hidden, .eps = eps}, dtype,
                           d_logit_rows, x, nullptr, norm.as<float>(), normed.data(), stream, {},
                           layers.empty() ? kernels::L2Discard{} : dead_after_mlp);
  timer.mark(StepPhase::kOther);
  const void* head = c.tie_word_embeddings ? embed.data() : lm_head.data();
  const size_t row_bytes = kernels::dtype_bytes(dtype) * hidden;
  DEFT_CHECK(!launch.logits_out.empty() || launch.sample || logit_rows <= kLogitRowsPerChunk ||
                 tp.rank > 0,
             "llama_cuda: %d logit rows need a destination per chunk", logit_rows);
  for (int32_t begin = 0; begin < logit_rows; begin += kLogitRowsPerChunk) {
    const int32_t count = std::min(kLogitRowsPerChunk, logit_rows - begin);
    const void* head_x = static_cast<const char*>(normed.data()) + row_bytes * begin;
    if (tp.ranks == 1) {
      gemm(head_x, head, count, hidden, vocab, logits.data(), true, false, /*lm_head=*/true);
      timer.mark(StepPhase::kGemm);
    } else {
      // This rank's vocabulary rows, all-gathered; rank 0 lays them out [count][vocab] (the last
      // shard's padding dropped) and carries on alone: sampling and copies are rank 0's.
      gemm(head_x, head, count, hidden, vocab_part.rows, logits_shard.data(), true, false,
           /*lm_head=*/true);
      timer.mark(StepPhase::kGemm);
      const size_t shard_floats = static_cast<size_t>(count) * vocab_part.rows;
      DEFT_NCCL_CHECK(ncclAllGather(logits_shard.data(), logits_gathered.data(), shard_floats,
                                    ncclFloat32, comm, stream));
      if (tp.rank > 0) {
        timer.mark(StepPhase::kCopy);
        continue;
      }
      for (int32_t r = 0; r < tp.ranks; ++r) {
        const VocabShard part = vocab_shard(vocab, {.rank = r, .ranks = tp.ranks});
        if (part.count == 0) continue;
        DEFT_CUDA_CHECK(cudaMemcpy2DAsync(
            logits.as<float>() + part.begin, sizeof(float) * vocab,
            logits_gathered.as<float>() + r * shard_floats, sizeof(float) * vocab_part.rows,
            sizeof(float) * part.count, count, cudaMemcpyDeviceToDevice, stream));
      }
      timer.mark(StepPhase::kCopy);
    }
    if (launch.sample) {
      kernels::launch_sample_rows({.num_rows = count, .vocab_size = vocab, .row_stride = vocab},
                                  logits.as<float>(), launch.inputs.sampling_params + begin,
                                  sampling_workspace.as<float>(),
                                  sampled.as<kernels::SampledRow>() + begin,
                                  sampled_top.as<kernels::SampledTop>() +
                                      static_cast<size_t>(begin) * kernels::kSamplingMaxTopLogprobs,
                                  stream, /*drop_logits=*/true, batch_invariant);
      timer.mark(StepPhase::kSampling);
      // The chunk's rows that want their logits (sampling read them and left them intact).
      for (size_t k = 0; k < launch.kept_rows.size(); ++k) {
        const int32_t row = launch.kept_rows[k];
        if (row < begin || row >= begin + count) continue;
        DEFT_CUDA_CHECK(
            cudaMemcpyAsync(launch.kept_out + k * static_cast<size_t>(vocab),
                            logits.as<float>() + static_cast<size_t>(row - begin) * vocab,
                            sizeof(float) * vocab, cudaMemcpyDeviceToHost, stream));
      }
      if (!launch.kept_rows.empty()) timer.mark(StepPhase::kCopy);
    } else if (!launch.logits_out.empty()) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(launch.logits_out.data() + static_cast<size_t>(begin) * vocab,
                                      logits.data(), sizeof(float) * count * vocab,
                                      cudaMemcpyDeviceToHost, stream));
      timer.mark(StepPhase::kCopy);
    }
  }
}

namespace {

// Index of the first slot outside [0, limit), or -1. Runs on every step before any launch (a
// speculative step's plan holds ~6000 slots), so the common case is one pass of unsigned
// compares in blocks of 8 (a negative slot compares as >= 2^31), which -O2 vectorises with
// baseline SSE2: ~0.6 µs for 6064 slots, where a min / max pass takes ~10x longer (SSE2 has no
// int32 min or max). Only a plan that fails it is searched again for the slot to name.
int64_t first_slot_outside(std::span<const int32_t> slots, int32_t limit) {
  const auto bound = static_cast<uint32_t>(std::max(limit, 0));
  constexpr size_t kBlock = 8;
  uint32_t outside[kBlock] = {};
  size_t i = 0;
  for (; i + kBlock <= slots.size(); i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) {
      outside[k] |= static_cast<uint32_t>(slots[i + k]) >= bound;
    }
  }
  uint32_t any = 0;
  for (; i < slots.size(); ++i) any |= static_cast<uint32_t>(slots[i]) >= bound;
  for (uint32_t o : outside) any |= o;
  if (any == 0) return -1;
  for (size_t j = 0; j < slots.size(); ++j) {
    if (static_cast<uint32_t>(slots[j]) >= bound) return static_cast<int64_t>(j);
  }
  return -1;
}

// A step the kernels can trust: the plan's rows match the batch's, tokens are in the vocabulary,
// written slots and read KV slots in the pool, logit rows among the query rows, prefill runs
// inside the plan, and (forward()) `logits_size` fits the logit rows.
absl::Status check_step(const engine::StepBatch& batch, size_t logits_size, bool sample,
                        bool writes_logits, int32_t vocab, int32_t max_rows, int64_t num_kv_slots) {
  if (batch.plan == nullptr) return absl::InvalidArgumentError("llama_cuda: step without a plan");
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  if (static_cast<int64_t>(batch.tokens.size()) != rows ||
      static_cast<int64_t>(plan.query_position.size()) != rows ||
      static_cast<int64_t>(plan.query_slot.size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: the plan has ", rows, " query rows but the step carries ",
                     batch.tokens.size(), " tokens, ", plan.query_position.size(),
                     " positions and ", plan.query_slot.size(), " slots"));
  }
  if (rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: the step has ", rows, " query rows, more than max_batch_rows ", max_rows));
  }
  for (int32_t r = 0; r < rows; ++r) {
    if (batch.tokens[r] < 0 || batch.tokens[r] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " has token ",
                                                     batch.tokens[r],
                                                     ", outside the vocabulary [0, ", vocab, ")"));
    }
    if (plan.query_slot[r] < 0 || plan.query_slot[r] >= num_kv_slots) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " writes KV slot ",
                                                     plan.query_slot[r], ", outside [0, ",
                                                     num_kv_slots, ")"));
    }
    if (plan.query_position[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("llama_cuda: row ", r, " has position ", plan.query_position[r]));
    }
  }
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  if (logit_rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: ", logit_rows, " logit rows, more than max_batch_rows ", max_rows));
  }
  for (int32_t i = 0; i < logit_rows; ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= rows) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: logit row ", i, " is ",
                                                     batch.logit_rows[i], ", outside the ", rows,
                                                     " query rows"));
    }
  }
  // (forward_sampled() checked its `logits` against the rows that want theirs.)
  // (A tensor-parallel rank after the first writes none: rank 0 assembles the logits.)
  const size_t logits_expected = writes_logits ? static_cast<size_t>(logit_rows) * vocab : 0;
  if (!sample && logits_size != logits_expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: logits hold ", logits_size, " floats, expected ",
                     writes_logits ? logit_rows : 0, " rows x ", vocab));
  }
  // The kernels trust the plan; a slot outside the pool would read out of bounds.
  if (const int64_t at = first_slot_outside(plan.kv_slots, num_kv_slots); at >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("llama_cuda: the plan reads KV slot ",
                                                   plan.kv_slots[at], " (index ", at,
                                                   "), outside [0, ", num_kv_slots, ")"));
  }
  for (const kernels::PrefillRun& run : plan.prefill_runs) {
    if (run.num_rows <= 0 || run.row_begin < 0 || run.row_begin + run.num_rows > rows ||
        run.prefix_tokens < 0 || run.kv_begin < 0 ||
        int64_t{run.kv_begin} + run.prefix_tokens + run.num_rows >
            static_cast<int64_t>(plan.kv_slots.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "llama_cuda: prefill run (rows ", run.row_begin, " + ", run.num_rows, ", keys ",
          run.kv_begin, " + ", run.prefix_tokens, " + ", run.num_rows, ") outside the plan's ",
          rows, " rows and ", plan.kv_slots.size(), " KV indices"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

size_t LlamaCudaRunner::weight_bytes() const { return state_->weight_bytes; }
size_t LlamaCudaRunner::activation_bytes() const { return state_->activation_bytes; }
size_t LlamaCudaRunner::kv_cache_bytes() const { return state_->kv_bytes; }
bool LlamaCudaRunner::uses_deft_kernels() const { return state_->deft_kernels; }
void LlamaCudaRunner::set_step_timing(StepTiming timing) { state_->timer.set_mode(timing); }
void LlamaCudaRunner::set_gemm_tuning(bool on) {
  const kernels::DeviceScope on_device(state_->device);
  // Captured step graphs hold the other GEMM kernels.
  if (state_->gemms->enabled() != on) state_->drop_graphs();
  state_->gemms->set_enabled(on);
}
void LlamaCudaRunner::set_skinny_gemm(SkinnyGemmUse use) {
  const kernels::DeviceScope on_device(state_->device);
  // Captured step graphs hold the other GEMM kernels.
  if (state_->skinny_gemm != use) state_->drop_graphs();
  state_->skinny_gemm = use;
  // Before any graph capture on the runner's stream.
  if (use != SkinnyGemmUse::kOff) kernels::skinny_gemm_reserve(state_->stream);
}
int64_t LlamaCudaRunner::weight_prefetch() const { return state_->prefetch_bytes; }
void LlamaCudaRunner::set_weight_prefetch(int64_t bytes_per_gemm) {
  DEFT_CHECK(bytes_per_gemm >= 0, "set_weight_prefetch: %lld bytes",
             static_cast<long long>(bytes_per_gemm));
  // Captured step graphs hold the kernels' arguments.
  const kernels::DeviceScope on_device(state_->device);
  if (state_->prefetch_bytes != bytes_per_gemm) state_->drop_graphs();
  state_->prefetch_bytes = bytes_per_gemm;
}
void LlamaCudaRunner::time_attention(bool on) {
  state_->timer.set_mode(on ? StepTiming::kPhases : StepTiming::kOff);
}
double LlamaCudaRunner::last_attention_seconds() const {
  const StepTimer& timer = state_->timer;
  return timer.times().valid && timer.mode() == StepTiming::kPhases
             ? timer.times().attention_ms * 1e-3
             : -1.0;
}
const StepTimes& LlamaCudaRunner::last_step_times() const { return state_->timer.times(); }
void LlamaCudaRunner::set_cuda_graphs(bool on) {
  const kernels::DeviceScope on_device(state_->device);
  state_->use_graphs = on;
  if (!on) state_->drop_graphs();
}
void LlamaCudaRunner::set_attention_skipped(bool skip) {
  const kernels::DeviceScope on_device(state_->device);
  if (state_->skip_attention == skip) return;
  state_->drop_graphs();  // captured steps hold the attention launches (or not)
  state_->skip_attention = skip;
  if (skip) {
    DEFT_CUDA_CHECK(cudaMemsetAsync(state_->attn.data(), 0, state_->attn.bytes(), state_->stream));
  }
}
const CudaGraphStats& LlamaCudaRunner::cuda_graph_stats() const { return state_->graphs.stats(); }

engine::AttentionWave LlamaCudaRunner::attention_wave() const {
  const State& s = *state_;
  if (!s.deft_kernels) return {};
  const kernels::DeviceScope on_device(s.device);
  return {.ctas = kernels::deft_attention_resident_ctas(s.dims, s.dtype),
          .kv_heads = s.dims.num_kv_heads,
          .group_size = s.dims.group_size()};
}

std::span<float> LlamaCudaRunner::logits_buffer(size_t floats) {
  kernels::PinnedHostBuffer& buffer = state_->logits_host;
  if (buffer.bytes() < floats * sizeof(float)) {
    // Doubling: cudaMallocHost is slow (milliseconds for a few hundred MB), so a growing load
    // reallocates a few times, not every step.
    buffer.reserve(std::max(floats * sizeof(float), 2 * buffer.bytes()));
  }
  return {buffer.as<float>(), floats};
}

absl::Status LlamaCudaRunner::forward(const engine::StepBatch& batch, std::span<float> logits) {
  return run_step(batch, logits, {}, {});
}

absl::Status LlamaCudaRunner::forward_sampled(const engine::StepBatch& batch,
                                              std::span<const engine::RowSampling> rows,
                                              std::span<engine::SampledToken> out,
                                              std::span<float> logits) {
  if (absl::Status status =
          engine::check_row_sampling(batch, rows, out, logits.size(), config_.vocab_size);
      !status.ok()) {
    return status;
  }
  return run_step(batch, logits, rows, out);
}

absl::Status LlamaCudaRunner::run_step(const engine::StepBatch& batch, std::span<float> logits,
                                       std::span<const engine::RowSampling> sampling,
                                       std::span<engine::SampledToken> sampled) {
  const kernels::DeviceScope on_device(state_->device);
  const bool sample = !sampling.empty();
  const int32_t vocab = config_.vocab_size;
  State& s = *state_;
  if (absl::Status status =
          check_step(batch, logits.size(), sample, /*writes_logits=*/s.tp.rank == 0, vocab,
                     s.max_rows, info_.num_kv_slots);
      !status.ok()) {
    return status;
  }
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  s.timer.clear_times();
  if (rows == 0) return absl::OkStatus();

  // Graph steps: decode-sized, no per-launch events (kPhases runs eagerly).
  const bool graph_step = s.use_graphs && s.timer.mode() != StepTiming::kPhases &&
                          fits_step_graph(rows, logit_rows, s.max_rows, !plan.prefill_runs.empty());
  StepGraph* graph = nullptr;
  int32_t launch_rows = rows, launch_logit_rows = logit_rows;
  if (graph_step) {
    graph = &s.graphs.entry(step_graph_key(plan.view(), logit_rows, sample, s.dims, s.dtype,
                                           s.deft_kernels, s.batch_invariant),
                            s.stream);
    launch_rows = graph->key.rows;
    launch_logit_rows = graph->key.logit_rows;
  }
  // forward_sampled(): the logit rows that want their logits rather than a token.
  std::vector<int32_t>& kept_rows = s.kept_rows;
  kept_rows.clear();
  for (int32_t i = 0; i < static_cast<int32_t>(sampling.size()); ++i) {
    if (sampling[i].params == nullptr) kept_rows.push_back(i);
  }
  StepSamplingNeeds needs;
  if (sample) {
    needs = s.inputs.stage_sampling(sampling, launch_rows, launch_logit_rows);
    const size_t workspace_bytes =
        kernels::sampling_workspace_bytes(std::min(kLogitRowsPerChunk, logit_rows), vocab);
    if (needs.any_draw && s.sampling_workspace.bytes() < workspace_bytes) {
      s.sampling_workspace.reset(kernels::sampling_workspace_bytes(kLogitRowsPerChunk, vocab));
    }
  }

  // A bucket's steps after its first start their timing inside the graph.
  if (graph != nullptr && graph->seen) {
    s.timer.mark_started_in_graph();
  } else {
    s.timer.mark_start();
  }
  // The step's inputs, uploaded with the plan in one copy.
  const std::span<const unsigned char> inputs =
      s.inputs.stage_rows(batch, launch_rows, launch_logit_rows, s.sink_slot, sample);
  if (s.tp.ranks > 1) {
    s.inputs.map_tokens_to_shard(launch_rows, s.vocab_part.begin, s.vocab_part.count,
                                 /*outside=*/s.vocab_part.rows);
  }
  State::StepLaunch launch{.rows = launch_rows,
                           .logit_rows = launch_logit_rows,
                           .plan = &s.plan,
                           .stage2 = kernels::DeftStage2::kIfMerging,
                           .sample = sample};
  if (graph != nullptr) {
    const kernels::AttentionPlanView view = plan.view();
    graph->stage(view, s.dims, inputs);
    // Partials for a power-of-two entry count, so they are reallocated (and graphs recaptured)
    // rarely.
    if (s.deft_kernels) s.partials.reserve(kernels::pow2_bucket(view.num_entries), s.dims);
    graph->bind_buffers(s.partials.partial_out(), s.sampling_workspace.data());
    launch.plan = &graph->plan;
    launch.stage2 =
        graph->key.stage2_batch > 0 ? kernels::DeftStage2::kAlways : kernels::DeftStage2::kNever;
    launch.stage2_batch = graph->key.stage2_batch;
  } else {
    s.plan.upload(plan.view(), s.dims, s.stream, inputs);
    if (s.deft_kernels) s.partials.reserve(plan.num_entries(), s.dims);
    launch.logits_out = sample ? std::span<float>() : logits;
    if (sample) {  // the kept rows leave each LM-head chunk as it is computed
      launch.kept_rows = kept_rows;
      launch.kept_out = logits.data();
    }
  }
  launch.inputs = step_inputs_view(launch.plan->extra(), launch_rows, launch_logit_rows);
  s.timer.mark(StepPhase::kCopy);

  if (graph == nullptr) {
    s.launch_step(config_, launch);
    s.graphs.count_eager_step();
  } else {
    s.graphs.run(*graph, s.stream, s.timer, [&] { s.launch_step(config_, launch); });
  }

  if (logit_rows > 0 && s.tp.rank == 0) {
    if (!sample && launch.logits_out.empty()) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(logits.data(), s.logits.data(),
                                      sizeof(float) * static_cast<size_t>(logit_rows) * vocab,
                                      cudaMemcpyDeviceToHost, s.stream));
      s.timer.mark(StepPhase::kCopy);
    }
    if (sample && graph != nullptr) {
      // A graph step's kept rows, from the LM head's buffer (a graph step is one chunk).
      for (size_t k = 0; k < kept_rows.size(); ++k) {
        DEFT_CUDA_CHECK(
            cudaMemcpyAsync(logits.data() + k * vocab,
                            s.logits.as<float>() + static_cast<size_t>(kept_rows[k]) * vocab,
                            sizeof(float) * vocab, cudaMemcpyDeviceToHost, s.stream));
      }
    }
    if (sample) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(s.sampled_host.data(), s.sampled.data(),
                                      sizeof(kernels::SampledRow) * logit_rows,
                                      cudaMemcpyDeviceToHost, s.stream));
      if (needs.any_top_logprobs) {
        DEFT_CUDA_CHECK(cudaMemcpyAsync(
            s.sampled_top_host.data(), s.sampled_top.data(),
            sizeof(kernels::SampledTop) * kernels::kSamplingMaxTopLogprobs * logit_rows,
            cudaMemcpyDeviceToHost, s.stream));
      }
      s.timer.mark(StepPhase::kCopy);
    }
  }
  s.timer.mark_end(StepPhase::kCopy);
  DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.timer.collect_times();
  if (sample) {
    const auto* rows_out = s.sampled_host.as<kernels::SampledRow>();
    const auto* tops = s.sampled_top_host.as<kernels::SampledTop>();
    for (int32_t i = 0; i < logit_rows; ++i) {
      if (sampling[i].params == nullptr) continue;  // its logits went to the host
      const kernels::SampledRow& row = rows_out[i];
      if (row.status != kernels::kSampledOk) {
        return absl::InternalError(
            absl::StrCat("llama_cuda: logit row ", i, " (query row ", batch.logit_rows[i], "): ",
                         row.status == kernels::kSampledNonFiniteLogit
                             ? absl::StrCat("sampling: logit of token ", row.error_token, " is ",
                                            row.error_logit)
                             : std::string("sampling: every logit of the row is -inf")));
      }
      const engine::SamplingParams& p = *sampling[i].params;
      engine::SampledToken& token = sampled[i];
      token.token = row.token;
      token.logprob = row.logprob;
      token.stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), row.token) !=
                   p.stop_token_ids.end();
      token.top_logprobs.clear();
      const kernels::SampledTop* top =
          tops + static_cast<size_t>(i) * kernels::kSamplingMaxTopLogprobs;
      for (int32_t j = 0; j < row.num_top; ++j) {
        token.top_logprobs.push_back({top[j].token, top[j].logprob});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace deft::models
