// The cost of deterministic mode (models::LlamaCudaOptions::deterministic with deterministic plans,
// engine::PlannerOptions::deterministic) against the default path, on random-weight
// Llama-3.2-1B- and Llama-3-8B-shaped models: two runners on the same weights (same seed), the
// same steps, GPU time per step from the runner's events (StepTiming::kTotal; decode steps replay
// CUDA graphs on both). Cases:
//   decode_b1_p1000       one sequence of 1000 tokens, one new token a step;
//   decode_b16_p1000      16 sequences of 1000 tokens (16 concurrent requests), a token each;
//   decode_b64_p500       64 sequences of 500 tokens;
//   fewshot_p4000_b20     a 4000-token prompt and 20 branches, a token each;
//   mixed_b16_prefill512  decode_b16's rows plus a 512-token prompt chunk of another request;
//   prefill_p2048         one 2048-token prompt in one step.
// Every decode step feeds the greedy tokens back (sampled on the GPU: forward_sampled).
// Check (per case, deterministic runner): the first request's row computed alone in a step of
// its own equals, bit for bit, its row in the full step (same tree, same KV slot rewritten with
// the same K/V); the default path's agreement is recorded too. A deterministic row whose check
// fails is not written.
//
//   deterministic_step_bench [--out DIR] [--shape 1b|8b|both] [--steps N]
// Writes <out>/deterministic_step-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "bench/llama3_2_1b_config.h"
#include "bench/llama3_8b_config.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "models/llama_cuda.h"
#include "models/model_config.h"

namespace deft::bench {
namespace {

using engine::AttentionPlan;
using engine::AttentionPlanner;
using engine::KvCacheManager;
using engine::NodeId;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;

constexpr int32_t kPageTokens = 16;
constexpr int32_t kNumPages = 4096;  // 65536 slots
constexpr int kWarmupSteps = 3;

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

struct Case {
  std::string name;
  int32_t sequences = 0;  // independent trees, each a prompt and one branch
  int32_t prompt = 0;
  int32_t branches = 1;      // of the first tree (few-shot)
  int32_t prefill_rows = 0;  // a prompt chunk of another request in every step
  bool prefill_only = false;
};

struct CaseResult {
  std::vector<double> gpu_us;
  int32_t rows = 0;
  bool row_check_equal = false;
  double row_check_max_abs_diff = 0;
};

// One case on one runner: its trees prefilled, then timed steps.
class CaseRun {
 public:
  CaseRun(models::LlamaCudaRunner& runner, const Case& c, bool deterministic)
      : runner_(runner),
        c_(c),
        kv_({.page_tokens = kPageTokens, .num_pages = kNumPages}),
        planner_(deterministic ? engine::PlannerOptions{.deterministic = true}
                               : engine::PlannerOptions{.min_prefill_run = 64,
                                                        .wave = runner.attention_wave()}),
        rng_(5) {}

