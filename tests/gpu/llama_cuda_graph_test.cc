// CUDA graphs of the CUDA runner (models/step_graphs.h): two runners on the same
// weights, one replaying graphs (the default) and one launching eagerly (cuda_graphs = false),
// run the same plans step after step and must agree:
//   - logits of every row within bf16 noise (padding changes the GEMMs' row counts, so cuBLAS
//     may pick other kernels) and identical greedy tokens (a token may differ only where the
//     eager top-1/top-2 margin is below kMarginFactor x the worst logit difference: never seen,
//     counted and printed);
//   - a step run again on the graph runner (uncaptured padded launches, capture, replay: the
//     KV it rewrites is the same) gives the same logits bit for bit;
// on the default model (generic attention kernel) and on tiny random models with head_dim 64 and
// 128 (DeFT kernels) over seeded random trees whose steps span several buckets: decode of every
// leaf, leaves branching, token chains (masked tasks), and a cap of 2 cached graphs (eviction).
// forward_sampled (GPU sampling inside the graph) and the timing modes too.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"
#include "models/llama_cuda.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::NodeId;
using kernels::cuda_device_visible;
using engine::SequenceTree;
using engine::TokenId;
using testing::argmax;
using testing::relative_error;
using testing::RunnerHarness;
using testing::TreeStep;

constexpr double kBf16Bound = 1e-2;
constexpr double kMarginFactor = 4.0;

std::string source_path(const std::string& relative) {
  const char* root = std::getenv("DEFT_SOURCE_DIR");
  return absl::StrCat(root != nullptr ? root : DEFT_SOURCE_DIR, "/", relative);
}

std::vector<std::vector<float>> split_rows(const std::vector<float>& logits, size_t vocab) {
  std::vector<std::vector<float>> rows(logits.size() / vocab);
  for (size_t r = 0; r < rows.size(); ++r) {
    rows[r].assign(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
  }
  return rows;
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double{a[i]} - b[i]));
  return worst;
}

// Top-1 minus top-2 logit.
double top_margin(const std::vector<float>& row) {
  float first = -INFINITY, second = -INFINITY;
  for (float value : row) {
    if (value > first) {
      second = first;
      first = value;
    } else if (value > second) {
      second = value;
    }
  }
  return double{first} - second;
}

struct Agreement {
  int64_t steps = 0, rows = 0, tokens_same = 0, tokens_thin_margin = 0, repeats = 0;
  double worst_relative = 0.0;
};

// Runs each step on both runners with one plan; the eager runner's greedy tokens feed both.
class Lockstep {
 public:
  Lockstep(LlamaCudaRunner& graph, LlamaCudaRunner& eager, engine::PlannerOptions options)
      : graph_(graph), eager_(eager), planner_(options) {}

