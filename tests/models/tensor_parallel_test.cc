// The CPU twin of tensor parallelism (models/tensor_parallel.h): the sharding arithmetic, the
// host collectives, and a CPU "TP N" (LlamaCpuRunner shards summing partial results through
// HostCollectives) against TP 1 on prefill, tree decoding and greedy decoding.
#include "models/tensor_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "models/host_collectives.h"
#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using testing::RunnerHarness;
using testing::TinyLlamaSpec;
using testing::TreeStep;

TEST(TensorParallel, RefusesCountsThatDoNotDivide) {
  const testing::TinyLlama model = testing::make_tiny_llama({.heads = 4, .kv_heads = 2});
  EXPECT_TRUE(check_tensor_parallel(model.config, 1).ok());
  EXPECT_TRUE(check_tensor_parallel(model.config, 2).ok());
  const absl::Status three = check_tensor_parallel(model.config, 3);
  EXPECT_EQ(three.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(three.message().find("2 KV heads do not split over 3 ranks"), std::string::npos)
      << three;
  EXPECT_FALSE(check_tensor_parallel(model.config, 4).ok());
  EXPECT_FALSE(check_tensor_parallel(model.config, 0).ok());
  // The runner refuses the same way.
  absl::StatusOr<std::unique_ptr<engine::ModelRunner>> runner =
      LlamaCpuRunner::create_tensor_parallel(model.config, model.checkpoint, 64, 4);
  ASSERT_FALSE(runner.ok());
  EXPECT_NE(runner.status().message().find("KV heads"), std::string::npos) << runner.status();
}

TEST(TensorParallel, ShardConfigDividesHeadsAndMlp) {
  const testing::TinyLlama model =
      testing::make_tiny_llama({.heads = 8, .kv_heads = 4, .intermediate = 96});
  const ModelConfig shard = shard_config(model.config, 4);
  EXPECT_EQ(shard.num_attention_heads, 2);
  EXPECT_EQ(shard.num_key_value_heads, 1);
  EXPECT_EQ(shard.intermediate_size, 24);
  EXPECT_EQ(shard.hidden_size, model.config.hidden_size);
  EXPECT_EQ(shard.head_dim, model.config.head_dim);
  EXPECT_EQ(shard.vocab_size, model.config.vocab_size);
}

TEST(TensorParallel, VocabShardsCoverTheVocabularyOnce) {
  for (int32_t vocab : {97, 100, 128256, 3}) {
    for (int32_t ranks : {1, 2, 3, 4, 8}) {
      int32_t next = 0;
      for (int32_t r = 0; r < ranks; ++r) {
        const VocabShard shard = vocab_shard(vocab, {.rank = r, .ranks = ranks});
        EXPECT_EQ(shard.rows, (vocab + ranks - 1) / ranks);
        EXPECT_LE(shard.count, shard.rows);
        if (shard.count > 0) {
          EXPECT_EQ(shard.begin, next) << vocab << " over " << ranks;
        }
        next += shard.count;
      }
      EXPECT_EQ(next, vocab) << vocab << " over " << ranks;
    }
  }
}

TEST(TensorParallel, TensorShardTakesRowsAndColumns) {
  // A [4][6] fp32 matrix m[r][c] = 10 r + c.
  std::vector<float> values(24);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 6; ++c) values[r * 6 + c] = static_cast<float>(10 * r + c);
  }
  const OwnedTensor owned = make_tensor("m", DType::kF32, {4, 6}, values);
  const std::vector<int64_t> shape = {4, 6};
  const TensorView view{.name = "m",
                        .dtype = DType::kF32,
                        .shape = shape,
                        .data = owned.bytes.data(),
                        .bytes = owned.bytes.size()};

  const TensorShard rows(view, ShardAxis::kRows, 1, 2, 2);
  EXPECT_EQ(rows.view().data, view.data + 6 * 4);  // whole rows: a view, no copy
  ASSERT_EQ(rows.view().numel(), 12);
  EXPECT_EQ(rows.view().at(0), 10.0f);
  EXPECT_EQ(rows.view().at(11), 25.0f);

  const TensorShard padded_rows(view, ShardAxis::kRows, 3, 1, 2);
  ASSERT_EQ(padded_rows.view().shape[0], 2);
  EXPECT_EQ(padded_rows.view().at(0), 30.0f);
  EXPECT_EQ(padded_rows.view().at(6), 0.0f);  // padding

  const TensorShard columns(view, ShardAxis::kColumns, 2, 3, 3);
  ASSERT_EQ(columns.view().shape[1], 3);
  const std::vector<float> got = tensor_to_floats(columns.view());
  EXPECT_EQ(got, (std::vector<float>{2, 3, 4, 12, 13, 14, 22, 23, 24, 32, 33, 34}));

  // A vector by rows.
  const std::vector<int64_t> vector_shape = {24};
  const TensorView vector{.name = "v",
                          .dtype = DType::kF32,
                          .shape = vector_shape,
                          .data = owned.bytes.data(),
                          .bytes = owned.bytes.size()};
  const TensorShard half(vector, ShardAxis::kRows, 12, 12, 12);
  EXPECT_EQ(half.view().at(0), 20.0f);
}