  CaseResult run(int steps) {
    CaseResult result;
    std::uniform_int_distribution<TokenId> token(0, runner_.vocab_size() - 1);
    if (c_.prefill_only) {
      SequenceTree tree(1, &kv_);
      for (int s = 0; s < kWarmupSteps + steps; ++s) {
        // The same prompt rows each time (its KV rewritten): one prefill step.
        std::vector<QueryToken> queries;
        std::vector<TokenId> tokens;
        if (tree.node(tree.root()).tokens.empty()) {
          must(tree.append(tree.root(), std::vector<TokenId>(c_.prompt, 1)), "prompt");
        }
        for (int32_t i = 0; i < c_.prompt; ++i) {
          queries.push_back({tree.root(), i});
          tokens.push_back(static_cast<TokenId>(1 + i % 1000));
        }
        const std::vector<int32_t> last = {c_.prompt - 1};
        const double us = timed_step({{&tree, queries}}, tokens, last, nullptr);
        if (s >= kWarmupSteps) result.gpu_us.push_back(us);
      }
      result.rows = c_.prompt;
      result.row_check_equal = true;
      return result;
    }
    // Trees: prompt prefilled (untimed), then branches.
    std::vector<std::unique_ptr<SequenceTree>> trees;
    std::vector<std::vector<NodeId>> leaves;
    for (int32_t t = 0; t < c_.sequences; ++t) {
      trees.push_back(std::make_unique<SequenceTree>(t + 1, &kv_));
      SequenceTree& tree = *trees.back();
      std::vector<TokenId> prompt(c_.prompt);
      for (TokenId& id : prompt) id = token(rng_);
      must(tree.append(tree.root(), prompt), "prompt");
      for (int32_t begin = 0; begin < c_.prompt; begin += 2048) {
        std::vector<QueryToken> queries;
        std::vector<TokenId> tokens;
        for (int32_t i = begin; i < std::min(c_.prompt, begin + 2048); ++i) {
          queries.push_back({tree.root(), i});
          tokens.push_back(prompt[i]);
        }
        timed_step({{&tree, queries}}, tokens, {}, nullptr);
      }
      leaves.push_back(tree.branch(tree.root(), t == 0 ? c_.branches : 1).value());
    }
    // The other request whose prompt chunks ride along (mixed case).
    SequenceTree other(1000, &kv_);
    std::vector<TokenId> pending;
    for (const auto& l : leaves) {
      for (size_t b = 0; b < l.size(); ++b) pending.push_back(token(rng_));
    }
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      std::vector<std::vector<QueryToken>> queries(trees.size());
      std::vector<TokenId> tokens;
      size_t p = 0;
      for (size_t t = 0; t < trees.size(); ++t) {
        for (NodeId leaf : leaves[t]) {
          must(trees[t]->append(leaf, std::span<const TokenId>(&pending[p], 1)), "append");
          queries[t].push_back(
              {leaf, static_cast<int32_t>(trees[t]->node(leaf).tokens.size()) - 1});
          tokens.push_back(pending[p++]);
        }
      }
      std::vector<engine::TreeQueries> input;
      for (size_t t = 0; t < trees.size(); ++t) input.push_back({trees[t].get(), queries[t]});
      std::vector<QueryToken> other_queries;
      if (c_.prefill_rows > 0) {
        const auto first = static_cast<int32_t>(other.node(other.root()).tokens.size());
        std::vector<TokenId> chunk(c_.prefill_rows);
        for (TokenId& id : chunk) id = token(rng_);
        must(other.append(other.root(), chunk), "chunk");
        for (int32_t i = 0; i < c_.prefill_rows; ++i)
          other_queries.push_back({other.root(), first + i});
        tokens.insert(tokens.end(), chunk.begin(), chunk.end());
        input.push_back({&other, other_queries});
      }
      const auto decode_rows = static_cast<int32_t>(pending.size());
      std::vector<int32_t> logit_rows(decode_rows);
      for (int32_t r = 0; r < decode_rows; ++r) logit_rows[r] = r;
      std::vector<engine::SampledToken> sampled(decode_rows);
      const double us = timed_step(input, tokens, logit_rows, &sampled);
      if (s >= kWarmupSteps) result.gpu_us.push_back(us);
      result.rows = static_cast<int32_t>(tokens.size());
      if (s == kWarmupSteps + steps - 1) {
        // The check: the first request's row alone against its row in the full step (both
        // rewrite the same slot; the K/V are the same bits when the step is batch-invariant).
        std::vector<float> full(static_cast<size_t>(decode_rows) * runner_.vocab_size());
        must(planner_.plan(input, plan_), "plan");
        must(runner_.forward({.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows}, full),
             "check step");
        const std::vector<engine::TreeQueries> one = {{trees[0].get(), {&queries[0][0], 1}}};
        std::vector<float> alone(static_cast<size_t>(runner_.vocab_size()));
        const std::vector<int32_t> first = {0};
        must(planner_.plan(one, plan_), "plan");
        must(runner_.forward({.plan = &plan_, .tokens = {&tokens[0], 1}, .logit_rows = first},
                             alone),
             "check row");
        result.row_check_equal =
            std::memcmp(alone.data(), full.data(), alone.size() * sizeof(float)) == 0;
        for (size_t i = 0; i < alone.size(); ++i) {
          result.row_check_max_abs_diff =
              std::max<double>(result.row_check_max_abs_diff, std::abs(alone[i] - full[i]));
        }
      }
      for (int32_t r = 0; r < decode_rows; ++r) pending[r] = sampled[r].token;
    }
    return result;
  }

 private:
  // Plans and runs a step; GPU µs from the runner's events.
  double timed_step(const std::vector<engine::TreeQueries>& input,
                    const std::vector<TokenId>& tokens, const std::vector<int32_t>& logit_rows,
                    std::vector<engine::SampledToken>* sampled) {
    must(planner_.plan(input, plan_), "plan");
    const engine::StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows};
    runner_.set_step_timing(models::StepTiming::kTotal);
    if (sampled != nullptr) {
      std::vector<engine::RowSampling> rows(logit_rows.size(), {.params = &greedy_});
      must(runner_.forward_sampled(batch, rows, *sampled), "forward_sampled");
    } else {
      std::vector<float> logits(logit_rows.size() * static_cast<size_t>(runner_.vocab_size()));
      must(runner_.forward(batch, logits), "forward");
    }
    const double us = runner_.last_step_times().total_ms * 1e3;
    runner_.set_step_timing(models::StepTiming::kOff);
    return us;
  }

