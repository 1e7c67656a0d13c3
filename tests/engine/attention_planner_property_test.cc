// Property tests of the attention planner on seeded random trees (tests/testing/random_tree.h),
// for every plan kind and every kind of query a step can hold:
//   decode      one new token per live leaf;
//   extend      a run of new tokens of one node (a prefill when the tree is a bare root);
//   token tree  a token tree of single-token nodes hung under a node (speculative verification);
//   multi-tree  several trees, each with one of the kinds above, planned in one step.
// Properties checked on every plan:
//   (a) expanding the plan (each entry sees the slots its task's run and mask give it) yields,
//       for every query row, exactly the slots of its context, each once: every visible
//       (query, KV token) pair is covered by exactly one entry and no invisible pair by any;
//       the rows' positions and slots are those of their tokens;
//   (d) each task's ready prefix (task_kv_ready) holds no slot the step writes, and stops at one;
//   (b) deft_attention_cpu on the plan equals the float64 naive attention over each row's
//       context (relative error < 1e-5), for GQA group sizes 1, 4 and 8;
//   (c) io.kv_tokens_read is the sum of the task runs and at least the number of tree tokens
//       some query sees; for DeFT-Flatten with at most 64 queries per tree (and unmasked groups
//       of at least 64) it equals that number; for the sequence baseline it is the sum of the
//       queries' context lengths.
// A failure prints the seed; DEFT_TEST_SEED=<seed> with --gtest_filter on the test replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/attention_params.h"
#include "kernels/deft_attention_cpu.h"
#include "tests/testing/naive_tree_attention.h"
#include "tests/testing/random_tree.h"

