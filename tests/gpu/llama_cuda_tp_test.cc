// Tensor parallelism of the CUDA runner (LlamaCudaRunner::create_tensor_parallel over NCCL) on a
// machine with two GPUs or more (skipped otherwise): a TP 2 runner and a TP 1 runner on the same
// checkpoint run the same plans step after step and must agree
//   - logits of every row within kBf16Bound (both round activations to bf16; TP 2 sums the O and
//     down partials in another order and its GEMMs have other shapes, so cuBLAS may pick other
//     kernels), greedy tokens identical except where TP 1's top-1/top-2 margin is below
//     kMarginFactor x the row's worst logit difference (counted and printed);
//   - a TP 2 step run again gives the same logits bit for bit (graph replay with its NCCL calls);
// on tiny random models with head_dim 64 and 128 (DeFT kernels; one with a vocabulary that does
// not split evenly, one Qwen2 with q/k/v bias) and on the transformers goldens, over seeded random
// trees (decode of every leaf, branching, token chains); tree decoding at TP 2 equals each branch
// decoded alone; forward_sampled's greedy tokens equal TP 1's; a model whose KV heads do not
// split is refused.
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
#include "models/tensor_parallel_runner.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::NodeId;
using engine::SequenceTree;
using engine::TokenId;
using testing::argmax;
using testing::relative_error;
using testing::RunnerHarness;
using testing::TreeStep;

constexpr double kBf16Bound = 1e-2;
constexpr double kMarginFactor = 4.0;
const std::vector<int> kTwoGpus = {0, 1};

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

#define DEFT_SKIP_WITHOUT_TWO_GPUS()                                                       \
  if (!LlamaCudaRunner::tensor_parallel_available()) GTEST_SKIP() << "built without NCCL"; \
  if (visible_gpus() < 2) GTEST_SKIP() << "tensor parallel tests need 2 CUDA devices"

std::string source_path(const std::string& relative) {
  const char* root = std::getenv("DEFT_SOURCE_DIR");
  return absl::StrCat(root != nullptr ? root : DEFT_SOURCE_DIR, "/", relative);
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double{a[i]} - b[i]));
  return worst;
}

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

// Runs each step on both runners with one plan; TP 1's greedy tokens feed both.
class Lockstep {
 public:
  Lockstep(engine::ModelRunner& sharded, engine::ModelRunner& whole)
      : sharded_(sharded), whole_(whole), planner_({.kind = engine::PlanKind::kDeftFlatten}) {}

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
    const size_t vocab = static_cast<size_t>(whole_.vocab_size());
    const engine::StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = rows};
    std::vector<float> sharded_logits(rows.size() * vocab), whole_logits(rows.size() * vocab);
    EXPECT_TRUE(sharded_.forward(batch, sharded_logits).ok()) << where;
    EXPECT_TRUE(whole_.forward(batch, whole_logits).ok()) << where;
    for (int again = 0; repeat && again < 2; ++again) {
      std::vector<float> repeated(sharded_logits.size());
      EXPECT_TRUE(sharded_.forward(batch, repeated).ok()) << where;
      EXPECT_TRUE(repeated == sharded_logits) << where << ": TP run " << again + 2;
      ++agreement.repeats;
    }
    std::vector<std::vector<float>> whole_rows(rows.size());
    ++agreement.steps;
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<float> sharded_row(sharded_logits.begin() + r * vocab,
                                           sharded_logits.begin() + (r + 1) * vocab);
      whole_rows[r].assign(whole_logits.begin() + r * vocab,
                           whole_logits.begin() + (r + 1) * vocab);
      const double error = relative_error(sharded_row, whole_rows[r]);
      agreement.worst_relative = std::max(agreement.worst_relative, error);
      EXPECT_LT(error, kBf16Bound) << where << " row " << r;
      ++agreement.rows;
      if (argmax(sharded_row) == argmax(whole_rows[r])) {
        ++agreement.tokens_same;
      } else if (top_margin(whole_rows[r]) <
                 kMarginFactor * max_abs_difference(sharded_row, whole_rows[r])) {
        ++agreement.tokens_thin_margin;
      } else {
        ADD_FAILURE() << where << " row " << r << ": greedy token " << argmax(sharded_row)
                      << " at TP 2, " << argmax(whole_rows[r]) << " at TP 1";
      }
    }
    return whole_rows;
  }

 private:
  engine::ModelRunner& sharded_;
  engine::ModelRunner& whole_;
  engine::AttentionPlanner planner_;
  engine::AttentionPlan plan_;
};

