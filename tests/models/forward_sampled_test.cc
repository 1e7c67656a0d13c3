// engine::ModelRunner::forward_sampled's default implementation (forward() + engine::Sampler per
// logit row), through the CPU runner on a tiny random model.
#include <gtest/gtest.h>

#include <vector>

#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::RowSampling;
using engine::SampledToken;
using engine::SamplingParams;
using engine::TokenId;
using testing::RunnerHarness;

TEST(ForwardSampled, DefaultEqualsForwardThenSampler) {
  const testing::TinyLlama model = testing::make_tiny_llama({});
  RunnerHarness harness(model);
  auto tree = harness.new_tree();
  const std::vector<TokenId> prompt = {5, 9, 17, 33, 2, 61};
  const testing::TreeStep prefill = RunnerHarness::append(*tree, tree->root(), prompt);
  engine::AttentionPlanner planner(engine::PlannerOptions{});
  engine::AttentionPlan plan;
  ASSERT_TRUE(
      planner.plan(std::vector<engine::TreeQueries>{{tree.get(), prefill.queries}}, plan).ok());
  const std::vector<int32_t> logit_rows = {5, 0, 3};
  const engine::StepBatch batch{.plan = &plan, .tokens = prompt, .logit_rows = logit_rows};
  const std::vector<SamplingParams> params = {
      {.temperature = 0.0f, .top_logprobs = 3},
      {.temperature = 0.9f, .top_k = 10, .seed = 77, .stop_token_ids = {1, 2}},
      {.temperature = 1.2f, .top_p = 0.8f, .seed = 78},
  };
  const std::vector<RowSampling> rows = {{&params[0], 6}, {&params[1], 1}, {&params[2], 4}};

  const int32_t vocab = harness.vocab();
  std::vector<float> logits(logit_rows.size() * static_cast<size_t>(vocab));
  ASSERT_TRUE(harness.runner().forward(batch, logits).ok());
  std::vector<SampledToken> out(rows.size());
  ASSERT_TRUE(harness.runner().forward_sampled(batch, rows, out).ok());
  engine::Sampler sampler;
  for (size_t i = 0; i < rows.size(); ++i) {
    absl::StatusOr<SampledToken> ref = sampler.sample(
        std::span<const float>(logits).subspan(i * vocab, vocab), params[i], rows[i].step);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(out[i].token, ref->token) << i;
    EXPECT_EQ(out[i].logprob, ref->logprob) << i;
    EXPECT_EQ(out[i].stop, ref->stop) << i;
    EXPECT_EQ(out[i].top_logprobs.size(), ref->top_logprobs.size()) << i;
  }

  // A mixed step: the middle row wants its logits (null params), the others sample.
  const std::vector<RowSampling> mixed = {{&params[0], 6}, {nullptr, 0}, {&params[2], 4}};
  std::vector<float> wanted(static_cast<size_t>(vocab));
  std::vector<SampledToken> mixed_out(rows.size());
  ASSERT_TRUE(harness.runner().forward_sampled(batch, mixed, mixed_out, wanted).ok());
  EXPECT_EQ(wanted, std::vector<float>(logits.begin() + vocab, logits.begin() + 2 * vocab));
  EXPECT_EQ(mixed_out[0].token, out[0].token);
  EXPECT_EQ(mixed_out[2].token, out[2].token);
  EXPECT_EQ(mixed_out[1].token, -1);  // untouched
}

TEST(ForwardSampled, RejectsMismatchedRowsAndBadParams) {
  const testing::TinyLlama model = testing::make_tiny_llama({});
  RunnerHarness harness(model);
  auto tree = harness.new_tree();
  const std::vector<TokenId> prompt = {5, 9};
  const testing::TreeStep prefill = RunnerHarness::append(*tree, tree->root(), prompt);
  engine::AttentionPlanner planner(engine::PlannerOptions{});
  engine::AttentionPlan plan;
  ASSERT_TRUE(
      planner.plan(std::vector<engine::TreeQueries>{{tree.get(), prefill.queries}}, plan).ok());
  const std::vector<int32_t> logit_rows = {1};
  const engine::StepBatch batch{.plan = &plan, .tokens = prompt, .logit_rows = logit_rows};
  std::vector<SampledToken> out(1);
  const SamplingParams good{};
  const SamplingParams bad{.temperature = -1.0f};
  const std::vector<RowSampling> two = {{&good, 0}, {&good, 0}};
  EXPECT_EQ(harness.runner().forward_sampled(batch, two, out).code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<RowSampling> bad_row = {{&bad, 0}};
  const absl::Status status = harness.runner().forward_sampled(batch, bad_row, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("temperature"), std::string::npos) << status;
  // A row without params wants its logits: the span must hold exactly one row per such row.
  const std::vector<RowSampling> null_row = {{nullptr, 0}};
  const absl::Status no_room = harness.runner().forward_sampled(batch, null_row, out);
  EXPECT_EQ(no_room.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_room.message().find("want their logits"), std::string::npos) << no_room;
  std::vector<float> row(static_cast<size_t>(harness.vocab()));
  EXPECT_TRUE(harness.runner().forward_sampled(batch, null_row, out, row).ok());
}

}  // namespace
}  // namespace deft::models
