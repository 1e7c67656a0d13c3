// engine/tree_job on the CPU runner: the tree has the asked shape, every branch is what a
// single-sequence decode of its path predicts (argmax inside nodes, the i-th most likely token
// for child i of a branch point), plan kinds agree, sampling replays from its seed, EOS ends a
// branch, and a KV pool too small is reported before anything is over-committed.
#include "engine/tree_job.h"

#include <gtest/gtest.h>

#include <numeric>

#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::BranchEnd;
using engine::NodeId;
using engine::PlanKind;
using engine::TokenId;
using engine::TreeJobNode;
using engine::TreeJobOptions;
using engine::TreeJobResult;
using testing::RunnerHarness;
using testing::TinyLlama;
using testing::TreeStep;
using testing::make_tiny_llama;

TreeJobOptions small_job() {
  TreeJobOptions options;
  options.prompt = {1, 17, 42, 8, 61, 23, 5, 77, 30};
  options.branch_factor = 3;
  options.branch_every = 4;
  options.max_depth = 2;
  options.max_new_tokens = 10;
  options.planner.chunk_tokens = 8;
  return options;
}

absl::StatusOr<TreeJobResult> run(RunnerHarness& harness, const TreeJobOptions& options) {
  return engine::run_tree_job(harness.runner(), harness.kv(), options);
}

// Tokens of the root-to-node path (prompt first) and, per generated token, its node.
std::vector<NodeId> path_of(const std::vector<TreeJobNode>& nodes, NodeId leaf) {
  std::vector<NodeId> path;
  for (NodeId id = leaf; id != -1; id = nodes[id].parent) path.push_back(id);
  std::reverse(path.begin(), path.end());
  return path;
}

// Rank of `token` in `row` (0: the most likely; ties to the lower id).
int32_t rank_of(std::span<const float> row, TokenId token) {
  int32_t rank = 0;
  for (TokenId other = 0; other < static_cast<TokenId>(row.size()); ++other) {
    if (row[other] > row[token] || (row[other] == row[token] && other < token)) ++rank;
  }
  return rank;
}

TEST(TreeJob, HasTheAskedShape) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model, 256, 8);
  const TreeJobOptions options = small_job();
  absl::StatusOr<TreeJobResult> result = run(harness, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<TreeJobNode>& nodes = result->nodes;
  ASSERT_EQ(nodes.size(), 1u + 3u + 9u);
  EXPECT_EQ(nodes[0].tokens, options.prompt);
  EXPECT_EQ(nodes[0].children.size(), 3u);
  int32_t leaves = 0;
  for (const TreeJobNode& node : nodes) {
    if (node.level == 1) {
      EXPECT_EQ(node.tokens.size(), 4u) << "node " << node.id;
      EXPECT_EQ(node.children.size(), 3u);
      EXPECT_EQ(node.end, BranchEnd::kNone);
    } else if (node.level == 2) {
      ++leaves;
      EXPECT_EQ(node.tokens.size(), 6u) << "node " << node.id;
      EXPECT_TRUE(node.children.empty());
      EXPECT_EQ(node.end, BranchEnd::kMaxTokens);
    }
  }
  EXPECT_EQ(leaves, 9);
  EXPECT_EQ(result->stats.leaves, 9);
  EXPECT_EQ(result->stats.generated_tokens, 3 * 4 + 9 * 6);
  // Prefill, then one step per token of the longest path but the last (sampled, not run).
  EXPECT_EQ(result->stats.steps, 1 + options.max_new_tokens - 1);
  EXPECT_EQ(harness.kv().used_pages(), 0) << "the job's pages are freed on return";
  EXPECT_LE(result->stats.peak_kv_pages,
            engine::tree_job_max_pages(options, harness.kv().page_tokens()));
}

// Every branch, re-run as one plain sequence, predicts exactly the job's tokens: the argmax
// inside a node, the i-th most likely token for the i-th child of a branch point.
TEST(TreeJob, EveryBranchMatchesItsPathDecodedAlone) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model, 512, 8);
  const TreeJobOptions options = small_job();
  absl::StatusOr<TreeJobResult> result = run(harness, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<TreeJobNode>& nodes = result->nodes;
  for (const TreeJobNode& leaf : nodes) {
    if (!leaf.children.empty()) continue;
    std::vector<TokenId> sequence;
    std::vector<int32_t> expected_rank;  // per generated token
    for (NodeId id : path_of(nodes, leaf.id)) {
      const TreeJobNode& node = nodes[id];
      for (size_t t = 0; t < node.tokens.size(); ++t) {
        if (id != 0) {
          const auto& siblings = nodes[node.parent].children;
          const int32_t child_index = static_cast<int32_t>(
              std::find(siblings.begin(), siblings.end(), id) - siblings.begin());
          expected_rank.push_back(t == 0 ? child_index : 0);
        }
        sequence.push_back(node.tokens[t]);
      }
    }
    std::unique_ptr<engine::SequenceTree> tree = harness.new_tree();
    const TreeStep step = RunnerHarness::append(*tree, tree->root(), sequence);
    const std::vector<std::vector<float>> logits = harness.step({&step, 1});
    const size_t prompt = options.prompt.size();
    for (size_t g = 0; g < expected_rank.size(); ++g) {
      EXPECT_EQ(rank_of(logits[prompt - 1 + g], sequence[prompt + g]), expected_rank[g])
          << "leaf " << leaf.id << ", generated token " << g;
    }
  }
}