// Rank 0's runner of a TP runner (its graph statistics).
LlamaCudaRunner& rank0(engine::ModelRunner& runner) {
  return dynamic_cast<LlamaCudaRunner&>(dynamic_cast<TensorParallelRunner&>(runner).rank(0));
}

void print(const std::string& what, const Agreement& a, engine::ModelRunner& sharded) {
  const CudaGraphStats& stats = rank0(sharded).cuda_graph_stats();
  std::printf(
      "[tensor parallel] %s: %lld steps, %lld rows: max relative logit difference TP 2 vs TP 1 "
      "%.3g (bound %.3g), greedy tokens identical %lld / %lld (thin margin %lld), %lld "
      "bit-identical repeats; rank 0: %lld graph steps, %lld captures, %lld eager steps\n",
      what.c_str(), static_cast<long long>(a.steps), static_cast<long long>(a.rows),
      a.worst_relative, kBf16Bound, static_cast<long long>(a.tokens_same),
      static_cast<long long>(a.rows), static_cast<long long>(a.tokens_thin_margin),
      static_cast<long long>(a.repeats), static_cast<long long>(stats.graph_steps),
      static_cast<long long>(stats.captures), static_cast<long long>(stats.eager_steps));
}

// Seeded random tree steps: a prompt, then steps where each live leaf decodes one token or a
// chain of 2-4, and leaves branch now and then (as tests/gpu/llama_cuda_graph_test.cc).
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

LlamaCudaOptions options(int64_t slots) { return {.num_kv_slots = slots, .max_batch_rows = 512}; }

struct Pair {
  std::unique_ptr<engine::ModelRunner> sharded, whole;
};

Pair make_pair(const testing::TinyLlama& model, int64_t slots) {
  Pair pair;
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> sharded =
      LlamaCudaRunner::create_tensor_parallel(model.config, model.checkpoint, options(slots),
                                              kTwoGpus, "tiny");
  EXPECT_TRUE(sharded.ok()) << sharded.status();
  if (sharded.ok()) pair.sharded = std::move(*sharded);
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> whole =
      LlamaCudaRunner::create(model.config, model.checkpoint, options(slots), "tiny");
  EXPECT_TRUE(whole.ok()) << whole.status();
  if (whole.ok()) pair.whole = std::move(*whole);
  return pair;
}

Pair load_pair(const std::string& dir, int64_t slots) {
  Pair pair;
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> sharded =
      LlamaCudaRunner::load_tensor_parallel(dir, options(slots), kTwoGpus);
  EXPECT_TRUE(sharded.ok()) << sharded.status();
  if (sharded.ok()) pair.sharded = std::move(*sharded);
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> whole =
      LlamaCudaRunner::load(dir, options(slots));
  EXPECT_TRUE(whole.ok()) << whole.status();
  if (whole.ok()) pair.whole = std::move(*whole);
  return pair;
}

void compare_on_random_trees(Pair& pair, engine::KvCacheManager& kv, const std::string& what) {
  ASSERT_NE(pair.sharded, nullptr);
  ASSERT_NE(pair.whole, nullptr);
  Lockstep lockstep(*pair.sharded, *pair.whole);
  Agreement agreement;
  for (uint32_t seed : {1u, 2u}) {
    random_tree_steps(lockstep, kv, seed, 20, pair.whole->vocab_size(), agreement);
  }
  print(what, agreement, *pair.sharded);
  // Decode steps replayed graphs holding the NCCL calls.
  EXPECT_GT(rank0(*pair.sharded).cuda_graph_stats().captures, 0);
  EXPECT_GT(rank0(*pair.sharded).cuda_graph_stats().graph_steps, 0);
}

