// The workload replay's driver on the embedded default model (CPU backend): every workload kind
// replays the tree shape its trace prescribes, iteration by iteration (queries and tree tokens,
// computed here from the trace alone), with the token counts it should produce, under every plan
// kind, and frees its KV. Stride sampling keeps the shape. Nothing here looks at time.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/workload_replay/workload_replay_driver.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "models/llama_cpu.h"

namespace deft::bench {
namespace {

using engine::PlanKind;

constexpr int32_t kPageTokens = 16;
constexpr int32_t kPages = 1024;
const std::string kWorkloads = DEFT_WORKLOADS_DIR;

const PlanKind kAllKinds[] = {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                              PlanKind::kSequence, PlanKind::kDenseMask};

class WorkloadReplayTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<engine::Tokenizer>> tokenizer =
        engine::load_tokenizer(DEFT_SOURCE_DIR "/models/default");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer).release();
    absl::StatusOr<std::unique_ptr<models::LlamaCpuRunner>> runner = models::LlamaCpuRunner::load(
        DEFT_SOURCE_DIR "/models/default", int64_t{kPages} * kPageTokens);
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner).release();
  }
  static void TearDownTestSuite() {
    delete runner_;
    delete tokenizer_;
  }

  static ReplayResult replay(const Workload& workload, PlanKind kind, int64_t max_iterations = 0,
                             int32_t stride = 1) {
    ReplayOptions options{.planner = {.kind = kind, .min_prefill_run = 64},
                          .page_tokens = kPageTokens,
                          .kv_pages = kPages,
                          .max_step_tokens = 256,  // prompts prefill in several chunks
                          .max_iterations = max_iterations,
                          .stride = stride};
    return replay_workload(*runner_, *tokenizer_, workload, options);
  }

  static std::vector<StepRecord> decode_steps(const ReplayResult& result) {
    std::vector<StepRecord> steps;
    for (const StepRecord& step : result.steps) {
      if (step.iteration > 0) steps.push_back(step);
    }
    return steps;
  }

  // Every decode step: its iteration's rows, tree and the paths' sum; the prefill steps first.
  static void expect_steps_follow_shape(const ReplayResult& result, int32_t stride,
                                        int64_t iterations) {
    const std::vector<StepRecord> steps = decode_steps(result);
    ASSERT_EQ(std::ssize(steps), (iterations + stride - 1) / stride);
    int64_t weights = 0;
    for (size_t k = 0; k < steps.size(); ++k) {
      const StepRecord& step = steps[k];
      EXPECT_EQ(step.iteration, 1 + static_cast<int64_t>(k) * stride);
      const IterationShape& shape = result.iterations[static_cast<size_t>(step.iteration - 1)];
      EXPECT_EQ(step.rows, shape.queries) << "iteration " << step.iteration;
      EXPECT_EQ(step.tree_kv_tokens, shape.tree_tokens) << "iteration " << step.iteration;
      EXPECT_GE(step.query_path_tokens, step.rows);
      EXPECT_GT(step.kv_tokens_read, 0);
      weights += step.weight;
    }
    EXPECT_EQ(weights, iterations);
    for (size_t i = 0; i < result.steps.size(); ++i) {
      if (result.steps[i].iteration < 0) {
        EXPECT_TRUE(i == 0 || result.steps[i - 1].iteration < 0) << "a prefill step after decoding";
      }
    }
  }

  static engine::Tokenizer* tokenizer_;
  static models::LlamaCpuRunner* runner_;
};

engine::Tokenizer* WorkloadReplayTest::tokenizer_ = nullptr;
models::LlamaCpuRunner* WorkloadReplayTest::runner_ = nullptr;

// The README's replay rule, from the trace alone: at iteration `it` the live leaves are the
// nodes with start <= it <= end; a childless node is gone after its end.
std::vector<IterationShape> expected_reasoning(const ReasoningTrace& trace, int64_t prompt,
                                               int64_t iterations) {
  std::vector<IterationShape> shape;
  for (int64_t it = 1; it <= iterations; ++it) {
    IterationShape s{.queries = 0, .tree_tokens = prompt};
    for (size_t id = 1; id < trace.nodes.size(); ++id) {
      const ReasoningTrace::Node& n = trace.nodes[id];
      if (n.start > it || (n.children.empty() && n.end < it)) continue;
      s.tree_tokens += std::min<int64_t>(n.length, it - n.start + 1);
      s.queries += n.end >= it ? 1 : 0;
    }
    shape.push_back(s);
  }
  return shape;
}