  // Logits of every row (the eager runner's); `repeat` runs the step twice more on the graph
  // runner and requires bit-identical logits.
  std::vector<std::vector<float>> step(std::span<const TreeStep> parts, bool repeat,
                                       Agreement& agreement, const std::string& where) {
    std::vector<engine::TreeQueries> trees;
    std::vector<TokenId> tokens;
    for (const TreeStep& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
    }
    EXPECT_TRUE(planner_.plan(trees, plan_).ok()) << where;
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    const size_t vocab = static_cast<size_t>(graph_.vocab_size());
    const engine::StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = rows};
    std::vector<float> graph_logits(rows.size() * vocab), eager_logits(rows.size() * vocab);
    EXPECT_TRUE(graph_.forward(batch, graph_logits).ok()) << where;
    EXPECT_TRUE(eager_.forward(batch, eager_logits).ok()) << where;
    for (int again = 0; repeat && again < 2; ++again) {
      std::vector<float> repeated(graph_logits.size());
      EXPECT_TRUE(graph_.forward(batch, repeated).ok()) << where;
      EXPECT_TRUE(repeated == graph_logits) << where << ": run " << again + 2 << " of the step";
      ++agreement.repeats;
    }
    const std::vector<std::vector<float>> graph_rows = split_rows(graph_logits, vocab);
    std::vector<std::vector<float>> eager_rows = split_rows(eager_logits, vocab);
    ++agreement.steps;
    for (size_t r = 0; r < rows.size(); ++r) {
      const double error = relative_error(graph_rows[r], eager_rows[r]);
      agreement.worst_relative = std::max(agreement.worst_relative, error);
      EXPECT_LT(error, kBf16Bound) << where << " row " << r;
      ++agreement.rows;
      if (argmax(graph_rows[r]) == argmax(eager_rows[r])) {
        ++agreement.tokens_same;
      } else if (top_margin(eager_rows[r]) <
                 kMarginFactor * max_abs_difference(graph_rows[r], eager_rows[r])) {
        ++agreement.tokens_thin_margin;
      } else {
        ADD_FAILURE() << where << " row " << r << ": greedy token " << argmax(graph_rows[r])
                      << " with graphs, " << argmax(eager_rows[r]) << " without";
      }
    }
    return eager_rows;
  }

 private:
  LlamaCudaRunner& graph_;
  LlamaCudaRunner& eager_;
  engine::AttentionPlanner planner_;
  engine::AttentionPlan plan_;
};

void print(const char* what, const Agreement& a, const CudaGraphStats& stats) {
  std::printf(
      "[cuda graphs] %s: %lld steps, %lld rows: max relative logit difference graph vs eager "
      "%.3g (bound %.3g), greedy tokens identical %lld / %lld (thin margin %lld), %lld "
      "bit-identical repeats; graph runner: %lld graph steps, %lld captures (%.0f us each), "
      "%lld eager steps, %d cached\n",
      what, static_cast<long long>(a.steps), static_cast<long long>(a.rows), a.worst_relative,
      kBf16Bound, static_cast<long long>(a.tokens_same), static_cast<long long>(a.rows),
      static_cast<long long>(a.tokens_thin_margin), static_cast<long long>(a.repeats),
      static_cast<long long>(stats.graph_steps), static_cast<long long>(stats.captures),
      stats.captures > 0 ? stats.capture_us / stats.captures : 0.0,
      static_cast<long long>(stats.eager_steps), stats.cached_graphs);
}

// Seeded random tree steps: a prompt, then steps where each live leaf decodes one token or a
// chain of 2-4 (causal among themselves: masked tasks), and leaves branch now and then.
void random_tree_steps(Lockstep& lockstep, engine::KvCacheManager& kv, uint32_t seed, int steps,
                       int32_t vocab, Agreement& agreement) {
  std::mt19937 rng(seed);
  const auto token = [&] { return static_cast<TokenId>(3 + rng() % (vocab - 3)); };
  SequenceTree tree(seed, &kv);
  std::vector<TokenId> prompt(20 + rng() % 60);
  for (TokenId& t : prompt) t = token();
  const TreeStep prefill = RunnerHarness::append(tree, tree.root(), prompt);
  std::vector<std::vector<float>> last =
      lockstep.step({&prefill, 1}, true, agreement, absl::StrCat("seed ", seed, " prefill"));
  std::vector<NodeId> leaves = {tree.root()};
  std::vector<TokenId> next = {argmax(last.back())};
  for (int s = 0; s < steps; ++s) {
    // Branch: each leaf splits into 2-3 with probability 1/4 while there are few leaves.
    std::vector<NodeId> new_leaves;
    std::vector<TokenId> new_next;
    for (size_t i = 0; i < leaves.size(); ++i) {
      const int ways = leaves.size() < 24 && rng() % 4 == 0 ? 2 + static_cast<int>(rng() % 2) : 1;
      if (ways == 1) {
        new_leaves.push_back(leaves[i]);
        new_next.push_back(next[i]);
        continue;
      }
      absl::StatusOr<std::vector<NodeId>> children =
          tree.branch(leaves[i], static_cast<int32_t>(ways));
      ASSERT_TRUE(children.ok()) << children.status();
      for (int w = 0; w < ways; ++w) {
        new_leaves.push_back((*children)[w]);
        new_next.push_back(w == 0 ? next[i] : token());
      }
    }
    leaves = new_leaves;
    next = new_next;
    TreeStep step{.tree = &tree};
    std::vector<size_t> last_row(leaves.size());
    for (size_t i = 0; i < leaves.size(); ++i) {
      std::vector<TokenId> run = {next[i]};
      if (rng() % 5 == 0) {
        for (int extra = 1 + static_cast<int>(rng() % 3); extra > 0; --extra)
          run.push_back(token());
      }
      const TreeStep part = RunnerHarness::append(tree, leaves[i], run);
      step.queries.insert(step.queries.end(), part.queries.begin(), part.queries.end());
      step.tokens.insert(step.tokens.end(), part.tokens.begin(), part.tokens.end());
      last_row[i] = step.tokens.size() - 1;
    }
    last =
        lockstep.step({&step, 1}, s % 5 == 0, agreement,
                      absl::StrCat("seed ", seed, " step ", s, " (", step.tokens.size(), " rows)"));
    for (size_t i = 0; i < leaves.size(); ++i) next[i] = argmax(last[last_row[i]]);
  }
}