TEST(LlamaCudaTensorParallel, RefusesKvHeadsThatDoNotSplit) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  const testing::TinyLlama model =
      testing::make_tiny_llama({.hidden = 256, .heads = 8, .kv_heads = 1, .head_dim = 64});
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> runner =
      LlamaCudaRunner::create_tensor_parallel(model.config, model.checkpoint, options(256),
                                              kTwoGpus);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(runner.status().message().find("1 KV heads do not split over 2 ranks"),
            std::string::npos)
      << runner.status();
  const std::vector<int> twice = {0, 0};
  const testing::TinyLlama even = testing::make_tiny_deft_llama(64, 1);
  runner =
      LlamaCudaRunner::create_tensor_parallel(even.config, even.checkpoint, options(256), twice);
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument) << runner.status();
}

struct TinyCase {
  std::string name;
  testing::TinyLlamaSpec spec;
};

class LlamaCudaTpTinyTest : public ::testing::TestWithParam<TinyCase> {};

TEST_P(LlamaCudaTpTinyTest, RandomTreesMatchOneRank) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  const testing::TinyLlama model = testing::make_tiny_llama(GetParam().spec);
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  Pair pair = make_pair(model, kv.num_slots());
  compare_on_random_trees(pair, kv, GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Models, LlamaCudaTpTinyTest,
                         ::testing::Values(TinyCase{"deft_hd64",
                                                    {.hidden = 256,
                                                     .heads = 8,
                                                     .kv_heads = 2,
                                                     .head_dim = 64,
                                                     .intermediate = 512,
                                                     .vocab = 300,
                                                     .seed = 11}},
                                           TinyCase{"deft_hd128_odd_vocab",
                                                    {.hidden = 256,
                                                     .heads = 8,
                                                     .kv_heads = 2,
                                                     .head_dim = 128,
                                                     .intermediate = 512,
                                                     .vocab = 301,
                                                     .seed = 12}},
                                           TinyCase{"qwen2_bias_hd64_tied",
                                                    {.architecture = "Qwen2ForCausalLM",
                                                     .hidden = 256,
                                                     .heads = 8,
                                                     .kv_heads = 4,
                                                     .head_dim = 64,
                                                     .intermediate = 512,
                                                     .vocab = 300,
                                                     .bias = true,
                                                     .tie = true,
                                                     .seed = 13}}),
                         [](const ::testing::TestParamInfo<TinyCase>& info) {
                           return info.param.name;
                         });

class LlamaCudaTpGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCudaTpGoldenTest, RandomTreesMatchOneRank) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  Pair pair = load_pair(source_path("tests/models/golden/" + GetParam()), kv.num_slots());
  compare_on_random_trees(pair, kv, "golden " + GetParam());
}

INSTANTIATE_TEST_SUITE_P(Goldens, LlamaCudaTpGoldenTest,
                         ::testing::Values("llama2", "llama3", "mistral", "qwen2"));