namespace deft::engine {
namespace {

using test::TestRng;

constexpr double kMaxRelativeError = 1e-5;
constexpr int32_t kHeadDim = 16;  // kernels/ tests cover 64 and 128; the planner is shape-blind
constexpr int32_t kNumKvHeads = 2;
constexpr int32_t kCasesPerGroupSize = 4;

using test::QueryKind;
using test::RandomStep;

// Trees of width 1..64, depth 1..12, nodes of 1..2000 tokens; the token budget per tree keeps
// the whole binary well under a minute on one core (the naive attention costs queries x
// context x heads x head_dim).
const test::RandomStepLimits kLimits{};

// Property (a) for one row: the plan gives it exactly `expected` (sorted), each slot once.
// Returns false (after reporting the failure) when it does not.
bool expect_row_coverage(const RandomStep& step, int32_t row, std::vector<int32_t> got,
                         const std::vector<int32_t>& expected) {
  std::sort(got.begin(), got.end());
  if (got == expected) return true;
  std::ostringstream what;
  for (size_t i = 1; i < got.size(); ++i) {
    if (got[i] == got[i - 1]) {
      what << "slot " << got[i] << " (" << step.describe_slot(got[i]) << ") covered twice; ";
      break;
    }
  }
  std::vector<int32_t> missing, extra;
  std::set_difference(expected.begin(), expected.end(), got.begin(), got.end(),
                      std::back_inserter(missing));
  std::set_difference(got.begin(), got.end(), expected.begin(), expected.end(),
                      std::back_inserter(extra));
  if (!missing.empty()) {
    what << missing.size() << " visible slots missing, e.g. " << missing.front() << " ("
         << step.describe_slot(missing.front()) << "); ";
  }
  if (!extra.empty()) {
    what << extra.size() << " invisible slots covered, e.g. " << extra.front() << " ("
         << step.describe_slot(extra.front()) << "); ";
  }
  ADD_FAILURE() << "row " << row << ": " << what.str() << "plan gives " << got.size()
                << " slots, context has " << expected.size();
  return false;
}

// Checks properties (a), (b), (c) of `plan` for `step`.
void check_plan(const RandomStep& step, const PlannerOptions& options, const AttentionPlan& plan,
                int32_t group_size, TestRng& rng, std::vector<float>& k_cache,
                std::vector<float>& v_cache) {
  const kernels::AttentionPlanView view = plan.view();
  std::vector<std::vector<int32_t>> context = step.context();
  const auto num_queries = static_cast<int32_t>(context.size());
  ASSERT_EQ(plan.num_queries, num_queries);
  ASSERT_EQ(static_cast<int32_t>(plan.query_position.size()), num_queries);
  ASSERT_EQ(static_cast<int32_t>(plan.query_slot.size()), num_queries);

  // (a) Coverage, and each row's own position and slot.
  std::vector<std::vector<int32_t>> covered = test::plan_visible_slots(view);
  int32_t row = 0;
  for (size_t t = 0; t < step.trees.size(); ++t) {
    const SequenceTree& tree = *step.trees[t];
    for (const QueryToken& query : step.queries[t]) {
      EXPECT_EQ(plan.query_position[row], tree.depth(query.node, query.token_index))
          << "row " << row;
      EXPECT_EQ(plan.query_slot[row], step.kv->slot(tree.kv_key(query.node), query.token_index))
          << "row " << row;
      ++row;
    }
  }
  int64_t context_tokens = 0;
  int32_t failing_rows = 0;
  for (row = 0; row < num_queries; ++row) {
    std::sort(context[row].begin(), context[row].end());
    context_tokens += static_cast<int64_t>(context[row].size());
    if (failing_rows < 5) {  // a few rows say enough
      failing_rows += !expect_row_coverage(step, row, std::move(covered[row]), context[row]);
    }
  }
  // Every entry sees at least one token of its task (the kernels rely on it).
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    if (view.task_mask_begin[task] == -1) continue;
    uint64_t any = 0;
    for (int32_t i = 0; i < view.task_kv_end[task] - view.task_kv_begin[task]; ++i) {
      any |= view.mask_words[view.task_mask_begin[task] + i];
    }
    const int32_t entries = view.task_entry_begin[task + 1] - view.task_entry_begin[task];
    ASSERT_LE(entries, kernels::kMaskWordBits) << "task " << task;
    const uint64_t all = entries == 64 ? ~uint64_t{0} : (uint64_t{1} << entries) - 1;
    ASSERT_EQ(any & all, all) << "task " << task << " has an entry that sees no token";
  }
  // (d) A task's ready tokens hold no slot that the step writes (a row's own slot), and the
  // token after them does: the kernel reads them before the step's KV write has finished.
  ASSERT_NE(view.task_kv_ready, nullptr);
  std::vector<int32_t> written(plan.query_slot.begin(), plan.query_slot.end());
  std::sort(written.begin(), written.end());
  const auto is_written = [&](int32_t slot) {
    return std::binary_search(written.begin(), written.end(), slot);
  };
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    const int32_t begin = view.task_kv_begin[task];
    const int32_t tokens = view.task_kv_end[task] - begin;
    const int32_t ready = view.task_kv_ready[task];
    ASSERT_GE(ready, 0) << "task " << task;
    ASSERT_LE(ready, tokens) << "task " << task;
    for (int32_t i = 0; i < ready; ++i) {
      ASSERT_FALSE(is_written(view.kv_slots[begin + i]))
          << "task " << task << ": token " << i << " is written this step but counted ready ("
          << ready << ")";
    }
    if (ready < tokens) {
      EXPECT_TRUE(is_written(view.kv_slots[begin + ready]))
          << "task " << task << ": ready stops at token " << ready << ", which is not written";
    }
  }
  if (::testing::Test::HasFailure()) return;  // (b) and (c) mean little on a wrong cover