TEST(TensorParallel, HostCollectivesSumInRankOrderAndGather) {
  constexpr int32_t kRanks = 3;
  HostCollectives collectives(kRanks);
  std::vector<std::vector<float>> sums(kRanks), gathered(kRanks);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> data = {1.0f * r, 10.0f + r, 1e8f * (r == 0) - 1e8f * (r == 1)};
      collectives.all_reduce_sum(r, data);
      sums[r] = data;
      const std::vector<float> send = {static_cast<float>(r), static_cast<float>(r + 100)};
      gathered[r].assign(2 * kRanks, -1.0f);
      collectives.all_gather(r, send, gathered[r]);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int32_t r = 0; r < kRanks; ++r) {
    EXPECT_EQ(sums[r], (std::vector<float>{3.0f, 33.0f, 0.0f})) << "rank " << r;
    EXPECT_EQ(gathered[r], (std::vector<float>{0, 100, 1, 101, 2, 102})) << "rank " << r;
  }
}

struct TpCase {
  std::string name;
  TinyLlamaSpec spec;
  int32_t ranks = 2;
};

class CpuTensorParallelTest : public ::testing::TestWithParam<TpCase> {};

// max |a - b| / max |b| over rows.
double rows_error(const std::vector<std::vector<float>>& a,
                  const std::vector<std::vector<float>>& b) {
  double error = 0.0;
  for (size_t r = 0; r < b.size(); ++r) {
    error = std::max(error, testing::relative_error(a[r], b[r]));
  }
  return error;
}

// TP N and TP 1 differ only in the order of float additions (partial dot products summed, the
// residual's additions regrouped): 1e-5 of the logits' scale is ~100x that rounding.
constexpr double kFloatOrderBound = 1e-5;

TEST_P(CpuTensorParallelTest, TreeStepsEqualOneRank) {
  const TpCase& c = GetParam();
  const testing::TinyLlama model = testing::make_tiny_llama(c.spec);
  RunnerHarness whole(model);
  RunnerHarness sharded(model, RunnerHarness::TensorParallel{c.ranks});
  std::vector<std::unique_ptr<engine::SequenceTree>> trees;
  for (RunnerHarness* harness : {&whole, &sharded}) trees.push_back(harness->new_tree());

  // Prefill a prompt, then three branches of two tokens in one step, then one token on each.
  const std::vector<engine::TokenId> prompt = {5, 17, 3, 44, 9, 61, 2};
  std::vector<std::vector<std::vector<float>>> logits(2);
  for (int side = 0; side < 2; ++side) {
    RunnerHarness& harness = side == 0 ? whole : sharded;
    engine::SequenceTree& tree = *trees[side];
    const TreeStep prefill = RunnerHarness::append(tree, tree.root(), prompt);
    logits[side] = harness.step({&prefill, 1});
    const std::vector<engine::NodeId> children = *tree.branch(tree.root(), 3);
    std::vector<TreeStep> parts;
    for (size_t b = 0; b < children.size(); ++b) {
      const std::vector<engine::TokenId> tokens = {static_cast<engine::TokenId>(20 + b),
                                                   static_cast<engine::TokenId>(70 - b)};
      parts.push_back(RunnerHarness::append(tree, children[b], tokens));
    }
    std::vector<std::vector<float>> branch_logits = harness.step(parts);
    logits[side].insert(logits[side].end(), branch_logits.begin(), branch_logits.end());
    parts.clear();
    for (size_t b = 0; b < children.size(); ++b) {
      const engine::TokenId token = testing::argmax(branch_logits[2 * b + 1]);
      parts.push_back(RunnerHarness::append(tree, children[b], {&token, 1}));
    }
    branch_logits = harness.step(parts);
    logits[side].insert(logits[side].end(), branch_logits.begin(), branch_logits.end());
  }
  ASSERT_EQ(logits[0].size(), logits[1].size());
  EXPECT_LE(rows_error(logits[1], logits[0]), kFloatOrderBound);
  for (size_t r = 0; r < logits[0].size(); ++r) {
    EXPECT_EQ(testing::argmax(logits[1][r]), testing::argmax(logits[0][r])) << "row " << r;
  }
}