// Three branches decoded in one tree step at TP 2 equal each branch run alone (its own tree).
TEST(LlamaCudaTensorParallel, TreeDecodingEqualsEachBranchAlone) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  const testing::TinyLlama model = testing::make_tiny_deft_llama(128, 21);
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> runner =
      LlamaCudaRunner::create_tensor_parallel(model.config, model.checkpoint,
                                              options(kv.num_slots()), kTwoGpus, "tiny");
  ASSERT_TRUE(runner.ok()) << runner.status();
  const std::vector<TokenId> prompt = {5, 17, 3, 44, 9, 61, 2, 99, 150, 7, 8, 200};
  const std::vector<std::vector<TokenId>> branches = {{10, 11, 12}, {20, 21}, {30, 31, 32, 33}};
  engine::AttentionPlanner planner({.kind = engine::PlanKind::kDeftFlatten, .chunk_tokens = 8});
  engine::AttentionPlan plan;
  const size_t vocab = static_cast<size_t>((*runner)->vocab_size());
  const auto run = [&](std::span<const TreeStep> parts) {
    std::vector<engine::TreeQueries> trees;
    std::vector<TokenId> tokens;
    for (const TreeStep& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
    }
    EXPECT_TRUE(planner.plan(trees, plan).ok());
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    std::vector<float> logits(rows.size() * vocab);
    EXPECT_TRUE(
        (*runner)->forward({.plan = &plan, .tokens = tokens, .logit_rows = rows}, logits).ok());
    return logits;
  };
  // Together: the prompt, then every branch in one step.
  SequenceTree tree(1, &kv);
  const TreeStep prefill = RunnerHarness::append(tree, tree.root(), prompt);
  run({&prefill, 1});
  const std::vector<NodeId> children = *tree.branch(tree.root(), 3);
  std::vector<TreeStep> parts;
  for (size_t b = 0; b < branches.size(); ++b) {
    parts.push_back(RunnerHarness::append(tree, children[b], branches[b]));
  }
  const std::vector<float> together = run(parts);
  // Alone: each branch its own tree (prompt, then the branch's tokens).
  double worst = 0.0;
  size_t row = 0;
  for (size_t b = 0; b < branches.size(); ++b) {
    SequenceTree alone(static_cast<uint32_t>(10 + b), &kv);
    const TreeStep own_prefill = RunnerHarness::append(alone, alone.root(), prompt);
    run({&own_prefill, 1});
    const TreeStep own = RunnerHarness::append(alone, alone.root(), branches[b]);
    const std::vector<float> logits = run({&own, 1});
    for (size_t i = 0; i < branches[b].size(); ++i, ++row) {
      const std::vector<float> a(together.begin() + row * vocab,
                                 together.begin() + (row + 1) * vocab);
      const std::vector<float> c(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
      const double error = relative_error(a, c);
      worst = std::max(worst, error);
      EXPECT_LT(error, kBf16Bound) << "branch " << b << " token " << i;
      EXPECT_EQ(argmax(a), argmax(c)) << "branch " << b << " token " << i;
    }
  }
  std::printf(
      "[tensor parallel] tree decoding vs each branch alone at TP 2: max relative logit "
      "difference %.3g\n",
      worst);
}

// The residual all-reduce on the peer kernel (kernels/peer_all_reduce.h, the default) and on NCCL
// give the same logits bit for bit at two ranks (one float addition either way); GEMMs on cuBLAS's
// default algorithms on both, so timing-based tuning picks nothing different.
TEST(LlamaCudaTensorParallel, PeerAllReduceEqualsNccl) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  const testing::TinyLlama model = testing::make_tiny_deft_llama(128, 31);
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  LlamaCudaOptions peer_options = options(kv.num_slots());
  peer_options.tune_gemms = false;
  LlamaCudaOptions nccl_options = peer_options;
  nccl_options.peer_all_reduce = false;
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> peer =
      LlamaCudaRunner::create_tensor_parallel(model.config, model.checkpoint, peer_options,
                                              kTwoGpus, "peer");
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> nccl =
      LlamaCudaRunner::create_tensor_parallel(model.config, model.checkpoint, nccl_options,
                                              kTwoGpus, "nccl");
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  engine::AttentionPlanner planner({.kind = engine::PlanKind::kDeftFlatten});
  engine::AttentionPlan plan;
  SequenceTree tree(1, &kv);
  std::vector<TokenId> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(3 + 7 * i % 290);
  std::vector<TreeStep> parts = {RunnerHarness::append(tree, tree.root(), prompt)};
  const std::vector<NodeId> leaves = *tree.branch(tree.root(), 4);
  int compared = 0;
  for (int s = 0; s < 12; ++s) {
    std::vector<engine::TreeQueries> trees;
    std::vector<TokenId> tokens;
    for (const TreeStep& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
    }
    ASSERT_TRUE(planner.plan(trees, plan).ok());
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    const size_t vocab = static_cast<size_t>((*peer)->vocab_size());
    std::vector<float> a(rows.size() * vocab), b(rows.size() * vocab);
    const engine::StepBatch batch{.plan = &plan, .tokens = tokens, .logit_rows = rows};
    ASSERT_TRUE((*peer)->forward(batch, a).ok());
    ASSERT_TRUE((*nccl)->forward(batch, b).ok());
    EXPECT_TRUE(a == b) << "step " << s;
    ++compared;
    parts.clear();
    for (size_t l = 0; l < leaves.size(); ++l) {
      const TokenId next =
          static_cast<TokenId>((argmax(std::vector<float>(a.begin() + (rows.size() - 1) * vocab,
                                                          a.begin() + rows.size() * vocab)) +
                                l) %
                               vocab);
      parts.push_back(RunnerHarness::append(tree, leaves[l], {&next, 1}));
    }
  }
  EXPECT_GT(rank0(**peer).cuda_graph_stats().graph_steps, 0);
  std::printf("[tensor parallel] peer all-reduce vs NCCL: %d steps, logits bit-identical\n",
              compared);
}