std::unique_ptr<LlamaCudaRunner> tiny_runner(const testing::TinyLlama& model, int64_t slots,
                                             bool graphs, int32_t max_graphs = 32) {
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> runner =
      LlamaCudaRunner::create(model.config, model.checkpoint,
                              {.num_kv_slots = slots,
                               .max_batch_rows = 512,
                               .cuda_graphs = graphs,
                               .max_cuda_graphs = max_graphs},
                              "tiny");
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? std::move(*runner) : nullptr;
}

TEST(LlamaCudaGraphs, DefaultModelDecodeMatchesEager) {
  DEFT_SKIP_WITHOUT_GPU();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  const std::string dir = source_path("models/default");
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> graph =
      LlamaCudaRunner::load(dir, {.num_kv_slots = kv.num_slots(), .max_batch_rows = 512});
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> eager = LlamaCudaRunner::load(
      dir, {.num_kv_slots = kv.num_slots(), .max_batch_rows = 512, .cuda_graphs = false});
  ASSERT_TRUE(eager.ok()) << eager.status();
  Lockstep lockstep(**graph, **eager, {.kind = engine::PlanKind::kDeftFlatten});
  Agreement agreement;
  for (uint32_t seed : {1u, 2u}) {
    random_tree_steps(lockstep, kv, seed, 24, (*graph)->vocab_size(), agreement);
  }
  const CudaGraphStats& stats = (*graph)->cuda_graph_stats();
  print("default model (generic attention)", agreement, stats);
  EXPECT_GT(stats.captures, 2);
  EXPECT_GT(stats.graph_steps, stats.eager_steps);
  EXPECT_EQ((*eager)->cuda_graph_stats().graph_steps, 0);
}

TEST(LlamaCudaGraphs, RandomTreesDeftKernelsMatchEager) {
  DEFT_SKIP_WITHOUT_GPU();
  for (int head_dim : {64, 128}) {
    const testing::TinyLlama model =
        testing::make_tiny_deft_llama(head_dim, static_cast<uint64_t>(head_dim));
    engine::KvCacheManager kv({.page_tokens = 8, .num_pages = 1024});
    // The graph runner keeps 2 graphs at most: buckets are evicted and captured again.
    for (int32_t max_graphs : {32, 2}) {
      std::unique_ptr<LlamaCudaRunner> graph = tiny_runner(model, kv.num_slots(), true, max_graphs);
      std::unique_ptr<LlamaCudaRunner> eager = tiny_runner(model, kv.num_slots(), false);
      ASSERT_NE(graph, nullptr);
      ASSERT_NE(eager, nullptr);
      ASSERT_TRUE(graph->uses_deft_kernels());
      Lockstep lockstep(*graph, *eager,
                        {.kind = engine::PlanKind::kDeftFlatten, .chunk_tokens = 16});
      Agreement agreement;
      for (uint32_t seed : {11u, 12u, 13u}) {
        random_tree_steps(lockstep, kv, seed + static_cast<uint32_t>(head_dim), 20, 300, agreement);
      }
      const CudaGraphStats& stats = graph->cuda_graph_stats();
      print(absl::StrCat("tiny head_dim ", head_dim, " (DeFT kernels), max ", max_graphs, " graphs")
                .c_str(),
            agreement, stats);
      EXPECT_GT(stats.captures, 2);
      EXPECT_GT(stats.graph_steps, 0);
      EXPECT_LE(stats.cached_graphs, max_graphs);
    }
  }
}

