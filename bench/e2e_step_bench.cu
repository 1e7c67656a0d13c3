// End-to-end decode steps of a Llama-3-8B-shaped model with random bf16 weights (32 layers,
// hidden 4096, 32/8 heads, head_dim 128, intermediate 14336, vocab 128256, rope_theta 500000)
// on models/llama_cuda.h, for DeFT-Flatten (the planner's default, adaptive B) and the
// sequence baseline (planner default split-KV chunks) in the same run:
//   fewshot_p4000_b20_s100: a 4000-token prompt prefilled, 20 branches decoding one token each
//     per step for 100 steps (greedy, sampled on the GPU: forward_sampled);
//   specdec_p6000_t64: a 6000-token prefix prefilled, then steps verifying the 64-token Medusa
//     tree (SpecDecReplay, accept lengths of the trace's first record); the greedy token of
//     every tree row (what a greedy verifier compares), the trace decides what is accepted.
// One step = tree bookkeeping + planning + forward_sampled() (LM head and greedy sampling on
// the GPU; only token ids come back) + reading the tokens. Each scenario runs twice per
// method: with StepTiming::kTotal (the step's wall time and GPU time from two CUDA events; in a
// graph step the first is the graph's first node, so GPU time holds no host time) and
// with StepTiming::kPhases (events after every launch: attention / GEMMs / other kernels /
// copies). Host parts by steady_clock. The first kWarmupSteps steps of each run are excluded.
// CUDA graphs: each method runs its kTotal scenario twice, with graph replay (the runner's
// default; row "<method>") and with every launch eager (row "<method>_eager"); kPhases runs
// eagerly either way, so both rows carry the same phase split.
// Floor per step = (weight bytes read + tree KV bytes) / 3.0e12 B/s (max with FLOPs / 7e14),
// where weight bytes read excludes the embedding table (a step gathers a few rows of it).
// Before the model loads, the run measures what the device reads (bench/device_read_bandwidth.h);
// each row also gives its ratio to the floor at that bandwidth (extra.ratio_to_measured_floor), as
// the machine drawn moves the step by a few percent.
//
//   e2e_step_bench [--workloads DIR] [--out DIR] [--fewshot-steps N] [--spec-steps N]
//                  [--gemm default|tuned|cublas|skinny|skinny_wide|skinny_head[,...]]
//                  [--gemm-search heuristic|wide] [--chunk-tokens B] [--case NAME]
//                  [--method deft_flatten|sequence]
//   --gemm: default (the runner's: cuBLASLt algorithms tuned at load, models/gemm_tuner.h, and
//   kernels/skinny_gemm.h for the LM head and, in steps of more than 32 rows, gate/up),
//   skinny_head (the skinny GEMM for the LM head only), tuned (cuBLASLt for every GEMM), cublas
//   (cuBLAS's default algorithm), skinny (the skinny GEMM for every GEMM of a <= 64-row step),
//   skinny_wide (only for its wide shapes, kernels::skinny_gemm_wide); a
//   comma-separated list runs every case and method once per mode in the same process (same
//   weights), rows of modes after the first named "<method>_gemm_<mode>";
//   --gemm-search wide: the tuner also tries every other cuBLASLt algorithm id.
//   --chunk-tokens B: DeFT-Flatten's chunk size (default 0: the planner's adaptive B).
//   --case NAME: only that case (fewshot_p4000_b20_s100 or specdec_p6000_t64).
//   --method NAME: only that method (no agreement between methods is reported then).
// Writes <out>/e2e_step-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
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

#include "absl/strings/str_split.h"
#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/llama3_8b_config.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
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

constexpr int kWarmupSteps = 3;
constexpr int32_t kPageTokens = 16;
constexpr int32_t kNumPages = 1024;        // 16384 KV slots: 2 GiB of KV at these shapes
constexpr int32_t kPrefillChunk = 2048;    // query rows per prefill forward

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