// forward_sampled (rank 0 samples on its GPU after the all-gather) against TP 1: greedy decode of
// the default model, token for token while TP 1's margin allows, logprobs close.
TEST(LlamaCudaTensorParallel, SampledGreedyDecodeMatchesOneRank) {
  DEFT_SKIP_WITHOUT_TWO_GPUS();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  Pair pair = load_pair(source_path("models/default"), kv.num_slots());
  ASSERT_NE(pair.sharded, nullptr);
  ASSERT_NE(pair.whole, nullptr);
  ASSERT_TRUE(pair.sharded->samples_on_device());
  engine::AttentionPlanner planner({.kind = engine::PlanKind::kDeftFlatten});
  engine::SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.top_logprobs = 2;
  int same = 0, steps = 0;
  SequenceTree whole_tree(1, &kv), sharded_tree(2, &kv);
  std::vector<TokenId> whole_next = {1, 40, 41, 42, 43, 44}, sharded_next = whole_next;
  NodeId whole_leaf = whole_tree.root(), sharded_leaf = sharded_tree.root();
  for (int s = 0; s < 24; ++s) {
    engine::SampledToken out[2];
    for (int side = 0; side < 2; ++side) {
      SequenceTree& tree = side == 0 ? whole_tree : sharded_tree;
      const std::vector<TokenId>& next = side == 0 ? whole_next : sharded_next;
      const TreeStep part =
          RunnerHarness::append(tree, side == 0 ? whole_leaf : sharded_leaf, next);
      engine::AttentionPlan plan;
      ASSERT_TRUE(
          planner.plan(std::vector<engine::TreeQueries>{{part.tree, part.queries}}, plan).ok());
      const std::vector<int32_t> last = {static_cast<int32_t>(part.tokens.size()) - 1};
      const engine::RowSampling row{.params = &greedy, .step = static_cast<uint64_t>(s)};
      engine::ModelRunner& runner = side == 0 ? *pair.whole : *pair.sharded;
      ASSERT_TRUE(runner
                      .forward_sampled({.plan = &plan, .tokens = part.tokens, .logit_rows = last},
                                       {&row, 1}, {&out[side], 1})
                      .ok());
    }
    ++steps;
    if (out[0].token != out[1].token) {
      // Only a thin margin may flip the greedy token (TP 1's top two logprobs).
      ASSERT_EQ(out[0].top_logprobs.size(), 2u);
      EXPECT_LT(out[0].top_logprobs[0].logprob - out[0].top_logprobs[1].logprob, 0.05)
          << "step " << s << ": token " << out[1].token << " at TP 2, " << out[0].token
          << " at TP 1";
      break;
    }
    ++same;
    EXPECT_NEAR(out[1].logprob, out[0].logprob, 0.05) << "step " << s;
    whole_next = {out[0].token};
    sharded_next = {out[1].token};
  }
  std::printf("[tensor parallel] sampled greedy decode, default model: %d / %d tokens equal\n",
              same, steps);
}

}  // namespace
}  // namespace deft::models