// GPU sampling inside the graph: greedy tokens and logprobs as without graphs; seeded
// temperature sampling too (the same uniform; the logits differ by bf16 noise at most).
TEST(LlamaCudaGraphs, ForwardSampledMatchesEager) {
  DEFT_SKIP_WITHOUT_GPU();
  const testing::TinyLlama model = testing::make_tiny_deft_llama(128, 5);
  engine::KvCacheManager kv({.page_tokens = 8, .num_pages = 256});
  std::unique_ptr<LlamaCudaRunner> graph = tiny_runner(model, kv.num_slots(), true);
  std::unique_ptr<LlamaCudaRunner> eager = tiny_runner(model, kv.num_slots(), false);
  ASSERT_NE(graph, nullptr);
  ASSERT_NE(eager, nullptr);
  engine::AttentionPlanner planner({.kind = engine::PlanKind::kDeftFlatten, .chunk_tokens = 16});
  engine::AttentionPlan plan;
  SequenceTree tree(1, &kv);
  std::vector<TokenId> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(3 + i * 7 % 290);
  const TreeStep prefill = RunnerHarness::append(tree, tree.root(), prompt);
  {
    const std::vector<engine::TreeQueries> input = {{&tree, prefill.queries}};
    ASSERT_TRUE(planner.plan(input, plan).ok());
    const engine::StepBatch batch{.plan = &plan, .tokens = prefill.tokens, .logit_rows = {}};
    ASSERT_TRUE(graph->forward(batch, {}).ok());
    ASSERT_TRUE(eager->forward(batch, {}).ok());
  }
  const int32_t branches = 6;
  const std::vector<NodeId> leaves = *tree.branch(tree.root(), branches);
  engine::SamplingParams greedy{.temperature = 0.0f, .top_logprobs = 3};
  engine::SamplingParams draw{.temperature = 0.8f, .top_k = 40, .seed = 99, .top_logprobs = 2};
  std::vector<TokenId> next = {5, 6, 7, 8, 9, 10};
  int64_t same = 0, compared = 0;
  double worst_logprob = 0.0;
  for (int s = 0; s < 12; ++s) {
    std::vector<engine::QueryToken> queries;
    for (int32_t b = 0; b < branches; ++b) {
      queries.push_back(RunnerHarness::append(tree, leaves[b], {&next[b], 1}).queries[0]);
    }
    const std::vector<engine::TreeQueries> input = {{&tree, queries}};
    ASSERT_TRUE(planner.plan(input, plan).ok());
    std::vector<int32_t> rows(branches);
    std::vector<engine::RowSampling> sampling(branches);
    for (int32_t b = 0; b < branches; ++b) {
      rows[b] = b;
      // Steps 6+ draw on odd branches (the workspace appears: the graph is captured again).
      sampling[b] = {.params = s >= 6 && b % 2 == 1 ? &draw : &greedy,
                     .step = static_cast<uint64_t>(s)};
    }
    const engine::StepBatch batch{.plan = &plan, .tokens = next, .logit_rows = rows};
    std::vector<engine::SampledToken> ours(branches), theirs(branches);
    ASSERT_TRUE(graph->forward_sampled(batch, sampling, ours).ok());
    ASSERT_TRUE(eager->forward_sampled(batch, sampling, theirs).ok());
    for (int32_t b = 0; b < branches; ++b) {
      ++compared;
      same += ours[b].token == theirs[b].token;
      // A seeded draw may move to a neighbouring token only where the uniform lies within bf16
      // noise of a cumulative-mass boundary: counted below, at most one allowed.
      if (sampling[b].params == &greedy) {
        EXPECT_EQ(ours[b].token, theirs[b].token) << "step " << s << " branch " << b;
      }
      if (ours[b].token == theirs[b].token) {
        worst_logprob =
            std::max(worst_logprob, std::abs(double{ours[b].logprob} - theirs[b].logprob));
      }
      EXPECT_EQ(ours[b].top_logprobs.size(), theirs[b].top_logprobs.size());
      next[b] = theirs[b].token;
    }
  }
  EXPECT_GE(same, compared - 1);
  EXPECT_LT(worst_logprob, 0.05);
  const CudaGraphStats& stats = graph->cuda_graph_stats();
  EXPECT_GE(stats.captures, 2);
  EXPECT_GT(stats.graph_steps, 0);
  std::printf(
      "[cuda graphs] forward_sampled (greedy and seeded draws): %lld / %lld tokens identical, max "
      "|logprob difference| "
      "%.3g; %lld graph steps, %lld captures\n",
      static_cast<long long>(same), static_cast<long long>(compared), worst_logprob,
      static_cast<long long>(stats.graph_steps), static_cast<long long>(stats.captures));
}

