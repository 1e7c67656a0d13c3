// Replays the paper's tree topologies (../shared/workloads) through the planner and checks its IO
// counts against the paper's definitions at every step: DeFT reads each tree token once;
// sequence-based attention reads every query's whole path.
#include <gtest/gtest.h>

#include <filesystem>

#include "bench/workload_trace.h"
#include "engine/attention_planner.h"

namespace deft::engine {
namespace {

using bench::load_reasoning_traces;
using bench::load_specdec_trace;
using bench::ReasoningReplay;
using bench::ReasoningTrace;
using bench::SpecDecReplay;
using bench::SpecDecTrace;

const std::string kWorkloads = DEFT_WORKLOADS_DIR;

// Tokens visible to at least one query, counted by marking paths (independent of the planner).
int64_t distinct_visible_tokens(const SequenceTree& tree, std::span<const QueryToken> queries) {
  std::vector<int64_t> visible(tree.node_id_limit(), 0);
  for (const QueryToken& q : queries) {
    visible[q.node] = std::max<int64_t>(visible[q.node], q.token_index + 1);
    for (NodeId id = tree.node(q.node).parent; id != -1; id = tree.node(id).parent) {
      visible[id] = static_cast<int64_t>(tree.node(id).tokens.size());
    }
  }
  int64_t total = 0;
  for (int64_t v : visible) total += v;
  return total;
}

int64_t sum_of_paths(const SequenceTree& tree, std::span<const QueryToken> queries) {
  int64_t total = 0;
  for (const QueryToken& q : queries) total += tree.depth(q.node, q.token_index) + 1;
  return total;
}

void skip_without_workloads() {
  if (!std::filesystem::exists(kWorkloads)) {
    GTEST_SKIP() << "workload traces not found at " << kWorkloads
                 << " (the shared/ folder beside the checkout)";
  }
}

class ReasoningReplayTest : public testing::TestWithParam<std::string> {};

TEST_P(ReasoningReplayTest, PlannerIoMatchesThePaperAtEveryStep) {
  skip_without_workloads();
  if (testing::Test::IsSkipped()) return;
  absl::StatusOr<std::vector<ReasoningTrace>> traces =
      load_reasoning_traces(kWorkloads + "/reasoning/" + GetParam() + ".json");
  ASSERT_TRUE(traces.ok()) << traces.status();
  ASSERT_FALSE(traces->empty());
  const ReasoningTrace& trace = traces->front();  // the paper uses the first tree of each task
  KvCacheManager kv({.page_tokens = 16, .num_pages = 1 << 16});
  SequenceTree tree(0, &kv);
  ReasoningReplay replay(trace, tree);
  AttentionPlanner flatten({.kind = PlanKind::kDeftFlatten});
  AttentionPlanner sequence({.kind = PlanKind::kSequence});
  AttentionPlan plan;
  std::vector<QueryToken> queries;
  int32_t steps = 0;
  int64_t flatten_io = 0, sequence_io = 0;
  while (replay.step(queries)) {
    ++steps;
    std::vector<TreeQueries> input = {{&tree, queries}};
    ASSERT_TRUE(flatten.plan(input, plan).ok());
    ASSERT_LE(queries.size(), 64u);
    // Every live leaf decodes, so the visible KV is the whole tree.
    ASSERT_EQ(plan.io.kv_tokens_read, tree.total_tokens()) << "iteration " << replay.iteration();
    ASSERT_EQ(plan.io.kv_tokens_read, distinct_visible_tokens(tree, queries));
    flatten_io += plan.io.kv_tokens_read;
    ASSERT_TRUE(sequence.plan(input, plan).ok());
    ASSERT_EQ(plan.io.kv_tokens_read, sum_of_paths(tree, queries))
        << "iteration " << replay.iteration();
    sequence_io += plan.io.kv_tokens_read;
  }
  ASSERT_TRUE(replay.status().ok()) << replay.status();
  EXPECT_EQ(steps, trace.last_iteration);
  EXPECT_LT(flatten_io, sequence_io);
  RecordProperty("flatten_kv_tokens", std::to_string(flatten_io));
  RecordProperty("sequence_kv_tokens", std::to_string(sequence_io));
}

INSTANTIATE_TEST_SUITE_P(Workloads, ReasoningReplayTest,
                         testing::Values("sorting128ToT", "docmergeToT", "keywordToT",
                                         "set128ToT"));

class SpecDecReplayTest : public testing::TestWithParam<int> {};

TEST_P(SpecDecReplayTest, PlannerIoMatchesThePaperAtEveryStep) {
  skip_without_workloads();
  if (testing::Test::IsSkipped()) return;
  const int tree_size = GetParam();
  absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(
      kWorkloads + "/speculative_decoding/apps_tree_size" + std::to_string(tree_size) + ".json");
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->tree_size(), tree_size);
  KvCacheManager kv({.page_tokens = 16, .num_pages = 1 << 15});
  SequenceTree tree(0, &kv);
  SpecDecReplay replay(*trace, tree, /*prefix_tokens=*/1000);
  AttentionPlanner flatten({.kind = PlanKind::kDeftFlatten, .max_unmasked_queries = 256});
  AttentionPlanner sequence({.kind = PlanKind::kSequence});
  AttentionPlan plan;
  std::vector<QueryToken> queries;
  for (int32_t accepted : trace->accept_lengths.front()) {
    replay.build_token_tree(queries);
    ASSERT_TRUE(replay.status().ok()) << replay.status();
    std::vector<TreeQueries> input = {{&tree, queries}};
    ASSERT_TRUE(flatten.plan(input, plan).ok());
    const int64_t tree_tokens = tree.total_tokens();
    ASSERT_EQ(distinct_visible_tokens(tree, queries), tree_tokens);
    if (tree_size <= 64) {
      ASSERT_EQ(plan.io.kv_tokens_read, tree_tokens);
    } else {
      // Masked chunks hold at most 64 queries per mask word: only the token-tree chunks are
      // read once per group of 64; the shared prefix is still read once.
      const int64_t groups = (tree_size + 63) / 64;
      const int64_t chunk = adaptive_chunk_tokens(tree_size, tree_tokens);
      ASSERT_GE(plan.io.kv_tokens_read, tree_tokens);
      ASSERT_LE(plan.io.kv_tokens_read, tree_tokens + (groups - 1) * (tree_size + chunk));
    }
    ASSERT_TRUE(sequence.plan(input, plan).ok());
    ASSERT_EQ(plan.io.kv_tokens_read, sum_of_paths(tree, queries));
    replay.commit(accepted);
    ASSERT_TRUE(replay.status().ok()) << replay.status();
  }
  EXPECT_EQ(kv.used_pages(), static_cast<int32_t>((tree.total_tokens() + 15) / 16));
}

INSTANTIATE_TEST_SUITE_P(Workloads, SpecDecReplayTest, testing::Values(32, 64, 128, 256));

TEST(WorkloadTrace, MissingOrMalformedFilesAreErrors) {
  EXPECT_EQ(load_reasoning_traces("/nonexistent.json").status().code(),
            absl::StatusCode::kNotFound);
  const std::string path = testing::TempDir() + "/bad.json";
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("{not json", f);
  std::fclose(f);
  EXPECT_EQ(load_specdec_trace(path).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deft::engine