  // (c) IO accounting.
  int64_t runs = 0;
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    runs += view.task_kv_end[task] - view.task_kv_begin[task];
  }
  for (const kernels::PrefillRun& run : plan.prefill_runs) {
    runs += run.prefix_tokens + run.num_rows;
    EXPECT_GE(run.num_rows, options.min_prefill_run);
  }
  if (options.min_prefill_run == 0 || options.deterministic) {
    EXPECT_TRUE(plan.prefill_runs.empty());
  }
  EXPECT_EQ(plan.io.kv_tokens_read, runs);
  EXPECT_EQ(plan.io.tasks, view.num_tasks);
  EXPECT_EQ(plan.io.query_chunk_pairs, view.num_entries);
  EXPECT_EQ(plan.io.mask_words, view.num_mask_words);
  // Sorted, so that the random K/V below do not depend on a hash order.
  std::vector<int32_t> seen_by_some;
  for (const std::vector<int32_t>& slots : context) {
    seen_by_some.insert(seen_by_some.end(), slots.begin(), slots.end());
  }
  std::sort(seen_by_some.begin(), seen_by_some.end());
  seen_by_some.erase(std::unique(seen_by_some.begin(), seen_by_some.end()), seen_by_some.end());
  const auto distinct_visible = static_cast<int64_t>(seen_by_some.size());
  EXPECT_GE(plan.io.kv_tokens_read, distinct_visible);
  if (options.kind == PlanKind::kDeftFlatten && step.max_queries_per_tree() <= 64 &&
      options.max_unmasked_queries >= 64 && options.min_prefill_run == 0 &&
      !options.deterministic) {
    EXPECT_EQ(plan.io.kv_tokens_read, distinct_visible)
        << "DeFT-Flatten must read each visible tree token once";
  }
  if (options.kind == PlanKind::kSequence && options.min_prefill_run == 0 &&
      !options.deterministic) {
    EXPECT_EQ(plan.io.kv_tokens_read, context_tokens);
  }
  if (options.deterministic) {
    EXPECT_TRUE(plan.prefill_runs.empty());
    EXPECT_LE(plan.io.kv_tokens_read, context_tokens);
  }

  // (b) Attention through the plan equals the naive attention over each row's context.
  kernels::AttentionDims dims;
  dims.num_kv_heads = kNumKvHeads;
  dims.num_q_heads = kNumKvHeads * group_size;
  dims.head_dim = kHeadDim;
  dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const size_t slot_floats = static_cast<size_t>(kNumKvHeads) * kHeadDim;
  // The caches hold NaN outside the slots some query sees (a plan reading one would poison its
  // row), and are put back that way afterwards.
  for (int32_t slot : seen_by_some) {
    rng.fill(std::span(k_cache).subspan(slot * slot_floats, slot_floats));
    rng.fill(std::span(v_cache).subspan(slot * slot_floats, slot_floats));
  }
  std::vector<float> q(static_cast<size_t>(num_queries) * dims.num_q_heads * kHeadDim);
  rng.fill(q);
  std::vector<float> out(q.size(), NAN);
  kernels::deft_attention_cpu(view, dims, q.data(), k_cache.data(), v_cache.data(), out.data());
  const std::vector<double> ref =
      test::naive_tree_attention(dims, q.data(), k_cache.data(), v_cache.data(), context);
  EXPECT_LT(test::relative_error<float>(out, ref), kMaxRelativeError);
  for (int32_t slot : seen_by_some) {
    std::fill_n(k_cache.begin() + slot * slot_floats, slot_floats, NAN);
    std::fill_n(v_cache.begin() + slot * slot_floats, slot_floats, NAN);
  }
}

// Planner options the random cases draw from: the paper's default, small chunks, chunks that
// are not a multiple of the page and tiny unmasked groups, one query per unmasked task,
// prefill runs, and the adaptive B under a small GPU wave (PlannerOptions::wave).
const PlannerOptions kOptionSets[] = {
    {.chunk_tokens = 128, .max_unmasked_queries = 256},
    {.chunk_tokens = 16, .max_unmasked_queries = 64},
    {.chunk_tokens = 7, .max_unmasked_queries = 5},
    {.chunk_tokens = 300, .max_unmasked_queries = 1},
    // Runs of >= 3 consecutive new tokens of a node go to prefill runs (the rest to tasks).
    {.chunk_tokens = 16, .max_unmasked_queries = 64, .min_prefill_run = 3},
    // The adaptive B with a wave of a few CTAs: chunks grow past the base rule's.
    {.wave = {.ctas = 4, .kv_heads = 2, .group_size = 4}},
    // Deterministic plans (the kind and prefill runs ignored): fixed pieces of each path.
    {.chunk_tokens = 16, .deterministic = true},
    {.chunk_tokens = 7, .max_unmasked_queries = 5, .min_prefill_run = 3, .deterministic = true},
    {.deterministic = true},
};

