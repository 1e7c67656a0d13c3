// LlamaCpuRunner on tiny random models: a step of many trees and queries gives every query
// what it would get alone (tree decoding = each branch decoded by itself; prefill in one step =
// token-by-token decode; several trees in one step = each tree in its own step), for every
// plan kind, MHA / GQA, Qwen2 bias and tied embeddings; bad steps are refused.
#include "models/llama_cpu.h"

#include <gtest/gtest.h>

#include <random>

#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::NodeId;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;
using testing::RunnerHarness;
using testing::TinyLlama;
using testing::TinyLlamaSpec;
using testing::TreeStep;
using testing::argmax;
using testing::make_tiny_llama;
using testing::relative_error;

// Steps of one query row agree with another within fp32 reassociation (different chunking and
// merge order of the attention partials).
constexpr double kSameRowTolerance = 2e-5;

std::vector<TokenId> random_tokens(std::mt19937& random, int32_t count, int32_t vocab) {
  std::uniform_int_distribution<TokenId> token(3, vocab - 1);
  std::vector<TokenId> tokens(static_cast<size_t>(count));
  for (TokenId& t : tokens) t = token(random);
  return tokens;
}

struct Variant {
  const char* name;
  TinyLlamaSpec spec;
  engine::PlannerOptions planner;
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
  TinyLlamaSpec gqa;  // 4 query heads on 2 KV heads
  TinyLlamaSpec mha = gqa;
  mha.kv_heads = 4;
  mha.seed = 2;
  TinyLlamaSpec qwen = gqa;
  qwen.architecture = "Qwen2ForCausalLM";
  qwen.heads = 8;
  qwen.head_dim = 8;
  qwen.seed = 3;
  TinyLlamaSpec tied = gqa;
  tied.tie = true;
  tied.kv_heads = 1;
  tied.seed = 4;
  const engine::PlannerOptions flatten16{.kind = PlanKind::kDeftFlatten, .chunk_tokens = 16};
  out.push_back({"gqa_flatten", gqa, flatten16});
  out.push_back({"mha_flatten", mha, flatten16});
  out.push_back({"qwen2_bias_flatten", qwen, flatten16});
  out.push_back({"tied_mqa_flatten", tied, flatten16});
  for (PlanKind kind : {PlanKind::kDeftNode, PlanKind::kDeftNodeChunk, PlanKind::kSequence,
                        PlanKind::kDenseMask}) {
    const engine::PlannerOptions options{.kind = kind, .chunk_tokens = 16};
    out.push_back({"gqa", gqa, options});
  }
  return out;
}

class LlamaCpuTest : public ::testing::TestWithParam<Variant> {};

// Prefill of a run of tokens in one step equals feeding them one step at a time.
TEST_P(LlamaCpuTest, PrefillInOneStepEqualsTokenByTokenDecode) {
  const Variant& variant = GetParam();
  const TinyLlama model = make_tiny_llama(variant.spec);
  RunnerHarness harness(model, 256, 8, variant.planner);
  std::mt19937 random(11);
  const std::vector<TokenId> tokens = random_tokens(random, 45, harness.vocab());

  std::unique_ptr<SequenceTree> prefill_tree = harness.new_tree();
  const TreeStep prefill = RunnerHarness::append(*prefill_tree, prefill_tree->root(), tokens);
  const std::vector<std::vector<float>> prefill_logits = harness.step({&prefill, 1});

  std::unique_ptr<SequenceTree> decode_tree = harness.new_tree();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const TreeStep decode =
        RunnerHarness::append(*decode_tree, decode_tree->root(), {&tokens[i], 1});
    const std::vector<float> logits = harness.step({&decode, 1})[0];
    EXPECT_LT(relative_error(logits, prefill_logits[i]), kSameRowTolerance) << "position " << i;
  }
}

