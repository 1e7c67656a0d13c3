// Planning time per step on one core (Google Benchmark), for every plan kind, on:
// few-shot (prompt 4000, b = 50, suffixes 400), speculative decoding (prefix 6000 + the 256-token
// Medusa tree) and the largest step of each reasoning workload. Target: < 50 us per step.
// Also the tree bookkeeping of a speculative-decoding step (method "bookkeeping": hang the
// 64-token Medusa tree under a 6000-token prefix, then commit the trace's accepted tokens and
// prune the rest; 20000 steps in a row, as a long session runs them), cold, and with the step's
// planning ("step_cold").
// Writes bench/results/planner-cpu-<date>.json, or into DIR with --out DIR (other flags are Google
// Benchmark's, e.g. --benchmark_filter).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench_result.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"

namespace deft::bench {
namespace {

using engine::AttentionPlan;
using engine::AttentionPlanner;
using engine::KvCacheManager;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TreeQueries;

// One step's topology, kept alive for the benchmark.
struct Snapshot {
  std::string name;
  std::unique_ptr<KvCacheManager> kv;
  std::unique_ptr<SequenceTree> tree;
  std::vector<QueryToken> queries;
};

Snapshot fewshot(int prompt, int branches, int suffix) {
  Snapshot s{"fewshot_p" + std::to_string(prompt) + "_b" + std::to_string(branches) + "_s" +
                 std::to_string(suffix),
             std::make_unique<KvCacheManager>(engine::KvCacheConfig{.num_pages = 1 << 14}), nullptr,
             {}};
  s.tree = std::make_unique<SequenceTree>(0, s.kv.get());
  (void)s.tree->append(0, std::vector<engine::TokenId>(prompt, 1));
  const std::vector<engine::NodeId> leaves = s.tree->branch(0, branches).value();
  for (engine::NodeId leaf : leaves) {
    (void)s.tree->append(leaf, std::vector<engine::TokenId>(suffix, 2));
    s.queries.push_back({leaf, suffix - 1});
  }
  return s;
}

Snapshot specdec(int prefix, int tree_size, const SpecDecTrace& trace) {
  Snapshot s{"specdec_p" + std::to_string(prefix) + "_t" + std::to_string(tree_size),
             std::make_unique<KvCacheManager>(engine::KvCacheConfig{.num_pages = 1 << 14}), nullptr,
             {}};
  s.tree = std::make_unique<SequenceTree>(0, s.kv.get());
  SpecDecReplay replay(trace, *s.tree, prefix);
  replay.build_token_tree(s.queries);
  return s;
}

// Replays a reasoning trace and keeps the step with the most tree tokens.
Snapshot largest_reasoning_step(const std::string& name, const ReasoningTrace& trace) {
  int32_t best_iteration = 0;
  int64_t best_tokens = -1;
  {
    KvCacheManager kv({.num_pages = 1 << 16});
    SequenceTree tree(0, &kv);
    ReasoningReplay replay(trace, tree);
    std::vector<QueryToken> queries;
    while (replay.step(queries)) {
      if (tree.total_tokens() > best_tokens) {
        best_tokens = tree.total_tokens();
        best_iteration = replay.iteration();
      }
    }
  }
  Snapshot s{name, std::make_unique<KvCacheManager>(engine::KvCacheConfig{.num_pages = 1 << 16}),
             nullptr, {}};
  s.tree = std::make_unique<SequenceTree>(0, s.kv.get());
  ReasoningReplay replay(trace, *s.tree);
  while (replay.step(s.queries) && replay.iteration() < best_iteration) {
  }
  return s;
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  // --out DIR (taken out of argv before Google Benchmark reads its own flags).
  std::string out_dir;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--out") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "--out needs a directory\n");
        return 1;
      }
      out_dir = argv[++i];
      continue;
    }
    argv[kept++] = argv[i];
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  std::vector<Snapshot> snapshots;
  snapshots.push_back(fewshot(4000, 50, 400));
  const std::string workloads = DEFT_WORKLOADS_DIR;
  if (auto trace = load_specdec_trace(workloads + "/speculative_decoding/apps_tree_size256.json");
      trace.ok()) {
    snapshots.push_back(specdec(6000, 256, *trace));
  } else {
    std::fprintf(stderr, "skipping speculative decoding: %s\n", trace.status().ToString().c_str());
  }
  for (const char* name : {"sorting128ToT", "docmergeToT", "keywordToT", "set128ToT"}) {
    auto traces = load_reasoning_traces(workloads + "/reasoning/" + name + ".json");
    if (!traces.ok() || traces->empty()) {
      std::fprintf(stderr, "skipping %s: workload not found\n", name);
      continue;
    }
    snapshots.push_back(largest_reasoning_step(name, traces->front()));
  }