void expect_shape_eq(const std::vector<IterationShape>& got,
                     const std::vector<IterationShape>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].queries, want[i].queries) << "iteration " << i + 1;
    EXPECT_EQ(got[i].tree_tokens, want[i].tree_tokens) << "iteration " << i + 1;
    if (got[i].queries != want[i].queries || got[i].tree_tokens != want[i].tree_tokens) return;
  }
}

int64_t sum_queries(const std::vector<IterationShape>& shape) {
  int64_t total = 0;
  for (const IterationShape& s : shape) total += s.queries;
  return total;
}

// A small tree of thoughts: two levels of three thoughts of different lengths; the kept one
// (node 1, then node 5) branches, the others are pruned at their ends while the next level runs.
ReasoningTrace small_trace() {
  ReasoningTrace trace;
  trace.nodes.resize(8);
  trace.nodes[0] = {.parent = -1, .length = 30, .start = -29, .end = 0, .children = {1, 2, 3}};
  trace.nodes[1] = {.parent = 0, .length = 4, .start = 1, .end = 4, .children = {4, 5, 6}};
  trace.nodes[2] = {.parent = 0, .length = 7, .start = 1, .end = 7, .children = {}};
  trace.nodes[3] = {.parent = 0, .length = 2, .start = 1, .end = 2, .children = {}};
  trace.nodes[4] = {.parent = 1, .length = 3, .start = 5, .end = 7, .children = {}};
  trace.nodes[5] = {.parent = 1, .length = 5, .start = 5, .end = 9, .children = {7}};
  trace.nodes[6] = {.parent = 1, .length = 1, .start = 5, .end = 5, .children = {}};
  trace.nodes[7] = {.parent = 5, .length = 6, .start = 10, .end = 15, .children = {}};
  trace.last_iteration = 15;
  return trace;
}

TEST_F(WorkloadReplayTest, FewShotDecodesEveryBranchEveryIteration) {
  const FewShotWorkload fewshot{.prompt_tokens = 300, .branches = 5, .iterations = 7};
  for (PlanKind kind : kAllKinds) {
    SCOPED_TRACE(std::string(engine::plan_kind_name(kind)));
    const ReplayResult result = replay(fewshot, kind);
    ASSERT_TRUE(result.status.ok()) << result.status;
    std::vector<IterationShape> want;
    for (int64_t k = 1; k <= 7; ++k) want.push_back({.queries = 5, .tree_tokens = 300 + 5 * k});
    expect_shape_eq(result.iterations, want);
    expect_steps_follow_shape(result, 1, 7);
    EXPECT_EQ(result.steps.front().iteration, -1);  // the prompt, in two chunks of 256
    EXPECT_EQ(result.steps.size(), 2u + 7u);
    EXPECT_EQ(result.generated_tokens, 5 * (7 + 1));  // the first tokens come from the prompt
    EXPECT_EQ(result.kv_pages_left, 0);
  }
  // --max-steps
  const ReplayResult capped = replay(fewshot, PlanKind::kDeftFlatten, 3);
  ASSERT_TRUE(capped.status.ok()) << capped.status;
  EXPECT_EQ(capped.iterations.size(), 3u);
  EXPECT_EQ(capped.generated_tokens, 5 * 4);
}