// A tree decoded greedily with all its leaves in one step gives every branch exactly the
// tokens (and nearly the logits) that decoding the branch alone gives.
TEST_P(LlamaCpuTest, TreeDecodingEqualsEachBranchAlone) {
  const Variant& variant = GetParam();
  const TinyLlama model = make_tiny_llama(variant.spec);
  RunnerHarness harness(model, 512, 8, variant.planner);
  std::mt19937 random(12);
  const int32_t vocab = harness.vocab();
  constexpr int32_t kSteps = 24;

  // prompt(21) -> {a(5) -> {a1(3), a2(1)}, b(9), c(1)}; the prompt and the whole tree prefilled
  // in one step (a token tree, as speculative verification sends it).
  std::unique_ptr<SequenceTree> tree = harness.new_tree();
  std::vector<TreeStep> parts;
  parts.push_back(
      RunnerHarness::append(*tree, tree->root(), random_tokens(random, 21, vocab)));
  const std::vector<NodeId> top = *tree->branch(tree->root(), 3);
  parts.push_back(RunnerHarness::append(*tree, top[0], random_tokens(random, 5, vocab)));
  const std::vector<NodeId> under_a = *tree->branch(top[0], 2);
  const std::vector<std::pair<NodeId, int32_t>> node_lengths = {
      {under_a[0], 3}, {under_a[1], 1}, {top[1], 9}, {top[2], 1}};
  for (auto [node, length] : node_lengths) {
    parts.push_back(RunnerHarness::append(*tree, node, random_tokens(random, length, vocab)));
  }
  // One step for the whole tree: merge the parts into one TreeStep.
  TreeStep all{.tree = tree.get()};
  for (const TreeStep& part : parts) {
    all.queries.insert(all.queries.end(), part.queries.begin(), part.queries.end());
    all.tokens.insert(all.tokens.end(), part.tokens.begin(), part.tokens.end());
  }
  std::vector<std::vector<float>> logits = harness.step({&all, 1});

  const std::vector<NodeId> leaves = tree->live_leaves();
  ASSERT_EQ(leaves.size(), 4u);
  // Row of each leaf's last token in the prefill step.
  std::vector<std::vector<float>> leaf_logits;
  for (NodeId leaf : leaves) {
    const int32_t last = static_cast<int32_t>(tree->node(leaf).tokens.size()) - 1;
    for (size_t row = 0; row < all.queries.size(); ++row) {
      if (all.queries[row].node == leaf && all.queries[row].token_index == last) {
        leaf_logits.push_back(logits[row]);
      }
    }
  }
  ASSERT_EQ(leaf_logits.size(), leaves.size());

  std::vector<std::vector<TokenId>> tree_tokens(leaves.size());
  std::vector<std::vector<std::vector<float>>> tree_logits(leaves.size());
  for (int32_t s = 0; s < kSteps; ++s) {
    TreeStep decode{.tree = tree.get()};
    for (size_t i = 0; i < leaves.size(); ++i) {
      tree_logits[i].push_back(leaf_logits[i]);
      const TokenId token = argmax(leaf_logits[i]);
      tree_tokens[i].push_back(token);
      const TreeStep part = RunnerHarness::append(*tree, leaves[i], {&token, 1});
      decode.queries.push_back(part.queries[0]);
      decode.tokens.push_back(token);
    }
    leaf_logits = harness.step({&decode, 1});
  }

  for (size_t i = 0; i < leaves.size(); ++i) {
    // The branch alone: its root-to-leaf tokens as a plain sequence (before the greedy ones).
    std::vector<TokenId> prefix;
    const std::vector<NodeId> path = *tree->path(leaves[i]);
    for (NodeId node : path) {
      const engine::NodeTokens& node_tokens = tree->node(node).tokens;
      const size_t keep = node == leaves[i] ? node_tokens.size() - kSteps : node_tokens.size();
      prefix.insert(prefix.end(), node_tokens.begin(), node_tokens.begin() + keep);
    }
    std::vector<std::vector<float>> alone_logits;
    std::vector<TokenId> alone_tokens;
    harness.decode_alone(prefix, kSteps, &alone_logits, &alone_tokens);
    EXPECT_EQ(tree_tokens[i], alone_tokens) << "branch " << i;
    for (int32_t s = 0; s < kSteps; ++s) {
      EXPECT_LT(relative_error(tree_logits[i][s], alone_logits[s]), kSameRowTolerance)
          << "branch " << i << " step " << s;
    }
  }
}

