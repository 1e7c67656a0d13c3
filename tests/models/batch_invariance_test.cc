// Deterministic mode on the CPU backend: with deterministic plans (engine::PlannerOptions::
// deterministic) a request's logits, sampled tokens and log-probabilities are the same bits run
// alone and inside random concurrent mixes (tests/testing/batch_invariance.h). The CPU runner
// computes every row on its own, so the plan is what this checks: a row's attention pieces and
// their merge order may not depend on the step. The CUDA runner's twin of this test is
// tests/gpu/llama_cuda_deterministic_test.cc.
#include "tests/testing/batch_invariance.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>

#include "models/llama_cpu.h"
#include "tests/models/tiny_llama.h"
#include "tests/testing/engine_determinism.h"

namespace deft::models {
namespace {

TEST(CpuBatchInvariance, ProbesAloneEqualProbesInRandomMixes) {
  const testing::TinyLlama model = testing::make_tiny_llama({.seed = 7});
  test::BatchInvarianceOptions options;
  options.num_pages = 512;
  options.max_prompt_tokens = 150;
  options.max_step_rows = 300;
  options.mixes = 2;
  options.planner.chunk_tokens = 32;  // several pieces per prompt
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner = LlamaCpuRunner::create(
      model.config, model.checkpoint, int64_t{options.num_pages} * options.page_tokens, "tiny");
  ASSERT_TRUE(runner.ok()) << runner.status();
  const uint64_t seed = 20261129;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  test::BatchInvarianceHarness harness(**runner, options, seed);
  test::BatchInvarianceReport report;
  for (int probe = 0; probe < 3; ++probe) ASSERT_NO_FATAL_FAILURE(harness.run_probe(report));
  EXPECT_EQ(report.mismatches, 0) << report.first_mismatch;
  EXPECT_GT(report.logit_rows, 0);
  EXPECT_GT(report.max_step_rows, 64);
}

TEST(CpuBatchInvariance, ConcurrentCopiesOfAGenerateEqualItAlone) {
  absl::StatusOr<std::unique_ptr<engine::Tokenizer>> tokenizer =
      engine::load_tokenizer(DEFT_SOURCE_DIR "/models/default");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::mt19937_64 rng(5);
  const testing::TinyLlama model = testing::make_tiny_llama({.hidden = 64,
                                                             .heads = 4,
                                                             .kv_heads = 2,
                                                             .head_dim = 16,
                                                             .intermediate = 128,
                                                             .vocab = 512,
                                                             .seed = 3});
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner = LlamaCpuRunner::create(
      model.config, model.checkpoint, int64_t{test::kPages} * test::kPageTokens, "tiny");
  ASSERT_TRUE(runner.ok()) << runner.status();
  const test::DeterminismJobs jobs = test::determinism_jobs(rng, /*max_tokens=*/24);
  EXPECT_EQ(test::copies_equal_alone(**runner, **tokenizer, true, jobs.greedy, 8, rng), 8);
  EXPECT_EQ(test::copies_equal_alone(**runner, **tokenizer, true, jobs.sampled, 4, rng), 4);
}

}  // namespace
}  // namespace deft::models
