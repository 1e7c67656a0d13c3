// LlamaCudaRunner::forward_sampled (GPU sampling) against forward() + engine::Sampler on the
// default model: a prompt prefilled with every row sampled, then branches decoding with tokens
// fed back, each step run both ways on the same plan (the second run rewrites the same K/V).
// Greedy tokens must be equal; sampled ones may differ only at a boundary case
// (tests/gpu/sampling_reference.h); logprobs and top lists as in tests/gpu/sampling_test.cc.
// Each step also runs mixed: some rows want their logits back, the others sample.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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
#include "tests/gpu/sampling_reference.h"

namespace deft::models {
namespace {

using engine::NodeId;
using engine::QueryToken;
using engine::RowSampling;
using engine::SampledToken;
using engine::SamplingParams;
using engine::SequenceTree;
using engine::TokenId;
using kernels::cuda_device_visible;

std::string model_dir() {
  const char* root = std::getenv("DEFT_SOURCE_DIR");
  return absl::StrCat(root != nullptr ? root : DEFT_SOURCE_DIR, "/models/default");
}

// Both ways on one step; returns forward_sampled's tokens. Counts compared rows and boundary
// cases.
std::vector<SampledToken> run_both(LlamaCudaRunner& runner, const engine::AttentionPlan& plan,
                                   const std::vector<TokenId>& tokens,
                                   const std::vector<int32_t>& logit_rows,
                                   const std::vector<SamplingParams>& params,
                                   const std::vector<uint64_t>& steps, int64_t& compared,
                                   int64_t& boundary_cases) {
  const engine::StepBatch batch{.plan = &plan, .tokens = tokens, .logit_rows = logit_rows};
  const size_t vocab = static_cast<size_t>(runner.vocab_size());
  std::vector<float> logits(logit_rows.size() * vocab);
  const absl::Status ran = runner.forward(batch, logits);
  EXPECT_TRUE(ran.ok()) << ran;
  std::vector<RowSampling> rows;
  for (size_t i = 0; i < params.size(); ++i) rows.push_back({&params[i], steps[i]});
  std::vector<SampledToken> sampled(logit_rows.size());
  const absl::Status ran_sampled = runner.forward_sampled(batch, rows, sampled);
  EXPECT_TRUE(ran_sampled.ok()) << ran_sampled;
  engine::Sampler sampler;
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    const std::span<const float> row(logits.data() + i * vocab, vocab);
    absl::StatusOr<SampledToken> ref = sampler.sample(row, params[i], steps[i]);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) continue;
    ++compared;
    if (sampled[i].token != ref->token) {
      ++boundary_cases;
      const double margin = testing::sampling_decision_margin(row, params[i], steps[i]);
      EXPECT_LT(margin, 1e-9) << "row " << i << ": gpu " << sampled[i].token << ", cpu "
                              << ref->token;
      continue;
    }
    EXPECT_NEAR(sampled[i].logprob, ref->logprob, 1e-5 + 1e-5 * std::abs(ref->logprob));
    EXPECT_EQ(sampled[i].stop, ref->stop);
    EXPECT_EQ(sampled[i].top_logprobs.size(), ref->top_logprobs.size());
    for (size_t j = 0; j < std::min(sampled[i].top_logprobs.size(), ref->top_logprobs.size());
         ++j) {
      EXPECT_EQ(sampled[i].top_logprobs[j].token, ref->top_logprobs[j].token);
      EXPECT_NEAR(sampled[i].top_logprobs[j].logprob, ref->top_logprobs[j].logprob,
                  1e-5 + 1e-5 * std::abs(ref->top_logprobs[j].logprob));
    }
  }

  // A mixed step: every third row wants its logits (null params), the rest sample. The wanted
  // rows' logits equal forward()'s; the sampled rows' tokens equal the all-sampled run's.
  std::vector<RowSampling> mixed = rows;
  size_t wanted = 0;
  for (size_t i = 0; i < mixed.size(); i += 3, ++wanted) mixed[i].params = nullptr;
  std::vector<float> kept(wanted * vocab);
  std::vector<SampledToken> mixed_out(logit_rows.size());
  const absl::Status ran_mixed = runner.forward_sampled(batch, mixed, mixed_out, kept);
  EXPECT_TRUE(ran_mixed.ok()) << ran_mixed;
  for (size_t i = 0, k = 0; i < mixed.size(); ++i) {
    if (mixed[i].params != nullptr) {
      EXPECT_EQ(mixed_out[i].token, sampled[i].token) << "row " << i;
      continue;
    }
    double worst = 0.0;
    for (size_t v = 0; v < vocab; ++v) {
      const double ref = logits[i * vocab + v];
      worst = std::max(worst, std::abs(kept[k * vocab + v] - ref) / (1e-3 + std::abs(ref)));
    }
    EXPECT_LT(worst, 1e-3) << "row " << i << ": kept logits differ from forward()'s";
    ++k;
  }
  return sampled;
}