  struct Job {
    const Snapshot* snapshot;
    PlanKind kind;
    std::vector<double> samples_us;
    engine::PlanIo io;
  };
  std::vector<std::unique_ptr<Job>> jobs;
  for (const Snapshot& s : snapshots) {
    for (PlanKind kind : {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                          PlanKind::kSequence, PlanKind::kDenseMask}) {
      jobs.push_back(std::make_unique<Job>(Job{&s, kind, {}, {}}));
      Job* job = jobs.back().get();
      const std::string name = s.name + "/" + std::string(engine::plan_kind_name(kind));
      benchmark::RegisterBenchmark(name.c_str(), [job](benchmark::State& state) {
        AttentionPlanner planner({.kind = job->kind, .chunk_tokens = 128, .max_unmasked_queries = 256});
        AttentionPlan plan;
        std::vector<TreeQueries> input = {{job->snapshot->tree.get(), job->snapshot->queries}};
        (void)planner.plan(input, plan);  // warm-up: buffers reach their size
        for (auto _ : state) {
          const auto start = std::chrono::steady_clock::now();
          if (!planner.plan(input, plan).ok()) state.SkipWithError("planning failed");
          benchmark::DoNotOptimize(plan.kv_slots.data());
          const auto stop = std::chrono::steady_clock::now();
          job->samples_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
        }
        job->io = plan.io;
        state.counters["kv_tokens"] = static_cast<double>(plan.io.kv_tokens_read);
        state.counters["queries"] = static_cast<double>(plan.num_queries);
      })->Unit(benchmark::kMicrosecond)->MinTime(0.2);
    }
  }
  // Tree bookkeeping of speculative steps, one after another on one tree: back to back (warm
  // caches), and with the caches swept before each step ("cold": in a decode loop the host
  // waits ~7 ms for the GPU between two steps' bookkeeping, and the device's host measured it
  // 3-7x slower than the back-to-back figure). "step_cold" also plans each step (DeFT-Flatten,
  // adaptive B, the H100's stage-1 wave for Llama-3-8B: 396 CTAs, 8 KV heads, group 4): the host
  // work of e2e_step_bench's speculative step before the GPU's.
  struct SpecVariant {
    const char* method;
    bool cold, plan;
    int iterations;
    const char* what;
  };
  static const SpecVariant kSpecVariants[] = {
      {"bookkeeping", false, false, 20000,
       "SpecDecReplay::build_token_tree + commit per step, 20000 steps on one tree"},
      {"bookkeeping_cold", true, false, 1000,
       "SpecDecReplay::build_token_tree + commit per step, 1000 steps on one tree, 64 MiB swept "
       "(untimed) before each"},
      {"step_cold", true, true, 1000,
       "build_token_tree + DeFT-Flatten plan (adaptive B, wave 396 / 8 / 4) + commit per step, "
       "1000 steps on one tree, 64 MiB swept (untimed) before each"}};
  std::vector<std::vector<double>> spec_samples(std::size(kSpecVariants));
  if (auto trace = load_specdec_trace(workloads + "/speculative_decoding/apps_tree_size64.json");
      trace.ok()) {
    for (size_t v = 0; v < std::size(kSpecVariants); ++v) {
      const SpecVariant variant = kSpecVariants[v];
      std::vector<double>& samples = spec_samples[v];
      benchmark::RegisterBenchmark(
          (std::string("specdec_p6000_t64/") + variant.method).c_str(),
          [trace = *trace, variant, &samples](benchmark::State& state) {
            KvCacheManager kv({.num_pages = 1 << 16});
            SequenceTree tree(0, &kv);
            SpecDecReplay replay(trace, tree, 6000);
            const std::vector<int32_t>& accept = trace.accept_lengths.at(0);
            std::vector<QueryToken> queries;
            AttentionPlanner planner({.wave = {.ctas = 396, .kv_heads = 8, .group_size = 4}});
            AttentionPlan plan;
            std::vector<char> sweep(variant.cold ? size_t{64} << 20 : 0);
            size_t step = 0;
            for (auto _ : state) {
              if (variant.cold) {
                state.PauseTiming();
                for (size_t i = 0; i < sweep.size(); i += 64) sweep[i] = static_cast<char>(i + step);
                benchmark::ClobberMemory();
                state.ResumeTiming();
              }
              const auto start = std::chrono::steady_clock::now();
              replay.build_token_tree(queries);
              if (variant.plan) {
                const std::vector<TreeQueries> input = {{&tree, queries}};
                if (!planner.plan(input, plan).ok()) state.SkipWithError("planning failed");
                benchmark::DoNotOptimize(plan.kv_slots.data());
              }
              replay.commit(std::max(1, accept[step++ % accept.size()]));
              const auto stop = std::chrono::steady_clock::now();
              if (!replay.status().ok()) state.SkipWithError(replay.status().ToString().c_str());
              samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
            }
          })
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(variant.iterations);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // Nothing timed (--benchmark_list_tests, a filter that matches nothing): leave the committed
  // results file alone.
  const bool any_samples = std::any_of(spec_samples.begin(), spec_samples.end(),
                                       [](const auto& samples) { return !samples.empty(); }) ||
                           std::any_of(jobs.begin(), jobs.end(), [](const auto& job) {
                             return !job->samples_us.empty();
                           });
  if (!any_samples) {
    std::printf("nothing was timed; no results file written\n");
    return 0;
  }

  BenchResult result("planner", BenchResult::cpu_name() + " (one core)", "cpu", argc, argv);
  for (const auto& job : jobs) {
    if (job->samples_us.empty()) continue;
    Samples stats = summarize(job->samples_us);
    ResultRow row;
    row.case_name = job->snapshot->name;
    row.method = engine::plan_kind_name(job->kind);
    row.set_times(stats);
    row.repetitions = static_cast<int64_t>(job->samples_us.size());
    row.extra = {{"tree_kv_tokens", job->snapshot->tree->total_tokens()},
                 {"queries", job->snapshot->queries.size()},
                 {"kv_tokens_read", job->io.kv_tokens_read},
                 {"tasks", job->io.tasks},
                 {"entries", job->io.query_chunk_pairs},
                 {"mask_words", job->io.mask_words},
                 {"chunk_tokens", 128},
                 {"target_us", 50}};
    result.add(row);
  }
  for (size_t v = 0; v < std::size(kSpecVariants); ++v) {
    const std::vector<double>& samples = spec_samples[v];
    if (samples.empty()) continue;
    Samples stats = summarize(samples);
    ResultRow row;
    row.case_name = "specdec_p6000_t64";
    row.method = kSpecVariants[v].method;
    row.set_times(stats);
    row.repetitions = static_cast<int64_t>(samples.size());
    row.extra = {{"what", kSpecVariants[v].what}, {"tree_tokens", 64}};
    result.add(row);
  }
  std::printf("wrote %s\n", result.write(out_dir).c_str());
  return 0;
}