TEST_P(CpuTensorParallelTest, GreedyDecodingEqualsOneRank) {
  const TpCase& c = GetParam();
  const testing::TinyLlama model = testing::make_tiny_llama(c.spec);
  RunnerHarness whole(model);
  RunnerHarness sharded(model, RunnerHarness::TensorParallel{c.ranks});
  const std::vector<engine::TokenId> prompt = {1, 30, 31, 7, 8};
  std::vector<std::vector<float>> whole_logits, sharded_logits;
  std::vector<engine::TokenId> whole_tokens, sharded_tokens;
  whole.decode_alone(prompt, 12, &whole_logits, &whole_tokens);
  sharded.decode_alone(prompt, 12, &sharded_logits, &sharded_tokens);
  EXPECT_EQ(sharded_tokens, whole_tokens);
  EXPECT_LE(rows_error(sharded_logits, whole_logits), kFloatOrderBound);
}

TEST_P(CpuTensorParallelTest, SampledTokensEqualOneRank) {
  const TpCase& c = GetParam();
  const testing::TinyLlama model = testing::make_tiny_llama(c.spec);
  RunnerHarness whole(model);
  RunnerHarness sharded(model, RunnerHarness::TensorParallel{c.ranks});
  engine::SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.top_logprobs = 3;
  std::vector<engine::SampledToken> got(2);
  for (int side = 0; side < 2; ++side) {
    RunnerHarness& harness = side == 0 ? whole : sharded;
    std::unique_ptr<engine::SequenceTree> tree = harness.new_tree();
    const std::vector<engine::TokenId> prompt = {4, 9, 16, 25};
    const TreeStep prefill = RunnerHarness::append(*tree, tree->root(), prompt);
    engine::AttentionPlanner planner(engine::PlannerOptions{});
    engine::AttentionPlan plan;
    ASSERT_TRUE(
        planner.plan(std::vector<engine::TreeQueries>{{tree.get(), prefill.queries}}, plan).ok());
    const std::vector<int32_t> last = {static_cast<int32_t>(prompt.size()) - 1};
    const engine::RowSampling row{.params = &greedy, .step = 0};
    ASSERT_TRUE(harness.runner()
                    .forward_sampled({.plan = &plan, .tokens = prefill.tokens, .logit_rows = last},
                                     {&row, 1}, {&got[side], 1})
                    .ok());
  }
  EXPECT_EQ(got[1].token, got[0].token);
  EXPECT_NEAR(got[1].logprob, got[0].logprob, 1e-5);
  ASSERT_EQ(got[1].top_logprobs.size(), got[0].top_logprobs.size());
}

std::vector<TpCase> tp_cases() {
  return {
      {"llama_tp2", {}, 2},
      {"llama_tp2_tied_even_vocab", {.vocab = 96, .tie = true, .seed = 2}, 2},
      {"qwen2_bias_tp2", {.architecture = "Qwen2ForCausalLM", .bias = true, .seed = 3}, 2},
      {"llama_bias_tp2", {.bias = true, .seed = 4}, 2},
      {"llama_tp4_odd_vocab",
       {.hidden = 64, .heads = 8, .kv_heads = 4, .head_dim = 8, .intermediate = 128, .seed = 5},
       4},
      {"llama_mha_tp4", {.heads = 4, .kv_heads = 4, .seed = 6}, 4},
  };
}

INSTANTIATE_TEST_SUITE_P(Variants, CpuTensorParallelTest, ::testing::ValuesIn(tp_cases()),
                         [](const ::testing::TestParamInfo<TpCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace deft::models