// Several trees in one step (a decode of one tree's leaves, a prefill of another's prompt and
// an extend of a third) give each tree what its own step gives.
TEST_P(LlamaCpuTest, SeveralTreesInOneStepEqualSeparateSteps) {
  const Variant& variant = GetParam();
  const TinyLlama model = make_tiny_llama(variant.spec);
  RunnerHarness harness(model, 512, 8, variant.planner);
  std::mt19937 random(13);
  const int32_t vocab = harness.vocab();

  // Two copies of the same three trees: `together` runs them in one step, `apart` one by one.
  struct Trees {
    std::unique_ptr<SequenceTree> decode, prefill, extend;
    std::vector<NodeId> decode_leaves;
  };
  const std::vector<TokenId> prompt_a = random_tokens(random, 17, vocab);
  const std::vector<TokenId> prompt_b = random_tokens(random, 30, vocab);
  const std::vector<TokenId> prompt_c = random_tokens(random, 9, vocab);
  const std::vector<TokenId> extend_c = random_tokens(random, 6, vocab);
  const std::vector<TokenId> leaf_tokens = random_tokens(random, 3, vocab);

  auto build = [&](Trees& trees) {
    trees.decode = harness.new_tree();
    const TreeStep a = RunnerHarness::append(*trees.decode, trees.decode->root(), prompt_a);
    harness.step({&a, 1});
    trees.decode_leaves = *trees.decode->branch(trees.decode->root(), 3);
    trees.extend = harness.new_tree();
    const TreeStep c = RunnerHarness::append(*trees.extend, trees.extend->root(), prompt_c);
    harness.step({&c, 1});
    trees.prefill = harness.new_tree();
  };
  auto parts_of = [&](Trees& trees) {
    std::vector<TreeStep> parts;
    TreeStep decode{.tree = trees.decode.get()};
    for (size_t i = 0; i < trees.decode_leaves.size(); ++i) {
      const TreeStep part =
          RunnerHarness::append(*trees.decode, trees.decode_leaves[i], {&leaf_tokens[i], 1});
      decode.queries.push_back(part.queries[0]);
      decode.tokens.push_back(part.tokens[0]);
    }
    parts.push_back(std::move(decode));
    parts.push_back(RunnerHarness::append(*trees.prefill, trees.prefill->root(), prompt_b));
    parts.push_back(RunnerHarness::append(*trees.extend, trees.extend->root(), extend_c));
    return parts;
  };

  Trees together, apart;
  build(together);
  build(apart);
  const std::vector<TreeStep> together_parts = parts_of(together);
  const std::vector<std::vector<float>> together_logits = harness.step(together_parts);
  const std::vector<TreeStep> apart_parts = parts_of(apart);
  std::vector<std::vector<float>> apart_logits;
  for (const TreeStep& part : apart_parts) {
    for (std::vector<float>& row : harness.step({&part, 1})) apart_logits.push_back(row);
  }
  ASSERT_EQ(together_logits.size(), apart_logits.size());
  for (size_t row = 0; row < apart_logits.size(); ++row) {
    EXPECT_LT(relative_error(together_logits[row], apart_logits[row]), kSameRowTolerance)
        << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaCpuTest, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return absl::StrCat(
                               info.param.name, "_",
                               std::string(engine::plan_kind_name(info.param.planner.kind)));
                         });