struct StepRecord {
  double total_us = 0;     // wall: bookkeeping + planning + forward_sampled + reading tokens
  double bookkeeping_us = 0, plan_us = 0, sample_us = 0;
  double forward_wall_us = 0;
  models::StepTimes gpu;   // ms, from the runner's events
  double floor_bytes = 0, flops = 0;  // the step's floor (BenchResult::floor_us)
  int64_t kv_bytes = 0;    // what the plan reads (all layers)
  int64_t tree_kv_bytes = 0;
  int64_t tree_tokens = 0;
  int32_t new_tokens = 0;  // tokens the step produces (branches, or accepted tokens)
  std::vector<TokenId> argmax;
};

struct Run {
  std::vector<StepRecord> steps;  // timed steps only
  bool finite = true;
  models::CudaGraphStats graphs;  // the runner's counters over the run (prefill included)
};

class Bench {
 public:
  Bench(models::LlamaCudaRunner& runner, const models::ModelConfig& config, int chunk_tokens)
      : runner_(runner), config_(config), chunk_tokens_(chunk_tokens) {
    greedy_.temperature = 0.0f;
    const size_t embed_bytes = size_t{2} * config.vocab_size * config.hidden_size;
    weight_read_bytes_ = runner.weight_bytes() - embed_bytes;
    kv_token_bytes_ = int64_t{2} * config.num_hidden_layers * config.kv_size() * 2;
  }
  size_t weight_read_bytes() const { return weight_read_bytes_; }
  void set_cuda_graphs(bool on) { runner_.set_cuda_graphs(on); }

  models::CudaGraphStats graph_stats_since(const models::CudaGraphStats& before) const {
    const models::CudaGraphStats& now = runner_.cuda_graph_stats();
    return {.graph_steps = now.graph_steps - before.graph_steps,
            .captures = now.captures - before.captures,
            .capture_us = now.capture_us - before.capture_us,
            .eager_steps = now.eager_steps - before.eager_steps,
            .cached_graphs = now.cached_graphs};
  }

  // Prefills tokens [0, count) of `node` (already appended) in chunks; no logits. Untimed, on
  // a DeFT-Flatten plan whatever the method (the sequence plan of a prefill reads the prefix
  // once per query).
  void prefill(const SequenceTree& tree, NodeId node, int32_t count) {
    AttentionPlanner planner({.kind = PlanKind::kDeftFlatten});
    std::mt19937 rng(7);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    for (int32_t begin = 0; begin < count; begin += kPrefillChunk) {
      const int32_t end = std::min(count, begin + kPrefillChunk);
      std::vector<QueryToken> queries;
      std::vector<TokenId> tokens;
      for (int32_t i = begin; i < end; ++i) {
        queries.push_back({node, i});
        tokens.push_back(token(rng));
      }
      const std::vector<engine::TreeQueries> input = {{&tree, queries}};
      must(planner.plan(input, plan_), "prefill plan");
      must(runner_.forward({.plan = &plan_, .tokens = tokens, .logit_rows = {}}, {}),
           "prefill forward");
    }
  }