// kTotal times graph steps; kPhases runs eagerly; set_cuda_graphs(false) stops replays.
TEST(LlamaCudaGraphs, TimingModesAndSwitch) {
  DEFT_SKIP_WITHOUT_GPU();
  const testing::TinyLlama model = testing::make_tiny_deft_llama(64, 9);
  engine::KvCacheManager kv({.page_tokens = 8, .num_pages = 64});
  std::unique_ptr<LlamaCudaRunner> runner = tiny_runner(model, kv.num_slots(), true);
  ASSERT_NE(runner, nullptr);
  engine::AttentionPlanner planner({.kind = engine::PlanKind::kDeftFlatten});
  engine::AttentionPlan plan;
  SequenceTree tree(1, &kv);
  std::vector<TokenId> tokens = {5, 6, 7, 8};
  const TreeStep part = RunnerHarness::append(tree, tree.root(), tokens);
  const std::vector<engine::TreeQueries> input = {{&tree, part.queries}};
  ASSERT_TRUE(planner.plan(input, plan).ok());
  const std::vector<int32_t> rows = {3};
  const engine::StepBatch batch{.plan = &plan, .tokens = tokens, .logit_rows = rows};
  std::vector<float> logits(300);
  runner->set_step_timing(StepTiming::kTotal);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(runner->forward(batch, logits).ok());
  EXPECT_EQ(runner->cuda_graph_stats().graph_steps, 2);
  EXPECT_TRUE(runner->last_step_times().valid);
  EXPECT_GT(runner->last_step_times().total_ms, 0.0);
  runner->set_step_timing(StepTiming::kPhases);
  ASSERT_TRUE(runner->forward(batch, logits).ok());
  EXPECT_EQ(runner->cuda_graph_stats().graph_steps, 2);
  EXPECT_TRUE(runner->last_step_times().valid);
  EXPECT_GT(runner->last_step_times().attention_ms, 0.0);
  runner->set_step_timing(StepTiming::kOff);
  runner->set_cuda_graphs(false);
  ASSERT_TRUE(runner->forward(batch, logits).ok());
  EXPECT_EQ(runner->cuda_graph_stats().graph_steps, 2);
  EXPECT_EQ(runner->cuda_graph_stats().cached_graphs, 0);
  runner->set_cuda_graphs(true);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(runner->forward(batch, logits).ok());
  EXPECT_EQ(runner->cuda_graph_stats().graph_steps, 3);
}

}  // namespace
}  // namespace deft::models
