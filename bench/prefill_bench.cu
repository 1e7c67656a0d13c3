// Prefill and extend steps of a Llama-3-8B-shaped model with random bf16 weights (32 layers,
// hidden 4096, 32/8 heads, head_dim 128; models/llama_cuda.h), old path against new in the same
// run:
//   prefill_p4000:      a 4000-token prompt as one step (4000 query rows, causal);
//   extend_p4000_e300:  a 4000-token prefix (prefilled, untimed), then a 300-token extension of a
//                       branch under it as one step (300 rows, full view of the prefix).
// Methods: deft_flatten = the planner's DeFT-Flatten plan (a run becomes query groups with bit
// masks, <= 64 queries per masked group); prefill_tiled = the same planner with
// min_prefill_run = 64, so the run is one PrefillRun executed by kernels/prefill_attention.h.
// Each method: warm-up steps, then kReps steps with StepTiming::kTotal (step GPU time, CUDA
// events) and kReps with StepTiming::kPhases (attention time summed over the 32 layers).
// Correctness: the last row's logits must be finite and agree between the two methods.
// Floors (BENCH_RESULTS.md): attention rows max(KV bytes / 3e12, causal attention FLOPs / 7e14)
// over the 32 layers; step rows add the weights (bytes read once; FLOPs 2 per weight per row,
// the LM head for the one logits row only).
//
//   prefill_bench [--out DIR] [--reps N]
// Writes <out>/prefill-<gpu>-<date>.json.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/llama3_8b_config.h"
#include "bench/bench_result.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/prefill_attention.h"
#include "models/llama_cuda.h"
#include "models/model_config.h"

namespace deft::bench {
namespace {

using engine::AttentionPlan;
using engine::AttentionPlanner;
using engine::KvCacheManager;
using engine::NodeId;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;
using Clock = std::chrono::steady_clock;

constexpr int kWarmupSteps = 2;
constexpr int32_t kPageTokens = 16;
constexpr int32_t kNumPages = 1024;  // 16384 KV slots: 2 GiB at these shapes
constexpr int32_t kMaxRows = 4096;
constexpr int32_t kMinPrefillRun = 64;

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

struct Measured {
  std::vector<double> step_us, attention_us, wall_us, plan_us;
  std::vector<float> last_logits;
  bool finite = true;
  int64_t kv_tokens_read = 0;
  int32_t tasks = 0, prefill_runs = 0;
  kernels::PrefillLaunchShape shape;  // of the prefill kernel (new path)
};

// Runs the step `queries` / `tokens` of `tree` repeatedly with `planner`.
Measured measure(models::LlamaCudaRunner& runner, const SequenceTree& tree,
                 const std::vector<QueryToken>& queries, const std::vector<TokenId>& tokens,
                 AttentionPlanner& planner, int reps) {
  Measured m;
  AttentionPlan plan;
  const int32_t vocab = runner.vocab_size();
  std::vector<float> logits(vocab);
  const std::vector<int32_t> logit_rows = {static_cast<int32_t>(queries.size()) - 1};
  const std::vector<engine::TreeQueries> input = {{&tree, queries}};
  auto one = [&](models::StepTiming timing, bool keep) {
    runner.set_step_timing(timing);
    const Clock::time_point t0 = Clock::now();
    must(planner.plan(input, plan), "plan");
    const double plan_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    must(runner.forward({.plan = &plan, .tokens = tokens, .logit_rows = logit_rows}, logits),
         "forward");
    const double wall_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (!keep) return;
    const models::StepTimes& times = runner.last_step_times();
    if (timing == models::StepTiming::kTotal) {
      m.step_us.push_back(times.total_ms * 1e3);
      m.wall_us.push_back(wall_us);
      m.plan_us.push_back(plan_us);
    } else {
      m.attention_us.push_back(times.attention_ms * 1e3);
    }
  };
  for (int i = 0; i < kWarmupSteps; ++i) one(models::StepTiming::kTotal, false);
  for (int i = 0; i < reps; ++i) one(models::StepTiming::kTotal, true);
  for (int i = 0; i < reps; ++i) one(models::StepTiming::kPhases, true);
  runner.set_step_timing(models::StepTiming::kOff);
  m.last_logits = logits;
  for (float x : logits) m.finite &= std::isfinite(x);
  m.kv_tokens_read = plan.io.kv_tokens_read;
  m.tasks = plan.num_tasks();
  m.prefill_runs = static_cast<int32_t>(plan.prefill_runs.size());
  const models::ModelConfig& c = runner.config();
  const kernels::AttentionDims dims{.num_q_heads = c.num_attention_heads,
                                    .num_kv_heads = c.num_key_value_heads,
                                    .head_dim = c.head_dim,
                                    .softmax_scale = 1.0f};
  m.shape = kernels::prefill_launch_shape(plan.prefill_runs, dims,
                                          kernels::current_device_sm_count());
  return m;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(double{a[i]} - b[i]));
    scale = std::max(scale, std::abs(double{b[i]}));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string out;
  int reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--out") out = argv[i + 1];
    else if (flag == "--reps") reps = std::atoi(argv[i + 1]);
  }
  const models::ModelConfig config = llama3_8b_config();
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> created =
      models::LlamaCudaRunner::create_random(
          config, {.num_kv_slots = int64_t{kNumPages} * kPageTokens, .page_tokens = kPageTokens,
                   .max_batch_rows = kMaxRows},
          1, "llama3-8b-random");
  must(created.status(), "runner");
  models::LlamaCudaRunner& runner = **created;

  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("prefill", gpu, tag, argc, argv);