TEST_F(WorkloadReplayTest, ReasoningFollowsBranchesAndPrunes) {
  const ReasoningWorkload reasoning{.trace = small_trace()};
  const std::vector<IterationShape> want = expected_reasoning(reasoning.trace, 30, 15);
  // Spot checks of the rule itself: two levels overlap at iteration 5, pruned nodes are gone.
  EXPECT_EQ(want[4].queries, 4);               // nodes 2, 4, 5, 6
  EXPECT_EQ(want[8].tree_tokens, 30 + 4 + 5);  // iteration 9: the kept nodes 1 and 5 only
  for (PlanKind kind : kAllKinds) {
    SCOPED_TRACE(std::string(engine::plan_kind_name(kind)));
    const ReplayResult result = replay(reasoning, kind);
    ASSERT_TRUE(result.status.ok()) << result.status;
    expect_shape_eq(result.iterations, want);
    expect_steps_follow_shape(result, 1, 15);
    EXPECT_EQ(result.generated_tokens, sum_queries(want));
    EXPECT_EQ(result.kv_pages_left, 0);
  }
  for (int32_t stride : {2, 4, 15, 40}) {
    SCOPED_TRACE("stride " + std::to_string(stride));
    const ReplayResult result = replay(reasoning, PlanKind::kDeftFlatten, 0, stride);
    ASSERT_TRUE(result.status.ok()) << result.status;
    expect_shape_eq(result.iterations, want);
    expect_steps_follow_shape(result, stride, 15);
    EXPECT_EQ(result.generated_tokens, sum_queries(want));  // the fast-forwarded ones' too
    EXPECT_EQ(result.kv_pages_left, 0);
  }
}

// The first complete tree of every reasoning task, every iteration's shape (a short prompt and
// a large stride keep it quick on the CPU), and the first iterations run step by step.
TEST_F(WorkloadReplayTest, ReasoningTracesReplayInFull) {
  for (const char* task : {"sorting128ToT", "docmergeToT", "keywordToT", "set128ToT"}) {
    SCOPED_TRACE(task);
    absl::StatusOr<std::vector<ReasoningTrace>> traces =
        load_reasoning_traces(kWorkloads + "/reasoning/" + task + ".json");
    ASSERT_TRUE(traces.ok()) << traces.status();
    ASSERT_FALSE(traces->empty());
    const ReasoningWorkload reasoning{.trace = traces->front(), .prompt_tokens = 24};
    const int64_t iterations = reasoning.trace.last_iteration;
    EXPECT_EQ(workload_iterations(reasoning), iterations);
    const std::vector<IterationShape> want = expected_reasoning(reasoning.trace, 24, iterations);

    const ReplayResult full = replay(reasoning, PlanKind::kDeftFlatten, 0, 97);
    ASSERT_TRUE(full.status.ok()) << full.status;
    expect_shape_eq(full.iterations, want);
    expect_steps_follow_shape(full, 97, iterations);
    EXPECT_EQ(full.kv_pages_left, 0);

    const ReplayResult head = replay(reasoning, PlanKind::kSequence, 12);
    ASSERT_TRUE(head.status.ok()) << head.status;
    expect_shape_eq(head.iterations, std::vector<IterationShape>(want.begin(), want.begin() + 12));
    expect_steps_follow_shape(head, 1, 12);
    EXPECT_EQ(head.generated_tokens, sum_queries(head.iterations));
    EXPECT_EQ(head.kv_pages_left, 0);
  }
}

// Stride sampling (the benchmark's default: sequence 4, deft_node 8) over every reasoning
// trace: every iteration's tree, run or fast-forwarded, is the trace's, and the fast-forwarded
// iterations produce their tokens (one per live node) as the run ones do.
TEST_F(WorkloadReplayTest, ReasoningTracesWithStrideProduceEveryIterationsTokens) {
  const std::pair<PlanKind, int32_t> kStrides[] = {{PlanKind::kSequence, 4},
                                                   {PlanKind::kDeftNode, 8}};
  for (const char* task : {"sorting128ToT", "docmergeToT", "keywordToT", "set128ToT"}) {
    SCOPED_TRACE(task);
    absl::StatusOr<std::vector<ReasoningTrace>> traces =
        load_reasoning_traces(kWorkloads + "/reasoning/" + task + ".json");
    ASSERT_TRUE(traces.ok()) << traces.status();
    ASSERT_FALSE(traces->empty());
    const ReasoningWorkload reasoning{.trace = traces->front(), .prompt_tokens = 24};
    const int64_t iterations = reasoning.trace.last_iteration;
    const std::vector<IterationShape> want = expected_reasoning(reasoning.trace, 24, iterations);
    for (const auto& [kind, stride] : kStrides) {
      SCOPED_TRACE(std::string(engine::plan_kind_name(kind)) + " stride " + std::to_string(stride));
      const ReplayResult result = replay(reasoning, kind, 0, stride);
      ASSERT_TRUE(result.status.ok()) << result.status;
      expect_shape_eq(result.iterations, want);
      expect_steps_follow_shape(result, stride, iterations);
      EXPECT_EQ(result.generated_tokens, sum_queries(want));
      EXPECT_EQ(result.kv_pages_left, 0);
    }
  }
}

