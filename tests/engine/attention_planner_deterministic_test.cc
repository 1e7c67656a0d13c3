// Deterministic plans (PlannerOptions::deterministic) on seeded random steps
// (tests/testing/random_tree.h): a query's pieces, each the KV slots it sees, in merge order, are
// the same planned alone (its tree with it as the only query), with any subset of the step's
// queries, or in the whole multi-tree step. Every piece a query sees is a prefix of its task's
// run (the run's first token is the piece's first), pieces start at multiples of B of the
// query's depth, and deft_attention_cpu gives its row the same bits in each plan. Coverage and
// correctness of these plans are the planner property test's (attention_planner_property_test.cc
// runs deterministic option sets too).
// A failure prints the seed; DEFT_TEST_SEED=<seed> with --gtest_filter on the test replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/attention_planner.h"
#include "kernels/attention_params.h"
#include "kernels/deft_attention_cpu.h"
#include "tests/testing/random_tree.h"

namespace deft::engine {
namespace {

using test::QueryKind;
using test::RandomStep;
using test::TestRng;

constexpr int32_t kHeadDim = 16;
constexpr int32_t kNumKvHeads = 2;
constexpr int32_t kGroupSize = 4;

// Smaller trees than the property test's: each case plans every probe alone too.
const test::RandomStepLimits kLimits{
    .max_width = 24, .max_node_tokens = 600, .tree_token_budget = 3000};

// Row `row`'s pieces in merge order: the slots it sees of each entry's task. Fails when a piece
// is not a prefix of its task's run.
std::vector<std::vector<int32_t>> row_pieces(const AttentionPlan& plan, int32_t row) {
  const kernels::AttentionPlanView view = plan.view();
  std::vector<int32_t> task_of(static_cast<size_t>(view.num_entries));
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    for (int32_t e = view.task_entry_begin[task]; e < view.task_entry_begin[task + 1]; ++e) {
      task_of[e] = task;
    }
  }
  std::vector<std::vector<int32_t>> pieces;
  for (int32_t i = view.query_entry_begin[row]; i < view.query_entry_begin[row + 1]; ++i) {
    const int32_t entry = view.query_entries[i];
    const int32_t task = task_of[entry];
    const int32_t bit = entry - view.task_entry_begin[task];
    const int32_t begin = view.task_kv_begin[task];
    const int32_t tokens = view.task_kv_end[task] - begin;
    int32_t seen = 0;
    bool prefix = true;
    for (int32_t j = 0; j < tokens; ++j) {
      const bool visible = view.task_mask_begin[task] == -1 ||
                           ((view.mask_words[view.task_mask_begin[task] + j] >> bit) & 1) != 0;
      if (visible) {
        prefix = prefix && j == seen;
        ++seen;
      }
    }
    EXPECT_TRUE(prefix) << "row " << row << " sees a part of task " << task
                        << " that is not a prefix of its run";
    pieces.emplace_back(view.kv_slots + begin, view.kv_slots + begin + seen);
  }
  return pieces;
}

// deft_attention_cpu's output rows of `plan` for queries `q` (one row per query of the plan).
std::vector<float> attend(const AttentionPlan& plan, const std::vector<float>& q,
                          const std::vector<float>& k_cache, const std::vector<float>& v_cache) {
  kernels::AttentionDims dims{.num_q_heads = kNumKvHeads * kGroupSize,
                              .num_kv_heads = kNumKvHeads,
                              .head_dim = kHeadDim,
                              .softmax_scale = 0.25f};
  std::vector<float> out(q.size(), NAN);
  kernels::deft_attention_cpu(plan.view(), dims, q.data(), k_cache.data(), v_cache.data(),
                              out.data());
  return out;
}

class DeterministicPlanTest : public ::testing::TestWithParam<QueryKind> {};

TEST_P(DeterministicPlanTest, QueryPiecesDoNotDependOnTheStep) {
  const uint64_t seed = test::test_seed(0xde7e'0000 + static_cast<uint64_t>(GetParam()));
  SCOPED_TRACE(test::seed_message(seed));
  TestRng rng(seed);
  const size_t row_floats = static_cast<size_t>(kNumKvHeads) * kGroupSize * kHeadDim;
  for (const PlannerOptions options :
       {PlannerOptions{.chunk_tokens = 16, .deterministic = true},
        PlannerOptions{.chunk_tokens = 7, .max_unmasked_queries = 3, .deterministic = true},
        PlannerOptions{.min_prefill_run = 8, .deterministic = true}}) {
    SCOPED_TRACE(::testing::Message() << "chunk_tokens " << options.chunk_tokens);
    const int32_t chunk =
        options.chunk_tokens > 0 ? options.chunk_tokens : kDeterministicChunkTokens;
    AttentionPlanner planner(options);
    for (int32_t c = 0; c < 3; ++c) {
      RandomStep step;
      ASSERT_NO_FATAL_FAILURE(test::make_random_step(GetParam(), kLimits, rng, step));
      std::vector<float> k_cache(static_cast<size_t>(step.kv->num_slots()) * kNumKvHeads *
                                 kHeadDim);
      std::vector<float> v_cache(k_cache.size());
      rng.fill(k_cache);
      rng.fill(v_cache);
      const std::vector<TreeQueries> input = step.input();
      AttentionPlan whole;
      DEFT_ASSERT_OK(planner.plan(input, whole));
      ASSERT_TRUE(whole.prefill_runs.empty());
      std::vector<float> q(static_cast<size_t>(whole.num_queries) * row_floats);
      rng.fill(q);
      const std::vector<float> whole_out = attend(whole, q, k_cache, v_cache);
      // A random subset of the step (each tree keeps a random part of its queries, in order).
      std::vector<std::vector<QueryToken>> kept(input.size());
      std::vector<std::vector<int32_t>> kept_rows(input.size());
      std::vector<TreeQueries> subset;
      int32_t row = 0;
      for (size_t t = 0; t < input.size(); ++t) {
        for (const QueryToken& query : input[t].queries) {
          if (rng.bernoulli(0.5)) {
            kept[t].push_back(query);
            kept_rows[t].push_back(row);
          }
          ++row;
        }
        if (!kept[t].empty()) subset.push_back({input[t].tree, kept[t]});
      }
      AttentionPlan part;
      DEFT_ASSERT_OK(planner.plan(subset, part));
      std::vector<int32_t> subset_row_of(static_cast<size_t>(whole.num_queries), -1);
      std::vector<float> q_part;
      int32_t part_row = 0;
      for (size_t t = 0; t < input.size(); ++t) {
        for (int32_t r : kept_rows[t]) {
          subset_row_of[r] = part_row++;
          q_part.insert(q_part.end(), q.begin() + r * row_floats, q.begin() + (r + 1) * row_floats);
        }
      }
      const std::vector<float> part_out = attend(part, q_part, k_cache, v_cache);
      // Probes: a few rows, each alone.
      row = 0;
      int32_t probes = 0;
      for (size_t t = 0; t < input.size(); ++t) {
        for (const QueryToken& query : input[t].queries) {
          const int32_t r = row++;
          if (probes >= 8 || !rng.bernoulli(0.3)) continue;
          ++probes;
          SCOPED_TRACE(::testing::Message() << "row " << r);
          AttentionPlan alone;
          const std::vector<TreeQueries> one = {{input[t].tree, {&query, 1}}};
          DEFT_ASSERT_OK(planner.plan(one, alone));
          const std::vector<std::vector<int32_t>> pieces = row_pieces(alone, 0);
          EXPECT_EQ(row_pieces(whole, r), pieces);
          if (subset_row_of[r] >= 0) {
            EXPECT_EQ(row_pieces(part, subset_row_of[r]), pieces);
          }
          // Pieces start at multiples of B of the query's depth and hold up to B tokens.
          const int64_t depth = input[t].tree->depth(query.node, query.token_index);
          ASSERT_EQ(static_cast<int64_t>(pieces.size()), depth / chunk + 1);
          for (size_t k = 0; k + 1 < pieces.size(); ++k) {
            EXPECT_EQ(static_cast<int32_t>(pieces[k].size()), chunk);
          }
          EXPECT_EQ(static_cast<int64_t>(pieces.back().size()), depth % chunk + 1);
          // The executor gives the row the same bits.
          const std::vector<float> q_one(q.begin() + r * row_floats,
                                         q.begin() + (r + 1) * row_floats);
          const std::vector<float> one_out = attend(alone, q_one, k_cache, v_cache);
          EXPECT_EQ(std::memcmp(one_out.data(), whole_out.data() + r * row_floats,
                                row_floats * sizeof(float)),
                    0);
          if (subset_row_of[r] >= 0) {
            EXPECT_EQ(std::memcmp(one_out.data(), part_out.data() + subset_row_of[r] * row_floats,
                                  row_floats * sizeof(float)),
                      0);
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllQueryKinds, DeterministicPlanTest,
                         ::testing::Values(QueryKind::kDecode, QueryKind::kExtend,
                                           QueryKind::kTokenTree, QueryKind::kMultiTree),
                         [](const ::testing::TestParamInfo<QueryKind>& info) {
                           return test::query_kind_name(info.param);
                         });

}  // namespace
}  // namespace deft::engine