  // One timed step over `queries` of `tree` (bookkeeping already done by the caller and timed
  // as `bookkeeping_us`).
  StepRecord step(const SequenceTree& tree, const std::vector<QueryToken>& queries,
                  const std::vector<TokenId>& tokens, AttentionPlanner& planner,
                  double bookkeeping_us, Clock::time_point t0, bool& finite) {
    StepRecord rec;
    rec.bookkeeping_us = bookkeeping_us;
    Clock::time_point t = Clock::now();
    const std::vector<engine::TreeQueries> input = {{&tree, queries}};
    must(planner.plan(input, plan_), "plan");
    rec.plan_us = us_since(t);
    const int32_t rows = static_cast<int32_t>(queries.size());
    logit_rows_.resize(rows);
    for (int32_t r = 0; r < rows; ++r) logit_rows_[r] = r;
    sampling_rows_.assign(rows, {.params = &greedy_, .step = 0});
    sampled_.resize(rows);
    t = Clock::now();
    const absl::Status sampled = runner_.forward_sampled(
        {.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows_}, sampling_rows_, sampled_);
    rec.forward_wall_us = us_since(t);
    rec.gpu = runner_.last_step_times();
    // INTERNAL: a NaN / inf logit (the row is reported, not sampled); anything else is fatal.
    if (sampled.code() == absl::StatusCode::kInternal) {
      finite = false;
    } else {
      must(sampled, "forward_sampled");
    }
    t = Clock::now();
    rec.argmax.resize(rows);
    for (int32_t r = 0; r < rows; ++r) rec.argmax[r] = sampled.ok() ? sampled_[r].token : 0;
    rec.sample_us = us_since(t);
    rec.total_us = us_since(t0);

    rec.tree_tokens = tree.total_tokens();
    rec.tree_kv_bytes = rec.tree_tokens * kv_token_bytes_;
    rec.kv_bytes = plan_.io.kv_tokens_read * kv_token_bytes_;
    // FLOPs: 2 per weight element per row (LM head: every row here), attention 4 * q_size per
    // (query, visible token) per layer.
    int64_t visible = 0;
    for (const QueryToken& q : queries) visible += tree.depth(q.node, q.token_index) + 1;
    const double flops = 2.0 * (weight_read_bytes_ / 2.0) * rows +
                         4.0 * config_.q_size() * double(visible) * config_.num_hidden_layers;
    rec.floor_bytes = double(weight_read_bytes_) + double(rec.tree_kv_bytes);
    rec.flops = flops;
    return rec;
  }

  Run fewshot(PlanKind kind, models::StepTiming timing, int prompt, int branches, int steps) {
    runner_.set_step_timing(models::StepTiming::kOff);
    KvCacheManager kv({.page_tokens = kPageTokens, .num_pages = kNumPages});
    SequenceTree tree(0, &kv);
    AttentionPlanner planner(planner_options(kind));
    must(tree.append(0, std::vector<TokenId>(prompt, 1)), "prompt");
    prefill(tree, 0, prompt);
    absl::StatusOr<std::vector<NodeId>> leaves = tree.branch(0, branches);
    must(leaves.status(), "branch");
    std::mt19937 rng(11);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    std::vector<TokenId> pending(branches);
    for (TokenId& t : pending) t = token(rng);  // each branch starts from its own token
    Run run;
    const models::CudaGraphStats before = runner_.cuda_graph_stats();
    std::vector<QueryToken> queries(branches);
    runner_.set_step_timing(timing);
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      const Clock::time_point t0 = Clock::now();
      for (int b = 0; b < branches; ++b) {
        const NodeId leaf = (*leaves)[b];
        must(tree.append(leaf, std::span<const TokenId>(&pending[b], 1)), "append");
        queries[b] = {leaf, static_cast<int32_t>(tree.node(leaf).tokens.size()) - 1};
      }
      const double bookkeeping = us_since(t0);
      StepRecord rec = step(tree, queries, pending, planner, bookkeeping, t0, run.finite);
      const Clock::time_point t1 = Clock::now();
      pending = rec.argmax;  // greedy
      rec.bookkeeping_us += us_since(t1);
      rec.total_us += us_since(t1);
      rec.new_tokens = branches;
      if (s >= kWarmupSteps) run.steps.push_back(std::move(rec));
    }
    runner_.set_step_timing(models::StepTiming::kOff);
    run.graphs = graph_stats_since(before);
    return run;
  }

  Run specdec(PlanKind kind, models::StepTiming timing, const SpecDecTrace& trace,
              int prefix, int steps) {
    runner_.set_step_timing(models::StepTiming::kOff);
    KvCacheManager kv({.page_tokens = kPageTokens, .num_pages = kNumPages});
    SequenceTree tree(0, &kv);
    AttentionPlanner planner(planner_options(kind));
    SpecDecReplay replay(trace, tree, prefix);
    must(replay.status(), "specdec replay");
    prefill(tree, 0, prefix);
    const std::vector<int32_t>& accept = trace.accept_lengths.at(0);
    std::mt19937 rng(13);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    Run run;
    const models::CudaGraphStats before = runner_.cuda_graph_stats();
    std::vector<QueryToken> queries;
    std::vector<TokenId> tokens(trace.tree_size());
    runner_.set_step_timing(timing);
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      for (TokenId& t : tokens) t = token(rng);  // the candidates' ids (untimed)
      const Clock::time_point t0 = Clock::now();
      replay.build_token_tree(queries);
      must(replay.status(), "token tree");
      const double bookkeeping = us_since(t0);
      StepRecord rec = step(tree, queries, tokens, planner, bookkeeping, t0, run.finite);
      const Clock::time_point t1 = Clock::now();
      const int32_t accepted = std::max(1, accept[s % accept.size()]);
      replay.commit(accepted);
      must(replay.status(), "commit");
      rec.bookkeeping_us += us_since(t1);
      rec.total_us += us_since(t1);
      rec.new_tokens = accepted;
      if (s >= kWarmupSteps) run.steps.push_back(std::move(rec));
    }
    runner_.set_step_timing(models::StepTiming::kOff);
    run.graphs = graph_stats_since(before);
    return run;
  }

 private:
  // The sequence baseline keeps the planner's default chunks.
  engine::PlannerOptions planner_options(PlanKind kind) const {
    return {.kind = kind,
            .chunk_tokens = kind == PlanKind::kDeftFlatten ? chunk_tokens_ : 0,
            .wave = runner_.attention_wave()};
  }

  models::LlamaCudaRunner& runner_;
  models::ModelConfig config_;
  int chunk_tokens_;  // DeFT-Flatten's B; 0: adaptive
  AttentionPlan plan_;
  std::vector<int32_t> logit_rows_;
  engine::SamplingParams greedy_;  // temperature 0 (set in the constructor)
  std::vector<engine::RowSampling> sampling_rows_;
  std::vector<engine::SampledToken> sampled_;
  size_t weight_read_bytes_ = 0;
  int64_t kv_token_bytes_ = 0;
};