TEST(LlamaCpu, LogitsOnlyForTheRowsAsked) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model);
  std::mt19937 random(14);
  std::unique_ptr<SequenceTree> tree = harness.new_tree();
  const TreeStep all = RunnerHarness::append(*tree, tree->root(),
                                             random_tokens(random, 12, harness.vocab()));
  engine::AttentionPlanner planner;
  engine::AttentionPlan plan;
  const engine::TreeQueries trees[] = {{tree.get(), all.queries}};
  ASSERT_TRUE(planner.plan(trees, plan).ok());
  // Rows 11 and 4, in that order.
  const int32_t rows[] = {11, 4};
  std::vector<float> logits(2 * static_cast<size_t>(harness.vocab()));
  ASSERT_TRUE(harness.runner()
                  .forward({.plan = &plan, .tokens = all.tokens, .logit_rows = rows}, logits)
                  .ok());
  // Same KV slots rewritten with the same values: the full step must agree.
  const std::vector<std::vector<float>> full = harness.step({&all, 1});
  const size_t vocab = static_cast<size_t>(harness.vocab());
  EXPECT_LT(relative_error(std::span(logits).subspan(0, vocab), full[11]), 1e-6);
  EXPECT_LT(relative_error(std::span(logits).subspan(vocab, vocab), full[4]), 1e-6);
}

TEST(LlamaCpu, RefusesBadSteps) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model);
  std::unique_ptr<SequenceTree> tree = harness.new_tree();
  const std::vector<TokenId> prompt = {5, 6, 7};
  const TreeStep all = RunnerHarness::append(*tree, tree->root(), prompt);
  engine::AttentionPlanner planner;
  engine::AttentionPlan plan;
  const engine::TreeQueries trees[] = {{tree.get(), all.queries}};
  ASSERT_TRUE(planner.plan(trees, plan).ok());
  const size_t vocab = static_cast<size_t>(harness.vocab());
  std::vector<float> logits(vocab);
  const int32_t last[] = {2};

  const TokenId bad_token[] = {5, harness.vocab(), 7};
  absl::Status status =
      harness.runner().forward({.plan = &plan, .tokens = bad_token, .logit_rows = last}, logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("row 1"), std::string::npos) << status;

  const int32_t bad_row[] = {3};
  status = harness.runner().forward({.plan = &plan, .tokens = prompt, .logit_rows = bad_row},
                                    logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  std::vector<float> short_logits(vocab - 1);
  status = harness.runner().forward({.plan = &plan, .tokens = prompt, .logit_rows = last},
                                    short_logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  engine::AttentionPlan bad_slot = plan;
  bad_slot.query_slot[0] = static_cast<int32_t>(harness.kv().num_slots());
  status = harness.runner().forward({.plan = &bad_slot, .tokens = prompt, .logit_rows = last},
                                    logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  const std::vector<TokenId> two = {5, 6};
  status = harness.runner().forward({.plan = &plan, .tokens = two, .logit_rows = last}, logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  EXPECT_TRUE(harness.runner()
                  .forward({.plan = &plan, .tokens = prompt, .logit_rows = last}, logits)
                  .ok());
}

TEST(LlamaCpu, LoadsTheDefaultModel) {
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner =
      LlamaCpuRunner::load(DEFT_SOURCE_DIR "/models/default", 64);
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_EQ((*runner)->vocab_size(), 512);
  EXPECT_EQ((*runner)->info().num_layers, 4);
  EXPECT_EQ((*runner)->info().num_kv_slots, 64);
}

TEST(LlamaCpu, LoadReportsAMissingCheckpoint) {
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner =
      LlamaCpuRunner::load("/nonexistent/model", 64);
  EXPECT_FALSE(runner.ok());
  EXPECT_NE(runner.status().message().find("/nonexistent/model"), std::string::npos)
      << runner.status();
}

}  // namespace
}  // namespace deft::models
