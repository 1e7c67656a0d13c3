// The interface the engine drives a model through: one forward pass per engine step. The
// engine decides what to compute (the step's AttentionPlan, the token of every query row, which
// rows need logits); a backend (models/llama_cpu.h, models/llama_cuda.h) executes it.
// Nothing here knows about a device, a weight format or a model family.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "engine/attention_planner.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

// What one step computes. Query row r of the plan is one new token: its id is tokens[r], its
// RoPE position plan->query_position[r] (its depth in its tree), and its K/V go to KV slot
// plan->query_slot[r] before attention runs, so rows of one step may attend to each other
// (prefill runs, token trees). The same plan serves every layer.
struct StepBatch {
  const AttentionPlan* plan = nullptr;
  std::span<const TokenId> tokens;  // [plan->num_queries]
  // Query rows whose next-token logits are wanted, in the order their logits are written;
  // usually ascending (e.g. the last row of a prefill run, every row of a decode step).
  std::span<const int32_t> logit_rows;
};

// How to sample one logit row: the branch's params and the draw's step (engine::Sampler::sample).
struct RowSampling {
  const SamplingParams* params = nullptr;
  uint64_t step = 0;
};

// Static facts of a loaded model the engine plans with.
struct ModelInfo {
  std::string name;        // e.g. the checkpoint directory
  std::string family;      // "llama", "mistral", "qwen2"
  int32_t vocab_size = 0;  // width of one logits row
  int32_t num_layers = 0;
  int64_t max_position = 0;   // largest RoPE position + 1 the model was configured for
  int64_t num_kv_slots = 0;   // KV slots the runner holds (must cover the KvCacheManager's)
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const ModelInfo& info() const = 0;
  int32_t vocab_size() const { return info().vocab_size; }

  // Runs the step: writes the K/V of every query row into its slot in every layer, attends
  // through the plan, and writes logits [batch.logit_rows.size()][vocab_size()] into `logits`
  // (row-major, fp32). INVALID_ARGUMENT (naming the row and value) for a token outside the
  // vocabulary, a slot outside the cache, a negative position, a logit row outside the plan,
  // or a `logits` span of the wrong size; the KV cache is then untouched.
  virtual absl::Status forward(const StepBatch& batch, std::span<float> logits) = 0;

  // forward() then one sampled token per logit row that has params (rows[i] for
  // batch.logit_rows[i]; out[i] gets its token); a row whose params are null wants its logits
  // instead: those rows' logits go to `logits`, [rows without params][vocab_size()] in row order
  // (out[i] untouched). A backend that samples on its device overrides it so only tokens and the
  // wanted rows come back. The default runs forward() into a host buffer and engine::Sampler on
  // each row. INVALID_ARGUMENT for `rows` or `out` not one per logit row, `logits` not one row
  // per row without params, or bad params (validate_sampling_params), before anything runs;
  // INTERNAL for a row with a NaN / +inf logit or no finite logit (the KV cache then holds the
  // step's K/V).
  virtual absl::Status forward_sampled(const StepBatch& batch, std::span<const RowSampling> rows,
                                       std::span<SampledToken> out, std::span<float> logits = {});
  // True when forward_sampled() samples on the device: the engine then uses it for every step
  // with a row that just needs a token.
  virtual bool samples_on_device() const { return false; }

  // Where the engine should have forward() / forward_sampled() write `floats` floats of logits:
  // a host buffer the backend copies into fastest (a GPU backend's pinned memory: a pageable
  // destination costs the copy half its speed or more), valid until the next call. Empty (the
  // default): the engine passes a buffer of its own.
  virtual std::span<float> logits_buffer(size_t floats) {
    (void)floats;
    return {};
  }

  // Attention time of the last step in seconds (all layers), or < 0 when it was not timed.
  // time_attention(true) asks the next steps to time it (a backend may charge a little for
  // that: the server samples it now and then for its attention-share metric).
  virtual void time_attention(bool on) { (void)on; }
  virtual double last_attention_seconds() const { return -1.0; }

  // The attention launch a step's plan runs on, for the planner's chunk size
  // (PlannerOptions::wave): zero CTAs where the backend has no such launch (the CPU).
  virtual AttentionWave attention_wave() const { return {}; }
};

// The argument checks of forward_sampled (for backends that override it): sizes (`logits_size`
// floats for the rows without params), params valid for `vocab_size`. INVALID_ARGUMENT naming
// the row.
absl::Status check_row_sampling(const StepBatch& batch, std::span<const RowSampling> rows,
                                std::span<const SampledToken> out, size_t logits_size,
                                int32_t vocab_size);

}  // namespace deft::engine
