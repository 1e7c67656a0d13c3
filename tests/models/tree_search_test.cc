// A RunTree job (engine/works/tree_search_work.h) on the engine's Scheduler, the loop deft-server
// and deft-tree run, on the embedded default model (CPU backend): every branch is what a
// single-sequence decode of its path predicts (argmax inside nodes, the i-th most likely token
// for child i of a branch point), every plan kind gives the same tree, and depth 0 is plain
// greedy decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/tree_search_work.h"
#include "models/llama_cpu.h"
#include "tests/models/tiny_llama.h"

namespace deft::engine {
namespace {

constexpr int32_t kPageTokens = 8;
constexpr int32_t kPages = 512;
const std::string kModelDir = DEFT_SOURCE_DIR "/models/default";

class TreeSearchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = load_tokenizer(kModelDir);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer);
  }

  TreeSearchJob small_job() const {
    return {.prompt = *tokenizer_->encode("Once upon a time", /*add_bos=*/true,
                                          /*parse_special=*/false),
            .policy = {.branch_factor = 3, .every_tokens = 4, .max_depth = 2},
            .sampling = {.temperature = 0.0f},
            .max_tokens = 10,
            .limits = {.ignore_eos = true}};
  }

  // Runs `job` alone on a fresh scheduler to its end; returns the finished tree.
  TreeSearchEvent run(TreeSearchJob job, PlanKind kind = PlanKind::kDeftFlatten) {
    absl::StatusOr<std::unique_ptr<models::LlamaCpuRunner>> runner =
        models::LlamaCpuRunner::load(kModelDir, int64_t{kPages} * kPageTokens);
    EXPECT_TRUE(runner.ok()) << runner.status();
    SchedulerOptions options{.page_tokens = kPageTokens, .kv_pages = kPages};
    options.planner.kind = kind;
    options.planner.chunk_tokens = 8;
    Scheduler scheduler(options, **runner, *tokenizer_);
    auto events = std::make_shared<TreeSearchEvents>();
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<TreeSearchWork>(std::move(job), events, *tokenizer_,
                                                             kPageTokens))
                    .ok());
    for (int i = 0; i < 1000 && !events->finished(); ++i) {
      scheduler.prepare();
      (void)scheduler.step();
    }
    EXPECT_TRUE(events->finished());
    EXPECT_TRUE(events->final_status().ok()) << events->final_status();
    // The job's KV is freed when it ends, or kept as cached prefixes (engine/forest.h): none of
    // it is referenced any more.
    EXPECT_EQ(scheduler.forest().referenced_pages(), 0) << "the job's KV is let go when it ends";
    EXPECT_EQ(scheduler.kv().used_pages(), scheduler.forest().cached_pages());
    std::vector<TreeSearchEvent> all;
    events->next(all, std::chrono::milliseconds(0));
    EXPECT_FALSE(all.empty());
    EXPECT_EQ(all.back().kind, TreeSearchEvent::Kind::kFinished);
    return all.empty() ? TreeSearchEvent{} : std::move(all.back());
  }

  std::unique_ptr<Tokenizer> tokenizer_;
};

std::vector<std::vector<TokenId>> tokens_of(const TreeSearchEvent& tree) {
  std::vector<std::vector<TokenId>> tokens;
  for (const TreeSearchNode& node : tree.nodes) tokens.push_back(node.tokens);
  return tokens;
}

// Rank of `token` in `row` (0: the most likely; ties to the lower id).
int32_t rank_of(std::span<const float> row, TokenId token) {
  int32_t rank = 0;
  for (TokenId other = 0; other < static_cast<TokenId>(row.size()); ++other) {
    if (row[other] > row[token] || (row[other] == row[token] && other < token)) ++rank;
  }
  return rank;
}