class AttentionPlannerPropertyTest
    : public ::testing::TestWithParam<std::tuple<PlanKind, QueryKind>> {};

TEST_P(AttentionPlannerPropertyTest, PlanCoversContextsAndMatchesNaiveAttention) {
  const auto [kind, query_kind] = GetParam();
  const uint64_t seed = test::test_seed(0xdef7'0000 + 16 * static_cast<uint64_t>(kind) +
                                        static_cast<uint64_t>(query_kind));
  SCOPED_TRACE(test::seed_message(seed));
  TestRng rng(seed);

  // One planner per option set, reused across cases (its scratch must not leak between steps),
  // and one plan object reused too (clear() must reset it).
  std::vector<AttentionPlanner> planners;
  for (PlannerOptions options : kOptionSets) {
    options.kind = kind;
    planners.emplace_back(options);
  }
  AttentionPlan plan;
  std::vector<float> k_cache(
      static_cast<size_t>(kLimits.num_pages()) * kLimits.page_tokens * kNumKvHeads * kHeadDim, NAN);
  std::vector<float> v_cache(k_cache.size(), NAN);

  int32_t case_index = 0;
  for (int32_t group_size : {1, 4, 8}) {
    for (int32_t i = 0; i < kCasesPerGroupSize; ++i, ++case_index) {
      AttentionPlanner& planner =
          planners[rng.uniform_int(0, static_cast<int64_t>(planners.size()) - 1)];
      SCOPED_TRACE(::testing::Message()
                   << "case " << case_index << ": group_size " << group_size << ", chunk_tokens "
                   << planner.options().chunk_tokens << ", max_unmasked_queries "
                   << planner.options().max_unmasked_queries);
      RandomStep step;
      ASSERT_NO_FATAL_FAILURE(test::make_random_step(query_kind, kLimits, rng, step));
      const std::vector<TreeQueries> input = step.input();
      DEFT_ASSERT_OK(planner.plan(input, plan));
      ASSERT_EQ(plan.kind, kind);
      ASSERT_NO_FATAL_FAILURE(
          check_plan(step, planner.options(), plan, group_size, rng, k_cache, v_cache));
      if (HasFailure()) return;  // one failing case is enough to read
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPlanKindsAndQueryKinds, AttentionPlannerPropertyTest,
    ::testing::Combine(::testing::Values(PlanKind::kDeftFlatten, PlanKind::kDeftNode,
                                         PlanKind::kDeftNodeChunk, PlanKind::kSequence,
                                         PlanKind::kDenseMask),
                       ::testing::Values(QueryKind::kDecode, QueryKind::kExtend,
                                         QueryKind::kTokenTree, QueryKind::kMultiTree)),
    [](const ::testing::TestParamInfo<std::tuple<PlanKind, QueryKind>>& info) {
      return std::string(plan_kind_name(std::get<0>(info.param))) + "_" +
             test::query_kind_name(std::get<1>(info.param));
    });

TEST(AttentionPlannerKindNames, RoundTrip) {
  for (PlanKind kind : {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                        PlanKind::kSequence, PlanKind::kDenseMask}) {
    PlanKind parsed = PlanKind::kDeftFlatten;
    DEFT_ASSERT_OK(parse_plan_kind(plan_kind_name(kind), &parsed));
    EXPECT_EQ(parsed, kind);
  }
  PlanKind unchanged = PlanKind::kSequence;
  const absl::Status status = parse_plan_kind("deft-flatten", &unchanged);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("deft-flatten"), std::string::npos) << status;
  EXPECT_EQ(unchanged, PlanKind::kSequence);
}

}  // namespace
}  // namespace deft::engine