TEST(TreeJob, PlanKindsGiveTheSameTree) {
  const TinyLlama model = make_tiny_llama({});
  std::vector<std::vector<TokenId>> reference;
  for (PlanKind kind : {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                        PlanKind::kSequence, PlanKind::kDenseMask}) {
    RunnerHarness harness(model, 256, 8);
    TreeJobOptions options = small_job();
    options.planner.kind = kind;
    absl::StatusOr<TreeJobResult> result = run(harness, options);
    ASSERT_TRUE(result.ok()) << result.status();
    std::vector<std::vector<TokenId>> tokens;
    for (const TreeJobNode& node : result->nodes) tokens.push_back(node.tokens);
    if (reference.empty()) {
      reference = tokens;
    } else {
      EXPECT_EQ(tokens, reference) << engine::plan_kind_name(kind);
    }
  }
}

TEST(TreeJob, SamplingReplaysFromItsSeed) {
  const TinyLlama model = make_tiny_llama({});
  TreeJobOptions options = small_job();
  options.sampling.temperature = 1.0f;
  options.sampling.seed = 7;
  auto tokens_of = [&](const TreeJobOptions& job) {
    RunnerHarness harness(model, 256, 8);
    absl::StatusOr<TreeJobResult> result = run(harness, job);
    EXPECT_TRUE(result.ok()) << result.status();
    std::vector<std::vector<TokenId>> tokens;
    for (const TreeJobNode& node : result->nodes) tokens.push_back(node.tokens);
    return tokens;
  };
  const auto first = tokens_of(options);
  EXPECT_EQ(tokens_of(options), first);
  options.sampling.seed = 8;
  EXPECT_NE(tokens_of(options), first);
}

TEST(TreeJob, EosEndsItsBranch) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model, 256, 8);
  TreeJobOptions options = small_job();
  absl::StatusOr<TreeJobResult> plain = run(harness, options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  // Declare the second token of the first branch an EOS: that branch must stop right there.
  const NodeId first_child = plain->nodes[0].children[0];
  const TokenId eos = plain->nodes[first_child].tokens[1];
  options.eos_ids = {eos};
  absl::StatusOr<TreeJobResult> stopped = run(harness, options);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  const TreeJobNode& node = stopped->nodes[stopped->nodes[0].children[0]];
  EXPECT_LE(node.tokens.size(), 2u);  // 1 when the first token was that same id
  EXPECT_EQ(node.tokens.back(), eos);
  EXPECT_EQ(node.end, BranchEnd::kEos);
  EXPECT_TRUE(node.children.empty());
}

TEST(TreeJob, DepthZeroIsOnePlainBranch) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model, 256, 8);
  TreeJobOptions options = small_job();
  options.max_depth = 0;
  options.max_new_tokens = 13;
  absl::StatusOr<TreeJobResult> result = run(harness, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->nodes.size(), 2u);
  EXPECT_EQ(result->nodes[1].tokens.size(), 13u);
  // And it is plain greedy decoding.
  std::vector<std::vector<float>> logits;
  std::vector<TokenId> alone;
  harness.decode_alone(options.prompt, 13, &logits, &alone);
  EXPECT_EQ(result->nodes[1].tokens, alone);
}

TEST(TreeJob, ReportsAKvPoolTooSmallInsteadOfOverCommitting) {
  const TinyLlama model = make_tiny_llama({});
  const TreeJobOptions options = small_job();
  const int64_t enough = engine::tree_job_max_pages(options, 8);
  {
    RunnerHarness harness(model, static_cast<int32_t>(enough), 8);
    absl::StatusOr<TreeJobResult> result = run(harness, options);
    EXPECT_TRUE(result.ok()) << "tree_job_max_pages is enough: " << result.status();
  }
  for (int32_t pages : {1, 4, static_cast<int32_t>(enough) - 3}) {
    RunnerHarness harness(model, pages, 8);
    absl::StatusOr<TreeJobResult> result = run(harness, options);
    ASSERT_FALSE(result.ok()) << pages << " pages";
    EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(result.status().message().find("KV cache too small"), std::string::npos)
        << result.status();
    EXPECT_EQ(harness.kv().used_pages(), 0);
    EXPECT_TRUE(harness.kv().check_invariants());
  }
}

TEST(TreeJob, RefusesBadOptions) {
  const TinyLlama model = make_tiny_llama({});
  RunnerHarness harness(model, 256, 8);
  auto code_of = [&](auto edit) {
    TreeJobOptions options = small_job();
    edit(options);
    return run(harness, options).status().code();
  };
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.prompt.clear(); }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.prompt.push_back(100000); }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.branch_factor = 0; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.branch_every = 0; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.max_depth = -1; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.max_new_tokens = 0; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.sampling.temperature = -1.0f; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.eos_ids = {-5}; }), invalid);
  EXPECT_EQ(code_of([](TreeJobOptions& o) { o.branch_factor = 64; o.max_depth = 5; }), invalid);
}

// The main job's shape on the embedded default model: 4 ways, every 8 tokens, 3 levels.
TEST(TreeJob, RunsTheMainJobOnTheDefaultModel) {
  TreeJobOptions options;
  options.prompt = {1, 100, 200, 300, 400};
  options.max_new_tokens = 32;
  options.eos_ids = {2};
  engine::KvCacheManager kv({.page_tokens = 16,
                             .num_pages = static_cast<int32_t>(
                                 engine::tree_job_max_pages(options, 16))});
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner =
      LlamaCpuRunner::load(DEFT_SOURCE_DIR "/models/default", kv.num_slots());
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<TreeJobResult> result = engine::run_tree_job(**runner, kv, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->stats.leaves, 1);
  EXPECT_LE(result->stats.leaves, 64);
  EXPECT_EQ(kv.used_pages(), 0);
}

}  // namespace
}  // namespace deft::models