TEST_F(TreeSearchTest, EveryBranchMatchesItsPathDecodedAlone) {
  const TreeSearchJob job = small_job();
  const TreeSearchEvent tree = run(job);
  const std::vector<TreeSearchNode>& nodes = tree.nodes;
  ASSERT_EQ(nodes.size(), 1u + 3u + 9u);
  std::vector<std::vector<int32_t>> children(nodes.size());
  for (const TreeSearchNode& node : nodes) {
    if (node.parent >= 0) children[node.parent].push_back(node.id);
  }
  models::testing::RunnerHarness harness(kModelDir, kPages, kPageTokens);
  int32_t leaves = 0;
  for (const TreeSearchNode& leaf : nodes) {
    if (!children[leaf.id].empty()) continue;
    ++leaves;
    std::vector<int32_t> path;
    for (int32_t id = leaf.id; id != -1; id = nodes[id].parent) path.push_back(id);
    std::reverse(path.begin(), path.end());
    std::vector<TokenId> sequence = job.prompt;
    std::vector<int32_t> expected_rank;  // per generated token
    for (int32_t id : path) {
      if (id == 0) continue;
      const std::vector<int32_t>& siblings = children[nodes[id].parent];
      const auto child_index =
          static_cast<int32_t>(std::find(siblings.begin(), siblings.end(), id) - siblings.begin());
      for (size_t t = 0; t < nodes[id].tokens.size(); ++t) {
        expected_rank.push_back(t == 0 ? child_index : 0);
        sequence.push_back(nodes[id].tokens[t]);
      }
    }
    ASSERT_EQ(expected_rank.size(), static_cast<size_t>(job.max_tokens)) << "leaf " << leaf.id;
    std::unique_ptr<SequenceTree> alone = harness.new_tree();
    const models::testing::TreeStep step =
        models::testing::RunnerHarness::append(*alone, alone->root(), sequence);
    const std::vector<std::vector<float>> logits = harness.step({&step, 1});
    const size_t prompt = job.prompt.size();
    for (size_t g = 0; g < expected_rank.size(); ++g) {
      EXPECT_EQ(rank_of(logits[prompt - 1 + g], sequence[prompt + g]), expected_rank[g])
          << "leaf " << leaf.id << ", generated token " << g;
    }
  }
  EXPECT_EQ(leaves, 9);
}

TEST_F(TreeSearchTest, PlanKindsGiveTheSameTree) {
  const std::vector<std::vector<TokenId>> reference = tokens_of(run(small_job()));
  for (PlanKind kind :
       {PlanKind::kDeftNode, PlanKind::kDeftNodeChunk, PlanKind::kSequence, PlanKind::kDenseMask}) {
    EXPECT_EQ(tokens_of(run(small_job(), kind)), reference) << plan_kind_name(kind);
  }
}

TEST_F(TreeSearchTest, DepthZeroIsPlainGreedyDecoding) {
  TreeSearchJob job = small_job();
  job.policy = {.branch_factor = 1, .every_tokens = 4, .max_depth = 0};
  job.max_tokens = 13;
  const TreeSearchEvent tree = run(job);
  ASSERT_EQ(tree.nodes.size(), 2u);
  models::testing::RunnerHarness harness(kModelDir, kPages, kPageTokens);
  std::vector<std::vector<float>> logits;
  std::vector<TokenId> alone;
  harness.decode_alone(job.prompt, 13, &logits, &alone);
  EXPECT_EQ(tree.nodes[1].tokens, alone);
}

// 64 children a level over 16 levels is 2^96 nodes: the bounds saturate (a signed overflow
// before; UBSan found it in the server's RunTree under ASan + UBSan) and so exceed any limit.
TEST(TreeSearchBounds, SaturateForWideDeepPolicies) {
  TreeSearchJob job;
  job.prompt = {1, 2, 3};
  job.max_tokens = 64;
  job.policy = {.branch_factor = 64, .every_tokens = 1, .max_depth = 16};
  const TreeSearchBounds bounds = tree_search_bounds(job, /*page_tokens=*/16);
  EXPECT_EQ(bounds.tokens, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(bounds.pages, std::numeric_limits<int64_t>::max());
  job.policy = {.branch_factor = 2, .every_tokens = 4, .max_depth = 2, .keep_best = 1};
  const TreeSearchBounds small = tree_search_bounds(job, 16);
  // Prompt 3; depth 1: 2 nodes x 4 tokens; depth 2: 1 kept x 2 children x 64 tokens.
  EXPECT_EQ(small.tokens, 3 + 2 * 4 + 2 * 64);
}

}  // namespace
}  // namespace deft::engine