TEST(LlamaCudaSampling, ForwardSampledMatchesForwardAndSampler) {
  DEFT_SKIP_WITHOUT_GPU();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 64});
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> loaded =
      LlamaCudaRunner::load(model_dir(), {.num_kv_slots = kv.num_slots(), .max_batch_rows = 512});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  LlamaCudaRunner& runner = **loaded;
  const int32_t vocab = runner.vocab_size();
  const uint32_t seed = kernels::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::mt19937_64 rng64(seed);

  const std::vector<SamplingParams> kinds = {
      {.temperature = 0.0f, .top_logprobs = 5},
      {.temperature = 1.0f},
      {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .top_logprobs = 3},
      {.temperature = 1.3f, .top_p = 0.9f},
      {.temperature = 0.7f, .top_k = 20},
  };
  engine::AttentionPlanner planner({.chunk_tokens = 16});
  engine::AttentionPlan plan;
  SequenceTree tree(1, &kv);
  int64_t compared = 0, boundary_cases = 0;

  // Prefill 300 prompt tokens, every row sampled with a mix of params: more logit rows than one
  // LM-head chunk (256), so the mixed run keeps rows of both chunks.
  constexpr int kPrompt = 300;
  std::vector<TokenId> prompt;
  for (int i = 0; i < kPrompt; ++i) prompt.push_back(3 + static_cast<TokenId>(rng() % (vocab - 3)));
  ASSERT_TRUE(tree.append(tree.root(), prompt).ok());
  std::vector<QueryToken> queries;
  std::vector<int32_t> logit_rows;
  std::vector<SamplingParams> params;
  std::vector<uint64_t> steps;
  for (int i = 0; i < kPrompt; ++i) {
    queries.push_back({tree.root(), i});
    logit_rows.push_back(i);
    SamplingParams p = kinds[i % kinds.size()];
    p.seed = rng64();
    p.stop_token_ids = {prompt[(i + 1) % kPrompt], 2};
    params.push_back(p);
    steps.push_back(static_cast<uint64_t>(i));
  }
  ASSERT_TRUE(planner.plan(std::vector<engine::TreeQueries>{{&tree, queries}}, plan).ok());
  run_both(runner, plan, prompt, logit_rows, params, steps, compared, boundary_cases);

  // Six branches decode 12 steps, tokens from forward_sampled fed back.
  const int32_t branches = 6;
  const std::vector<NodeId> leaves = *tree.branch(tree.root(), branches);
  std::vector<SamplingParams> branch_params;
  for (int b = 0; b < branches; ++b) {
    SamplingParams p = kinds[b % kinds.size()];
    p.seed = engine::branch_seed(seed, static_cast<uint64_t>(b));
    branch_params.push_back(p);
  }
  std::vector<TokenId> next(branches);
  for (TokenId& t : next) t = 3 + static_cast<TokenId>(rng() % (vocab - 3));
  for (int s = 0; s < 12; ++s) {
    queries.clear();
    logit_rows.clear();
    steps.clear();
    for (int b = 0; b < branches; ++b) {
      ASSERT_TRUE(tree.append(leaves[b], std::span<const TokenId>(&next[b], 1)).ok());
      queries.push_back({leaves[b], static_cast<int32_t>(tree.node(leaves[b]).tokens.size()) - 1});
      logit_rows.push_back(b);
      steps.push_back(static_cast<uint64_t>(tree.depth(leaves[b], queries.back().token_index)));
    }
    ASSERT_TRUE(planner.plan(std::vector<engine::TreeQueries>{{&tree, queries}}, plan).ok());
    const std::vector<SampledToken> out =
        run_both(runner, plan, next, logit_rows, branch_params, steps, compared, boundary_cases);
    for (int b = 0; b < branches; ++b) next[b] = out[b].token;
  }
  EXPECT_LE(boundary_cases * 50, compared);
  std::printf(
      "[cuda forward_sampled] default model (vocab %d): %lld rows compared, %lld "
      "boundary cases\n",
      vocab, static_cast<long long>(compared), static_cast<long long>(boundary_cases));
}

TEST(LlamaCudaSampling, ForwardSampledRejectsBadArguments) {
  DEFT_SKIP_WITHOUT_GPU();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 8});
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> loaded =
      LlamaCudaRunner::load(model_dir(), {.num_kv_slots = kv.num_slots(), .max_batch_rows = 64});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  SequenceTree tree(1, &kv);
  const std::vector<TokenId> tokens = {5, 6, 7};
  ASSERT_TRUE(tree.append(tree.root(), tokens).ok());
  engine::AttentionPlanner planner({.chunk_tokens = 16});
  engine::AttentionPlan plan;
  const std::vector<QueryToken> queries = {{tree.root(), 0}, {tree.root(), 1}, {tree.root(), 2}};
  ASSERT_TRUE(planner.plan(std::vector<engine::TreeQueries>{{&tree, queries}}, plan).ok());
  const std::vector<int32_t> logit_rows = {2};
  const engine::StepBatch batch{.plan = &plan, .tokens = tokens, .logit_rows = logit_rows};
  std::vector<SampledToken> out(1);
  const SamplingParams bad{.top_p = 0.0f};
  const std::vector<RowSampling> bad_rows = {{&bad, 0}};
  EXPECT_EQ((*loaded)->forward_sampled(batch, bad_rows, out).code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<RowSampling> no_params = {{nullptr, 0}};
  EXPECT_EQ((*loaded)->forward_sampled(batch, no_params, out).code(),
            absl::StatusCode::kInvalidArgument);
  const SamplingParams good{};
  const std::vector<RowSampling> two = {{&good, 0}, {&good, 1}};
  EXPECT_EQ((*loaded)->forward_sampled(batch, two, out).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<RowSampling> one = {{&good, 0}};
  EXPECT_TRUE((*loaded)->forward_sampled(batch, one, out).ok());
  EXPECT_GE(out[0].token, 0);
}

}  // namespace
}  // namespace deft::models