  models::LlamaCudaRunner& runner_;
  Case c_;
  KvCacheManager kv_;
  AttentionPlanner planner_;
  AttentionPlan plan_;
  std::mt19937 rng_;
  engine::SamplingParams greedy_{.temperature = 0.0f};
};

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string out, shapes = "both";
  int steps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--out")
      out = argv[i + 1];
    else if (flag == "--shape")
      shapes = argv[i + 1];
    else if (flag == "--steps")
      steps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s (--out DIR, --shape 1b|8b|both, --steps N)\n",
                   flag.c_str());
      return 1;
    }
  }
  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("deterministic_step", gpu, tag, argc, argv);
  const std::vector<Case> cases = {
      {.name = "decode_b1_p1000", .sequences = 1, .prompt = 1000},
      {.name = "decode_b16_p1000", .sequences = 16, .prompt = 1000},
      {.name = "decode_b64_p500", .sequences = 64, .prompt = 500},
      {.name = "fewshot_p4000_b20", .sequences = 1, .prompt = 4000, .branches = 20},
      {.name = "mixed_b16_prefill512", .sequences = 16, .prompt = 1000, .prefill_rows = 512},
      {.name = "prefill_p2048", .prompt = 2048, .prefill_only = true},
  };
  std::printf("%-12s %-22s %6s | %10s %10s %7s | %s\n", "shape", "case", "rows", "default_us",
              "determ_us", "ratio", "row alone == row in step (default / deterministic)");
  for (const std::string shape : {"1b", "8b"}) {
    if (shapes != "both" && shapes != shape) continue;
    const models::ModelConfig config = shape == "1b" ? llama3_2_1b_config() : llama3_8b_config();
    const std::string model_name = shape == "1b" ? "llama-3.2-1b-random" : "llama-3-8b-random";
    std::unique_ptr<models::LlamaCudaRunner> runners[2];
    for (int d = 0; d < 2; ++d) {
      absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> runner =
          models::LlamaCudaRunner::create_random(config,
                                                 {.num_kv_slots = int64_t{kNumPages} * kPageTokens,
                                                  .page_tokens = kPageTokens,
                                                  .max_batch_rows = 2560,
                                                  .deterministic = d == 1},
                                                 /*seed=*/1, model_name);
      must(runner.status(), "runner");
      runners[d] = std::move(*runner);
    }
    for (const Case& c : cases) {
      CaseResult results[2];
      for (int d = 0; d < 2; ++d) {
        CaseRun run(*runners[d], c, d == 1);
        results[d] = run.run(c.prefill_only ? std::max(5, steps / 4) : steps);
      }
      const Samples normal = summarize(results[0].gpu_us);
      const Samples determ = summarize(results[1].gpu_us);
      std::printf("%-12s %-22s %6d | %10.0f %10.0f %7.3f | %s / %s\n", model_name.c_str(),
                  c.name.c_str(), results[0].rows, normal.median, determ.median,
                  determ.median / normal.median, results[0].row_check_equal ? "equal" : "differs",
                  results[1].row_check_equal ? "equal" : "DIFFERS");
      for (int d = 0; d < 2; ++d) {
        if (d == 1 && !results[1].row_check_equal) continue;  // failed its check: not written
        ResultRow row;
        row.case_name = model_name + "/" + c.name;
        row.method = d == 1 ? "deterministic" : "default";
        row.set_times(d == 1 ? determ : normal);
        row.repetitions = static_cast<int64_t>(results[d].gpu_us.size());
        row.extra = {
            {"rows", results[d].rows},
            {"gpu_time", "StepTiming::kTotal events around the step's GPU work"},
            {"ratio_to_default", (d == 1 ? determ.median : normal.median) / normal.median},
            {"row_alone_equals_row_in_step", results[d].row_check_equal},
            {"row_alone_max_abs_logit_diff", results[d].row_check_max_abs_diff},
            {"path", d == 1 ? "deterministic: skinny GEMM for every GEMM (64-row passes, N 64), "
                              "wgmma stage 1, planner pieces of 256 tokens per path, no prefill "
                              "runs"
                            : "default: tuned cuBLASLt + skinny LM head / gate-up, adaptive "
                              "DeFT-Flatten, prefill kernel for runs >= 64"},
        };
        result.add(row);
      }
    }
  }
  std::printf("wrote %s\n", result.write(out).c_str());
  return 0;
}
