// The draft model of server-side speculative decoding (--draft-model): a small model of the
// target's tokenizer, with its own runner, KV pool and forest (the target's forest machinery:
// prefix reuse, a prefix cache, one plan per pass), run by the scheduler before each target step.
// The pass loop batches the draft work of every speculating request: pass l runs, for all of
// them together, what engine/speculation/speculator.h describes as their level l.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "engine/attention_planner.h"
#include "engine/forest.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/works/work.h"

namespace deft::engine {

struct DraftModelOptions {
  int32_t page_tokens = 16;
  int32_t kv_pages = 2048;         // the draft's own pool
  int32_t max_step_tokens = 2048;  // rows of one pass
  int32_t max_prefill_tokens = 0;  // of which prompt chunks (0: half)
  int64_t prefix_cache_pages = -1;
  PlannerOptions planner;
};

// What one step's draft passes did.
struct DraftStats {
  int32_t passes = 0;
  int64_t rows = 0;
  double seconds = 0;
};

class DraftModel {
 public:
  // `runner` must hold KV slots for kv_pages * page_tokens tokens (checked by the caller).
  DraftModel(DraftModelOptions options, ModelRunner& runner, const Tokenizer& tokenizer);

  Forest& forest() { return forest_; }
  const Forest& forest() const { return forest_; }
  const KvCacheManager& kv() const { return kv_; }
  const ModelInfo& info() const { return runner_.info(); }

  // One step's draft passes over `works` (Work::add_draft_rows / take_draft_rows), until a
  // pass has no rows. An error is the draft model's (the step fails with it).
  absl::Status run(std::span<Work* const> works, DraftStats* stats);

 private:
  DraftModelOptions options_;
  ModelRunner& runner_;
  KvCacheManager kv_;
  Forest forest_;
  AttentionPlanner planner_;
  Sampler sampler_;
  AttentionPlan plan_;
  StepContext step_;
  std::vector<float> logits_;
};

}  // namespace deft::engine