// Step s verifies the whole tree under the session node, which then holds the prompt and every
// token committed before (the trace's accept lengths, in order).
TEST_F(WorkloadReplayTest, SpeculativeStepsCommitTheRecordedAcceptLengths) {
  for (int32_t size : {32, 64}) {
    SCOPED_TRACE("tree " + std::to_string(size));
    absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(
        kWorkloads + "/speculative_decoding/apps_tree_size" + std::to_string(size) + ".json");
    ASSERT_TRUE(trace.ok()) << trace.status();
    ASSERT_EQ(trace->tree_size(), size);
    for (int32_t prompt : {40, 300}) {
      SCOPED_TRACE("prompt " + std::to_string(prompt));
      SpecDecWorkload spec{.parents = trace->parent,
                           .accept_lengths = trace->accept_lengths.front(),
                           .prompt = std::vector<engine::TokenId>(prompt, 7),
                           .generate_tokens = 61};
      std::vector<IterationShape> want;
      for (int64_t committed = 0, s = 0; committed < 61; ++s) {
        want.push_back({.queries = size, .tree_tokens = prompt + committed + size});
        committed += std::min<int64_t>(spec.accept_lengths[s], 61 - committed);
      }
      EXPECT_EQ(workload_iterations(spec), std::ssize(want));
      for (PlanKind kind : kAllKinds) {
        SCOPED_TRACE(std::string(engine::plan_kind_name(kind)));
        const ReplayResult result = replay(spec, kind);
        ASSERT_TRUE(result.status.ok()) << result.status;
        expect_shape_eq(result.iterations, want);
        expect_steps_follow_shape(result, 1, std::ssize(want));
        EXPECT_EQ(result.generated_tokens, 61);
        EXPECT_EQ(result.kv_pages_left, 0);
      }
      const ReplayResult sampled = replay(spec, PlanKind::kDeftFlatten, 0, 3);
      ASSERT_TRUE(sampled.status.ok()) << sampled.status;
      expect_shape_eq(sampled.iterations, want);
      expect_steps_follow_shape(sampled, 3, std::ssize(want));
      EXPECT_EQ(sampled.generated_tokens, 61);
      const ReplayResult capped = replay(spec, PlanKind::kDeftFlatten, 4);
      ASSERT_TRUE(capped.status.ok()) << capped.status;
      expect_shape_eq(capped.iterations,
                      std::vector<IterationShape>(want.begin(), want.begin() + 4));
      EXPECT_EQ(capped.kv_pages_left, 0);
    }
  }
}

// The APPS prompt's length without Llama 3's tokenizer is what that tokenizer gives (checked
// where the tokenizer is fetched: scripts/fetch_tokenizers.sh).
TEST_F(WorkloadReplayTest, AppsPromptLengthIsLlama3s) {
  const std::string llama3 = DEFT_SOURCE_DIR "/.cache/tokenizers/llama3";
  absl::StatusOr<std::string> text =
      load_specdec_prompt(kWorkloads + "/speculative_decoding/apps_tree_size64.json");
  ASSERT_TRUE(text.ok()) << text.status();
  for (int32_t size : {32, 128, 256}) {
    absl::StatusOr<std::string> other = load_specdec_prompt(
        kWorkloads + "/speculative_decoding/apps_tree_size" + std::to_string(size) + ".json");
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(*other, *text) << "tree " << size << " has another first prompt";
  }
  EXPECT_EQ(specdec_prompt_tokens(*text, *tokenizer_, 512, 1).size(),
            static_cast<size_t>(kAppsPromptLlama3Tokens));
  if (!std::filesystem::exists(llama3 + "/tokenizer.json")) {
    GTEST_SKIP() << "no Llama 3 tokenizer in " << llama3;
  }
  absl::StatusOr<std::unique_ptr<engine::Tokenizer>> tokenizer = engine::load_tokenizer(llama3);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  ASSERT_TRUE(is_llama3_tokenizer(**tokenizer));
  EXPECT_EQ(specdec_prompt_tokens(*text, **tokenizer, 128256, 1).size(),
            static_cast<size_t>(kAppsPromptLlama3Tokens));
}

}  // namespace
}  // namespace deft::bench