template <typename F>
Samples stat(const std::vector<StepRecord>& steps, F f) {
  std::vector<double> v;
  for (const StepRecord& s : steps) v.push_back(f(s));
  return summarize(v);
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string workloads = DEFT_WORKLOADS_DIR, out;
  int fewshot_steps = 100, spec_steps = 50, chunk_tokens = 0;
  std::string gemm_arg = "default", only_case, only_method;
  bool wide_search = false;
  int prefetch_kib = -1;  // --prefetch KIB (set_weight_prefetch); -1: the runner's default
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--workloads") workloads = argv[i + 1];
    else if (flag == "--out") out = argv[i + 1];
    else if (flag == "--fewshot-steps") fewshot_steps = std::atoi(argv[i + 1]);
    else if (flag == "--spec-steps") spec_steps = std::atoi(argv[i + 1]);
    else if (flag == "--gemm") gemm_arg = argv[i + 1];
    else if (flag == "--gemm-search") wide_search = std::string(argv[i + 1]) == "wide";
    else if (flag == "--chunk-tokens") chunk_tokens = std::atoi(argv[i + 1]);
    else if (flag == "--case") only_case = argv[i + 1];
    else if (flag == "--method") only_method = argv[i + 1];
    else if (flag == "--prefetch") {
      if (std::sscanf(argv[i + 1], "%d", &prefetch_kib) != 1 || prefetch_kib < 0) {
        std::fprintf(stderr, "--prefetch: '%s' is not a KiB count >= 0\n", argv[i + 1]);
        return 1;
      }
    }
  }
  if (!only_case.empty() && only_case != "fewshot_p4000_b20_s100" &&
      only_case != "specdec_p6000_t64") {
    std::fprintf(stderr, "--case: unknown case '%s' (fewshot_p4000_b20_s100, specdec_p6000_t64)\n",
                 only_case.c_str());
    return 1;
  }
  if (!only_method.empty() && only_method != "deft_flatten" && only_method != "sequence") {
    std::fprintf(stderr, "--method: unknown method '%s' (deft_flatten, sequence)\n",
                 only_method.c_str());
    return 1;
  }
  if (chunk_tokens < 0) {
    std::fprintf(stderr, "--chunk-tokens: %d is negative (0: adaptive)\n", chunk_tokens);
    return 1;
  }
  const std::vector<std::string> gemm_modes = absl::StrSplit(gemm_arg, ',');
  for (const std::string& mode : gemm_modes) {
    if (mode != "default" && mode != "tuned" && mode != "cublas" && mode != "skinny" &&
        mode != "skinny_wide" && mode != "skinny_head") {
      std::fprintf(stderr,
                   "--gemm: unknown mode '%s' (default, tuned, cublas, skinny, skinny_wide, "
                   "skinny_head)\n",
                   mode.c_str());
      return 1;
    }
  }
  // Every mode but cublas runs the tuned cuBLASLt algorithms for its cuBLAS GEMMs.
  const bool any_tuned =
      std::count(gemm_modes.begin(), gemm_modes.end(), "cublas") < std::ssize(gemm_modes);
  absl::StatusOr<SpecDecTrace> trace =
      load_specdec_trace(workloads + "/speculative_decoding/apps_tree_size64.json");
  must(trace.status(), "trace");

  // Before the model and its KV pool take the memory.
  const double read_bytes_per_s = measure_and_print_device_read_bandwidth();

  const models::ModelConfig config = llama3_8b_config();
  const Clock::time_point t_load = Clock::now();
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> runner =
      models::LlamaCudaRunner::create_random(
          config, {.num_kv_slots = int64_t{kNumPages} * kPageTokens, .page_tokens = kPageTokens,
                   .max_batch_rows = kPrefillChunk, .tune_gemms = any_tuned,
                   .wide_gemm_search = wide_search},
          1, "llama3-8b-random");
  must(runner.status(), "runner");
  std::printf("random Llama-3-8B-shaped model ready in %.1f s, %.2f GB weights\n",
              us_since(t_load) / 1e6, (*runner)->weight_bytes() / 1e9);

  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("e2e_step", gpu, tag, argc, argv);
  if (prefetch_kib >= 0) {
    (*runner)->set_weight_prefetch(int64_t{prefetch_kib} * 1024);
    std::printf("weight prefetch before the QKV, gate/up and down GEMMs: %d KiB a GEMM\n",
                prefetch_kib);
  }
  Bench bench(**runner, config, chunk_tokens);

  struct Method {
    PlanKind kind;
    std::string name;
  };
  const std::vector<Method> methods = {{PlanKind::kDeftFlatten, "deft_flatten"},
                                       {PlanKind::kSequence, "sequence"}};
  struct Case {
    std::string name;
    bool spec;
  };
  const std::vector<Case> cases = {{"fewshot_p4000_b20_s100", false}, {"specdec_p6000_t64", true}};

  for (const std::string& gemm : gemm_modes) {
    (*runner)->set_gemm_tuning(gemm != "cublas");
    using SkinnyGemmUse = models::LlamaCudaRunner::SkinnyGemmUse;
    (*runner)->set_skinny_gemm(gemm == "default"       ? SkinnyGemmUse::kLmHeadAndWide
                               : gemm == "skinny"      ? SkinnyGemmUse::kAll
                               : gemm == "skinny_wide" ? SkinnyGemmUse::kWide
                               : gemm == "skinny_head" ? SkinnyGemmUse::kLmHead
                                                       : SkinnyGemmUse::kOff);
    const std::string method_suffix = gemm == gemm_modes.front() ? "" : "_gemm_" + gemm;
    std::printf("GEMMs: %s\n", gemm.c_str());
    // Warm-up (cuBLAS heuristics, kernel loading, clocks): a short run of each scenario.
    bench.fewshot(PlanKind::kDeftFlatten, models::StepTiming::kOff, 4000, 20, 5);
    bench.specdec(PlanKind::kSequence, models::StepTiming::kOff, *trace, 6000, 5);

    std::printf("%-24s %-19s %9s %9s %6s | %8s %8s %8s %8s %8s | %7s %7s %7s %6s | %8s %7s\n",
                "case", "method", "total_us", "floor_us", "ratio", "gpu_us", "attn_us", "gemm_us",
                "other_us", "copy_us", "plan_us", "book_us", "samp_us", "host%", "tok/s",
                "r_meas");
    for (const Case& c : cases) {
      if (!only_case.empty() && c.name != only_case) continue;
      std::vector<std::vector<TokenId>> reference_argmax;  // the sequence baseline's, per step
      std::vector<ResultRow> rows;
      std::vector<std::vector<std::vector<TokenId>>> argmaxes;
      for (const Method& m : methods) {
        if (!only_method.empty() && m.name != only_method) continue;
        const auto run_once = [&](models::StepTiming timing, bool graphs) {
          bench.set_cuda_graphs(graphs);
          Run run = c.spec ? bench.specdec(m.kind, timing, *trace, 6000, spec_steps)
                           : bench.fewshot(m.kind, timing, 4000, 20, fewshot_steps);
          bench.set_cuda_graphs(true);
          return run;
        };
        const Run with_graphs = run_once(models::StepTiming::kTotal, true);
        const Run eager = run_once(models::StepTiming::kTotal, false);
        const Run phases = run_once(models::StepTiming::kPhases, false);
        // Greedy tokens with and without graphs (few-shot feeds them back: up to the first step
        // where they differ).
        int64_t graph_same = 0, graph_all = 0;
        int graph_first_diff = -1;
        for (size_t s = 0; s < std::min(with_graphs.steps.size(), eager.steps.size()); ++s) {
          const auto& a = with_graphs.steps[s].argmax;
          const auto& b = eager.steps[s].argmax;
          for (size_t r = 0; r < a.size() && r < b.size(); ++r) {
            ++graph_all;
            graph_same += a[r] == b[r];
          }
          if (graph_first_diff < 0 && a != b) graph_first_diff = static_cast<int>(s);
          if (!c.spec && graph_first_diff >= 0) break;
        }
        std::printf("%-24s %-19s greedy tokens with vs without CUDA graphs: %lld / %lld (first "
                    "differing step %d)\n",
                    c.name.c_str(), m.name.c_str(), static_cast<long long>(graph_same),
                    static_cast<long long>(graph_all), graph_first_diff);
        for (const bool graphs : {true, false}) {
          const Run& total = graphs ? with_graphs : eager;
          const std::string method = (graphs ? m.name : m.name + "_eager") + method_suffix;
          const auto& st = total.steps;
          const Samples t = stat(st, [](const StepRecord& s) { return s.total_us; });
          const Samples gpu = stat(st, [](const StepRecord& s) { return s.gpu.total_ms * 1e3; });
          const Samples plan = stat(st, [](const StepRecord& s) { return s.plan_us; });
          const Samples book = stat(st, [](const StepRecord& s) { return s.bookkeeping_us; });
          const Samples samp = stat(st, [](const StepRecord& s) { return s.sample_us; });
          const Samples host = stat(st, [](const StepRecord& s) {
            return s.plan_us + s.bookkeeping_us + s.sample_us;
          });
          const Samples fwd_wall = stat(st, [](const StepRecord& s) { return s.forward_wall_us; });
          const Samples gap = stat(st, [](const StepRecord& s) {
            return s.forward_wall_us - s.gpu.total_ms * 1e3;
          });
          const Samples floor = stat(st, [](const StepRecord& s) {
            return BenchResult::floor_us(s.floor_bytes, s.flops);
          });
          const Samples measured_floor = stat(st, [&](const StepRecord& s) {
            return BenchResult::floor_us(s.floor_bytes, s.flops, read_bytes_per_s);
          });
          const Samples tree_kv =
              stat(st, [](const StepRecord& s) { return double(s.tree_kv_bytes); });
          const Samples kv = stat(st, [](const StepRecord& s) { return double(s.kv_bytes); });
          const auto& ph = phases.steps;
          const Samples p_total =
              stat(ph, [](const StepRecord& s) { return s.gpu.total_ms * 1e3; });
          const Samples p_attn =
              stat(ph, [](const StepRecord& s) { return s.gpu.attention_ms * 1e3; });
          const Samples p_gemm = stat(ph, [](const StepRecord& s) { return s.gpu.gemm_ms * 1e3; });
          const Samples p_other = stat(ph, [](const StepRecord& s) {
            return (s.gpu.other_ms + s.gpu.sampling_ms) * 1e3;
          });
          const Samples p_sampling =
              stat(ph, [](const StepRecord& s) { return s.gpu.sampling_ms * 1e3; });
          const Samples p_copy = stat(ph, [](const StepRecord& s) { return s.gpu.copy_ms * 1e3; });
          const Samples p_wall = stat(ph, [](const StepRecord& s) { return s.total_us; });
          double tokens = 0, time_us = 0;
          for (const StepRecord& s : st) {
            tokens += s.new_tokens;
            time_us += s.total_us;
          }
          const double tokens_per_s = tokens / (time_us * 1e-6);
          std::printf(
              "%-24s %-19s %9.0f %9.0f %6.2f | %8.0f %8.0f %8.0f %8.0f %8.0f | %7.0f %7.0f %7.0f "
              "%5.1f%% | %8.0f %7.3f%s\n",
              c.name.c_str(), method.c_str(), t.median, floor.median, t.median / floor.median,
              gpu.median, p_attn.median, p_gemm.median, p_other.median, p_copy.median, plan.median,
              book.median, samp.median, 100.0 * host.median / t.median, tokens_per_s,
              t.median / measured_floor.median,
              total.finite && phases.finite ? "" : "  NON-FINITE LOGITS (row not written)");
          std::vector<std::vector<TokenId>> am;
          for (const StepRecord& s : st) am.push_back(s.argmax);
          if (graphs) argmaxes.push_back(am);
          if (!total.finite || !phases.finite) {
            rows.emplace_back();
            rows.back().method = "";  // marks a skipped row
            continue;
          }
          ResultRow row;
          row.case_name = c.name;
          row.method = method;
          row.set_times(t);
          row.repetitions = static_cast<int64_t>(st.size());
          row.kv_bytes = static_cast<int64_t>(kv.median);
          row.floor_us = floor.median;
          row.extra = {
              {"plan_kind", std::string(engine::plan_kind_name(m.kind))},
              {"device_read_bytes_per_s", read_bytes_per_s},
              {"floor_us_at_device_read", measured_floor.median},
              {"ratio_to_measured_floor", t.median / measured_floor.median},
              {"weight_prefetch_bytes", (*runner)->weight_prefetch()},
              {"gemm", gemm == "default"       ? "skinny GEMM for the LM head (<= 64 rows) "
                                                     "and gate/up (33-64 rows), tuned cuBLASLt "
                                                     "otherwise"
                     : gemm == "skinny"        ? "skinny GEMM (<= 64 rows), tuned cuBLASLt "
                                                     "otherwise"
                     : gemm == "skinny_head" ? "skinny GEMM for the LM head (<= 64 rows), tuned "
                                               "cuBLASLt otherwise"
                     : gemm == "skinny_wide" ? "skinny GEMM for the wide shapes (<= 64 rows), "
                                               "tuned cuBLASLt otherwise"
                     : gemm == "tuned" ? (wide_search ? "cuBLASLt algorithms tuned at load for "
                                                        "<= 256 rows (wide search)"
                                                      : "cuBLASLt algorithms tuned at load for "
                                                        "<= 256 rows")
                                       : "cuBLAS default algorithm"},
              {"chunk_policy", chunk_tokens == 0
                                   ? "planner default (Flatten: adaptive B; sequence: 128)"
                                   : "Flatten: B = " + std::to_string(chunk_tokens) +
                                         "; sequence: planner default (128)"},
              {"queries_per_step", c.spec ? trace->tree_size() : 20},
              {"tokens_per_s", tokens_per_s},
              {"tokens_per_step_mean", tokens / st.size()},
              {"floor_bytes_weights", bench.weight_read_bytes()},
              {"floor_bytes_tree_kv_median", tree_kv.median},
              {"split_us_median",
               {{"gpu_forward_events", gpu.median},
                {"host_total", host.median},
                {"host_plan", plan.median},
                {"host_tree_bookkeeping", book.median},
                {"host_sampling_argmax", samp.median},
                {"forward_wall_minus_gpu", gap.median},
                {"forward_wall", fwd_wall.median}}},
              {"split_p10_p90_us",
               {{"gpu_forward_events", {gpu.p10, gpu.p90}}, {"host_total", {host.p10, host.p90}}}},
              {"host_share_median", host.median / t.median},
              {"gpu_phases_us_median",
               {{"note", "separate run with an event after every launch (StepTiming::kPhases)"},
                {"gpu_total", p_total.median},
                {"attention", p_attn.median},
                {"gemm", p_gemm.median},
                {"other_kernels", p_other.median},
                {"of_which_gpu_sampling", p_sampling.median},
                {"copies_inputs_plan_logits", p_copy.median},
                {"step_wall_with_phase_events", p_wall.median}}},
              {"cuda_graphs",
               {{"on", graphs},
                {"graph_steps", total.graphs.graph_steps},
                {"captures", total.graphs.captures},
              {"capture_and_instantiate_us_mean",
               total.graphs.captures > 0 ? total.graphs.capture_us / total.graphs.captures : 0.0},
                {"eager_steps", total.graphs.eager_steps},
                {"cached_graphs", total.graphs.cached_graphs},
                {"note", "counts over the whole run (prefill chunks and warm-up steps included)"},
                {"greedy_agreement_graphs_vs_eager",
                 {{"same", graph_same},
                  {"compared", graph_all},
                  {"first_differing_step", graph_first_diff}}}}},
              {"sampling", "greedy on the GPU (forward_sampled: kernels/sampling.h, one block per "
                           "row after the LM head); only token ids and logprobs downloaded; "
                           "host_sampling_argmax = reading the tokens"},
          };
          rows.push_back(row);
        }
      }
      // Greedy tokens of DeFT vs the sequence baseline (same weights, same inputs): the fraction
      // of (step, row) argmaxes that agree. Few-shot feeds tokens back, so compare up to the
      // first step where a branch diverged.
      // (Both methods only: --method runs one.)
      int64_t same = 0, all = 0;
      int first_diff = -1;
      if (argmaxes.size() == 2) {
        const auto& a = argmaxes[0];
        const auto& b = argmaxes[1];
        for (size_t s = 0; s < std::min(a.size(), b.size()); ++s) {
          for (size_t r = 0; r < a[s].size() && r < b[s].size(); ++r) {
            ++all;
            same += a[s][r] == b[s][r];
          }
          if (first_diff < 0 && a[s] != b[s]) first_diff = static_cast<int>(s);
          if (!c.spec && first_diff >= 0) break;
        }
        std::printf("%-24s greedy argmax agreement deft_flatten vs sequence: %lld / %lld (first "
                    "differing step %d)\n",
                    c.name.c_str(), static_cast<long long>(same), static_cast<long long>(all),
                    first_diff);
      }
      for (ResultRow& row : rows) {
        if (row.method.empty()) continue;
        if (argmaxes.size() == 2) {
          row.extra["greedy_agreement_with_other_method"] = {
              {"same", same}, {"compared", all}, {"first_differing_step", first_diff}};
        }
        result.add(row);
      }
    }
  }
  std::printf("wrote %s\n", result.write(out).c_str());
  return 0;
}