  const int64_t layers = config.num_hidden_layers;
  const int64_t kv_token_bytes_per_layer = int64_t{2} * config.kv_size() * 2;  // K + V, bf16
  const size_t embed_bytes = size_t{2} * config.vocab_size * config.hidden_size;
  const double lm_head_params = double(config.vocab_size) * config.hidden_size;
  const double weight_read_bytes = double(runner.weight_bytes() - embed_bytes);
  const double body_params = weight_read_bytes / 2 - lm_head_params;

  struct CaseSpec {
    std::string name;
    int32_t prefix;
    int32_t run;
  };
  const std::vector<CaseSpec> cases = {{"prefill_p4000", 0, 4000},
                                       {"extend_p4000_e300", 4000, 300}};
  std::mt19937 rng(3);
  std::uniform_int_distribution<TokenId> token(0, config.vocab_size - 1);
  bool all_ok = true;
  for (const CaseSpec& spec : cases) {
    KvCacheManager kv({.page_tokens = kPageTokens, .num_pages = kNumPages});
    SequenceTree tree(0, &kv);
    AttentionPlanner tiled({.kind = PlanKind::kDeftFlatten, .min_prefill_run = kMinPrefillRun});
    AttentionPlanner flatten({.kind = PlanKind::kDeftFlatten});
    NodeId node = tree.root();
    if (spec.prefix > 0) {
      std::vector<TokenId> prompt(spec.prefix);
      for (TokenId& t : prompt) t = token(rng);
      must(tree.append(node, prompt), "prompt");
      std::vector<QueryToken> queries;
      for (int32_t i = 0; i < spec.prefix; ++i) queries.push_back({node, i});
      AttentionPlan plan;
      const std::vector<engine::TreeQueries> input = {{&tree, queries}};
      must(tiled.plan(input, plan), "prefix plan");
      must(runner.forward({.plan = &plan, .tokens = prompt, .logit_rows = {}}, {}), "prefix");
      absl::StatusOr<std::vector<NodeId>> child = tree.branch(node, 1);
      must(child.status(), "branch");
      node = (*child)[0];
    }
    std::vector<TokenId> tokens(spec.run);
    for (TokenId& t : tokens) t = token(rng);
    must(tree.append(node, tokens), "run");
    std::vector<QueryToken> queries;
    for (int32_t i = 0; i < spec.run; ++i) queries.push_back({node, i});

    const Measured old_path = measure(runner, tree, queries, tokens, flatten, reps);
    const Measured new_path = measure(runner, tree, queries, tokens, tiled, reps);
    const double agreement = relative_error(new_path.last_logits, old_path.last_logits);
    const bool ok = old_path.finite && new_path.finite && agreement <= 0.1;
    all_ok &= ok;
    std::printf("%s: last-row logits finite %d/%d, relative difference %.3g%s\n",
                spec.name.c_str(), old_path.finite, new_path.finite, agreement,
                ok ? "" : "  FAILED (rows not written)");
    if (!ok) continue;

    // Causal (query, key) pairs: row i sees prefix + i + 1 keys.
    const double pairs = double(spec.run) * spec.prefix + double(spec.run) * (spec.run + 1) / 2;
    const double attention_flops =
        4.0 * config.num_attention_heads * config.head_dim * pairs * layers;
    const int64_t kv_bytes = int64_t{spec.prefix + spec.run} * kv_token_bytes_per_layer * layers;
    const double attention_floor_us = BenchResult::floor_us(kv_bytes, attention_flops);
    const double step_flops = 2.0 * body_params * spec.run + 2.0 * lm_head_params + attention_flops;
    const double step_floor_us = BenchResult::floor_us(weight_read_bytes + kv_bytes, step_flops);
    for (const auto& [method, m] : {std::pair<std::string, const Measured*>{"deft_flatten", &old_path},
                                    std::pair<std::string, const Measured*>{"prefill_tiled", &new_path}}) {
      const Samples attention = summarize(m->attention_us);
      const Samples step = summarize(m->step_us);
      const Samples wall = summarize(m->wall_us);
      const Samples plan = summarize(m->plan_us);
      nlohmann::json extra = {{"prefix_tokens", spec.prefix},
                              {"run_tokens", spec.run},
                              {"layers", layers},
                              {"plan_tasks", m->tasks},
                              {"plan_prefill_runs", m->prefill_runs},
                              {"prefill_q_tiles", m->shape.q_tiles},
                              {"prefill_kv_splits", m->shape.kv_splits},
                              {"plan_kv_tokens_read_per_layer", m->kv_tokens_read},
                              {"attention_flops", attention_flops},
                              {"logits_relative_difference_between_methods", agreement}};
      ResultRow a{.case_name = spec.name + "_attention",
                  .method = method,
                  .median_us = attention.median,
                  .p10_us = attention.p10,
                  .p90_us = attention.p90,
                  .repetitions = static_cast<int64_t>(m->attention_us.size()),
                  .kv_bytes = kv_bytes,
                  .floor_us = attention_floor_us,
                  .extra = extra};
      a.extra["what"] = "attention of one step, all 32 layers (StepTiming::kPhases)";
      result.add(a);
      ResultRow s{.case_name = spec.name + "_step",
                  .method = method,
                  .median_us = step.median,
                  .p10_us = step.p10,
                  .p90_us = step.p90,
                  .repetitions = static_cast<int64_t>(m->step_us.size()),
                  .kv_bytes = kv_bytes,
                  .floor_us = step_floor_us,
                  .extra = extra};
      s.extra["what"] = "step GPU time (StepTiming::kTotal), inputs upload to logits download";
      s.extra["wall_median_us"] = wall.median;
      s.extra["plan_median_us"] = plan.median;
      s.extra["attention_share_of_step"] = step.median > 0 ? attention.median / step.median : 0.0;
      result.add(s);
      std::printf("  %-14s attention %9.1f us (floor %8.1f, x%.2f)  step %9.1f us (floor %8.1f, "
                  "x%.2f)  plan %.0f us, %d tasks, %d prefill runs\n",
                  method.c_str(), attention.median, attention_floor_us,
                  attention.median / attention_floor_us, step.median, step_floor_us,
                  step.median / step_floor_us, plan.median, m->tasks, m->prefill_runs);
    }
  }
  std::printf("wrote %s\n", result.write(out).c_str());
  return all_ok ? 0 : 1;
}
