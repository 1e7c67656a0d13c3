// The CPU twin of DeFT attention on hand-built plans, against the float64 naive attention.
// Each plan is built here from an explicit visibility (which KV slots each query row sees), so
// a wrong stage 1 (masks, GQA head mapping, LSE) or stage 2 (merge weights) shows up as an error
// against the naive result.
#include "kernels/deft_attention_cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <set>
#include <span>
#include <tuple>
#include <vector>

#include "kernels/attention_params.h"
#include "tests/testing/naive_tree_attention.h"

namespace deft::kernels {
namespace {

using test::TestRng;

constexpr double kMaxRelativeError = 1e-5;

// An owning plan assembled task by task, in the format of kernels/attention_params.h.
class HandPlan {
 public:
  explicit HandPlan(int32_t num_queries) : num_queries_(num_queries) {}

  // One task over `slots` for query rows `rows`. `masks` empty: no mask; otherwise one word per
  // token, bit j for rows[j].
  void add_task(std::span<const int32_t> slots, std::span<const int32_t> rows,
                std::span<const uint64_t> masks = {}) {
    task_kv_begin_.push_back(static_cast<int32_t>(kv_slots_.size()));
    kv_slots_.insert(kv_slots_.end(), slots.begin(), slots.end());
    task_kv_end_.push_back(static_cast<int32_t>(kv_slots_.size()));
    if (masks.empty()) {
      task_mask_begin_.push_back(-1);
    } else {
      EXPECT_EQ(masks.size(), slots.size());
      EXPECT_LE(rows.size(), static_cast<size_t>(kMaskWordBits));
      task_mask_begin_.push_back(static_cast<int32_t>(mask_words_.size()));
      mask_words_.insert(mask_words_.end(), masks.begin(), masks.end());
    }
    entry_query_.insert(entry_query_.end(), rows.begin(), rows.end());
    task_entry_begin_.push_back(static_cast<int32_t>(entry_query_.size()));
  }

  // Builds the reduction map. With `rng`, each query's entries are listed in a shuffled order
  // (stage 2 must not depend on it).
  void finish(TestRng* rng = nullptr) {
    query_entry_begin_.assign(num_queries_ + 1, 0);
    for (int32_t row : entry_query_) ++query_entry_begin_[row + 1];
    std::partial_sum(query_entry_begin_.begin(), query_entry_begin_.end(),
                     query_entry_begin_.begin());
    query_entries_.assign(entry_query_.size(), -1);
    std::vector<int32_t> fill = query_entry_begin_;
    for (int32_t entry = 0; entry < static_cast<int32_t>(entry_query_.size()); ++entry) {
      query_entries_[fill[entry_query_[entry]]++] = entry;
    }
    if (rng != nullptr) {
      for (int32_t query = 0; query < num_queries_; ++query) {
        const int32_t begin = query_entry_begin_[query];
        for (int32_t i = query_entry_begin_[query + 1] - 1; i > begin; --i) {
          std::swap(query_entries_[i], query_entries_[rng->uniform_int(begin, i)]);
        }
      }
    }
  }

  AttentionPlanView view() const {
    AttentionPlanView view;
    view.num_queries = num_queries_;
    view.num_tasks = static_cast<int32_t>(task_kv_begin_.size());
    view.num_entries = static_cast<int32_t>(entry_query_.size());
    view.num_kv_indices = static_cast<int32_t>(kv_slots_.size());
    view.num_mask_words = static_cast<int32_t>(mask_words_.size());
    view.kv_slots = kv_slots_.data();
    view.task_kv_begin = task_kv_begin_.data();
    view.task_kv_end = task_kv_end_.data();
    view.task_entry_begin = task_entry_begin_.data();
    view.task_mask_begin = task_mask_begin_.data();
    view.mask_words = mask_words_.data();
    view.entry_query = entry_query_.data();
    view.query_entry_begin = query_entry_begin_.data();
    view.query_entries = query_entries_.data();
    return view;
  }

  int32_t num_entries_of(int32_t query) const {
    return query_entry_begin_[query + 1] - query_entry_begin_[query];
  }

 private:
  int32_t num_queries_;
  std::vector<int32_t> kv_slots_;
  std::vector<int32_t> task_kv_begin_;
  std::vector<int32_t> task_kv_end_;
  std::vector<int32_t> task_entry_begin_{0};
  std::vector<int32_t> task_mask_begin_;
  std::vector<uint64_t> mask_words_;
  std::vector<int32_t> entry_query_;
  std::vector<int32_t> query_entry_begin_;
  std::vector<int32_t> query_entries_;
};

// Cuts `flat_slots` into chunks of `chunk_tokens`; in each chunk the rows that see at least one
// of its tokens become entries. A chunk whose every entry sees all of it gets no mask; otherwise
// its entries are split into masked tasks of at most kMaskWordBits.
HandPlan chunked_plan(std::span<const int32_t> flat_slots,
                      const std::vector<std::vector<int32_t>>& visible, int32_t chunk_tokens,
                      TestRng& rng) {
  const auto num_queries = static_cast<int32_t>(visible.size());
  std::vector<std::set<int32_t>> sees(visible.size());
  for (size_t row = 0; row < visible.size(); ++row) {
    sees[row].insert(visible[row].begin(), visible[row].end());
  }
  HandPlan plan(num_queries);
  for (size_t begin = 0; begin < flat_slots.size(); begin += chunk_tokens) {
    const std::span<const int32_t> chunk =
        flat_slots.subspan(begin, std::min<size_t>(chunk_tokens, flat_slots.size() - begin));
    std::vector<int32_t> rows;
    bool needs_mask = false;
    for (int32_t row = 0; row < num_queries; ++row) {
      const auto seen = std::count_if(chunk.begin(), chunk.end(),
                                      [&](int32_t slot) { return sees[row].contains(slot); });
      if (seen == 0) continue;
      rows.push_back(row);
      needs_mask |= seen != static_cast<int64_t>(chunk.size());
    }
    if (rows.empty()) continue;
    if (!needs_mask) {
      plan.add_task(chunk, rows);
      continue;
    }
    for (size_t group = 0; group < rows.size(); group += kMaskWordBits) {
      const std::span<const int32_t> group_rows = std::span<const int32_t>(rows).subspan(
          group, std::min<size_t>(kMaskWordBits, rows.size() - group));
      std::vector<uint64_t> masks(chunk.size(), 0);
      for (size_t i = 0; i < chunk.size(); ++i) {
        for (size_t j = 0; j < group_rows.size(); ++j) {
          if (sees[group_rows[j]].contains(chunk[i])) masks[i] |= uint64_t{1} << j;
        }
      }
      plan.add_task(chunk, group_rows, masks);
    }
  }
  plan.finish(&rng);
  return plan;
}

// `count` distinct slots out of [0, num_slots), in random order: plans must not assume that a
// run's slots are contiguous or sorted.
std::vector<int32_t> scattered_slots(int32_t count, int32_t num_slots, TestRng& rng) {
  std::vector<int32_t> all(num_slots);
  std::iota(all.begin(), all.end(), 0);
  for (int32_t i = num_slots - 1; i > 0; --i) std::swap(all[i], all[rng.uniform_int(0, i)]);
  all.resize(count);
  return all;
}

class DeftAttentionCpuTest : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {
 protected:
  DeftAttentionCpuTest() : rng_(test::test_seed(20261123)) {
    const auto [group_size, head_dim] = GetParam();
    dims_.num_kv_heads = 2;
    dims_.num_q_heads = 2 * group_size;
    dims_.head_dim = head_dim;
    dims_.softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  }

  // Runs the plan on random Q/K/V and compares output and LSE with the naive attention over
  // `visible`; also checks that the plan expands to exactly `visible`.
  void check(const HandPlan& plan, const std::vector<std::vector<int32_t>>& visible,
             int32_t num_slots) {
    SCOPED_TRACE(test::seed_message(rng_.seed()));
    const AttentionPlanView view = plan.view();
    std::vector<std::vector<int32_t>> expanded = test::plan_visible_slots(view);
    for (size_t row = 0; row < visible.size(); ++row) {
      std::vector<int32_t> expected = visible[row];
      std::sort(expected.begin(), expected.end());
      std::sort(expanded[row].begin(), expanded[row].end());
      ASSERT_EQ(expanded[row], expected) << "hand-built plan is wrong for row " << row;
    }

    const size_t q_size = visible.size() * dims_.num_q_heads * dims_.head_dim;
    const size_t kv_size = static_cast<size_t>(num_slots) * dims_.num_kv_heads * dims_.head_dim;
    std::vector<float> q(q_size), k_cache(kv_size), v_cache(kv_size);
    rng_.fill(q);
    rng_.fill(k_cache);
    rng_.fill(v_cache);

    std::vector<float> out(q_size, NAN);
    std::vector<float> lse(visible.size() * dims_.num_q_heads, NAN);
    deft_attention_cpu(view, dims_, q.data(), k_cache.data(), v_cache.data(), out.data(),
                       lse.data());

    std::vector<double> ref_lse;
    const std::vector<double> ref = test::naive_tree_attention(dims_, q.data(), k_cache.data(),
                                                               v_cache.data(), visible, &ref_lse);
    EXPECT_LT(test::relative_error<float>(out, ref), kMaxRelativeError);
    for (size_t i = 0; i < ref_lse.size(); ++i) {
      ASSERT_NEAR(lse[i], ref_lse[i], 1e-5 * std::max(1.0, std::abs(ref_lse[i]))) << "lse " << i;
    }
  }

  AttentionDims dims_;
  TestRng rng_;
};

TEST_P(DeftAttentionCpuTest, SingleTaskAllVisible) {
  constexpr int32_t kNumSlots = 512;
  const std::vector<int32_t> slots = scattered_slots(100, kNumSlots, rng_);
  const std::vector<int32_t> rows = {0, 1, 2, 3, 4};
  HandPlan plan(5);
  plan.add_task(slots, rows);
  plan.finish();
  check(plan, std::vector<std::vector<int32_t>>(5, slots), kNumSlots);
}

// One path of 1000 tokens cut into 8 tasks: every query has 8 partials that stage 2 merges.
TEST_P(DeftAttentionCpuTest, QuerySplitOverTasksIsMerged) {
  constexpr int32_t kNumSlots = 2048;
  const std::vector<int32_t> path = scattered_slots(1000, kNumSlots, rng_);
  const std::vector<std::vector<int32_t>> visible(3, path);
  const HandPlan plan = chunked_plan(path, visible, 128, rng_);
  for (int32_t query = 0; query < 3; ++query) EXPECT_EQ(plan.num_entries_of(query), 8);
  check(plan, visible, kNumSlots);
}

// A shared prefix and 64 branches, all flattened into one masked task of 64 entries (each sees
// the prefix and its own branch), plus the same tree cut into chunks of 32 tokens (unmasked
// prefix chunks, masked branch chunks).
TEST_P(DeftAttentionCpuTest, MaskedTaskWith64Entries) {
  constexpr int32_t kNumSlots = 1024;
  constexpr int32_t kBranches = kMaskWordBits;
  std::vector<int32_t> flat = scattered_slots(40, kNumSlots, rng_);
  const std::vector<int32_t> prefix = flat;
  std::vector<std::vector<int32_t>> visible(kBranches, prefix);
  std::vector<int32_t> free_slots = scattered_slots(kNumSlots, kNumSlots, rng_);
  std::erase_if(free_slots, [&](int32_t slot) {
    return std::find(prefix.begin(), prefix.end(), slot) != prefix.end();
  });
  for (int32_t branch = 0; branch < kBranches; ++branch) {
    const auto length = static_cast<int32_t>(rng_.uniform_int(1, 6));
    for (int32_t i = 0; i < length; ++i) {
      const int32_t slot = free_slots.back();
      free_slots.pop_back();
      flat.push_back(slot);
      visible[branch].push_back(slot);
    }
  }

  const HandPlan one_task = chunked_plan(flat, visible, static_cast<int32_t>(flat.size()), rng_);
  ASSERT_EQ(one_task.view().num_tasks, 1);
  ASSERT_EQ(one_task.view().task_mask_begin[0], 0);
  ASSERT_EQ(one_task.view().num_entries, kMaskWordBits);
  check(one_task, visible, kNumSlots);

  check(chunked_plan(flat, visible, 32, rng_), visible, kNumSlots);
}

// Random visibility: 100 rows over 300 tokens, each token seen by each row with probability
// 0.3 (and every row sees at least one token). Chunks of 50 need up to two masked tasks each.
TEST_P(DeftAttentionCpuTest, RandomMasksOverSeveralGroups) {
  constexpr int32_t kNumSlots = 400;
  constexpr int32_t kRows = 100;
  const std::vector<int32_t> flat = scattered_slots(300, kNumSlots, rng_);
  std::vector<std::vector<int32_t>> visible(kRows);
  for (int32_t row = 0; row < kRows; ++row) {
    for (int32_t slot : flat) {
      if (rng_.bernoulli(0.3)) visible[row].push_back(slot);
    }
    if (visible[row].empty()) visible[row].push_back(flat[rng_.uniform_int(0, 299)]);
  }
  check(chunked_plan(flat, visible, 50, rng_), visible, kNumSlots);
}

// Row 0 has a single partial (one task of its own); row 1 three, one of them shared with row 2
// (masked, row 2 seeing only part of it). Rows' entries are not in row order within the task.
TEST_P(DeftAttentionCpuTest, SinglePartialAndMixedPartials) {
  constexpr int32_t kNumSlots = 256;
  const std::vector<int32_t> slots = scattered_slots(200, kNumSlots, rng_);
  const std::span<const int32_t> all(slots);
  const std::span<const int32_t> own0 = all.subspan(0, 37);
  const std::span<const int32_t> run_a = all.subspan(37, 60);
  const std::span<const int32_t> run_b = all.subspan(97, 3);
  const std::span<const int32_t> run_c = all.subspan(100, 100);

  HandPlan plan(3);
  plan.add_task(own0, std::vector<int32_t>{0});
  plan.add_task(run_a, std::vector<int32_t>{1});
  plan.add_task(run_b, std::vector<int32_t>{1});
  // Entries (row 2, row 1): row 2 sees the first 30 tokens of run_c, row 1 all of them.
  std::vector<uint64_t> masks(run_c.size(), 0b10);
  for (size_t i = 0; i < 30; ++i) masks[i] |= 0b01;
  plan.add_task(run_c, std::vector<int32_t>{2, 1}, masks);
  plan.finish();
  ASSERT_EQ(plan.num_entries_of(0), 1);
  ASSERT_EQ(plan.num_entries_of(1), 3);

  std::vector<std::vector<int32_t>> visible(3);
  visible[0].assign(own0.begin(), own0.end());
  const std::span<const int32_t> row1 = all.subspan(37, 163);
  visible[1].assign(row1.begin(), row1.end());
  visible[2].assign(run_c.begin(), run_c.begin() + 30);
  check(plan, visible, kNumSlots);
}

// A one-token run: softmax over one key is exactly that key's V, and the LSE its score.
TEST_P(DeftAttentionCpuTest, SingleTokenRun) {
  constexpr int32_t kNumSlots = 8;
  HandPlan plan(2);
  plan.add_task(std::vector<int32_t>{5}, std::vector<int32_t>{1, 0});
  plan.finish();
  check(plan, {{5}, {5}}, kNumSlots);
}

INSTANTIATE_TEST_SUITE_P(GqaAndHeadDim, DeftAttentionCpuTest,
                         ::testing::Combine(::testing::Values(1, 4, 8), ::testing::Values(64, 128)),
                         [](const ::testing::TestParamInfo<std::tuple<int32_t, int32_t>>& info) {
                           return "group" + std::to_string(std::get<0>(info.param)) + "_d" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Stage 1 alone: a partial is normalised (weights sum to one) and its LSE is the log of the
// unnormalised sum; checked on a case small enough to do by hand: two keys, equal scores.
TEST(DeftAttentionCpuStage1Test, EqualScoresAverageV) {
  const AttentionDims dims{
      .num_q_heads = 1, .num_kv_heads = 1, .head_dim = 2, .softmax_scale = 1.0f};
  HandPlan plan(1);
  plan.add_task(std::vector<int32_t>{0, 1}, std::vector<int32_t>{0});
  plan.finish();
  const std::vector<float> q = {0.0f, 0.0f};
  const std::vector<float> k = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> v = {1.0f, 10.0f, 3.0f, 20.0f};
  std::vector<float> partial_out(2), partial_lse(1);
  deft_attention_stage1_cpu(plan.view(), dims, q.data(), k.data(), v.data(), partial_out.data(),
                            partial_lse.data());
  EXPECT_FLOAT_EQ(partial_out[0], 2.0f);
  EXPECT_FLOAT_EQ(partial_out[1], 15.0f);
  EXPECT_FLOAT_EQ(partial_lse[0], std::log(2.0f));
}

// Stage 2 alone: two partials with LSEs log(1) and log(3) weigh 1/4 and 3/4.
TEST(DeftAttentionCpuStage2Test, MergesByLse) {
  const AttentionDims dims{
      .num_q_heads = 1, .num_kv_heads = 1, .head_dim = 1, .softmax_scale = 1.0f};
  HandPlan plan(1);
  plan.add_task(std::vector<int32_t>{0}, std::vector<int32_t>{0});
  plan.add_task(std::vector<int32_t>{1}, std::vector<int32_t>{0});
  plan.finish();
  const std::vector<float> partial_out = {4.0f, 8.0f};
  const std::vector<float> partial_lse = {0.0f, std::log(3.0f)};
  float out = 0.0f;
  float lse = 0.0f;
  deft_attention_stage2_cpu(plan.view(), dims, partial_out.data(), partial_lse.data(), &out, &lse);
  EXPECT_FLOAT_EQ(out, 7.0f);
  EXPECT_FLOAT_EQ(lse, std::log(4.0f));
}

// An entry whose mask bit is clear on every token of its task is a planner bug: abort.
TEST(DeftAttentionCpuDeathTest, EntryThatSeesNothingAborts) {
  const AttentionDims dims{
      .num_q_heads = 1, .num_kv_heads = 1, .head_dim = 1, .softmax_scale = 1.0f};
  HandPlan plan(2);
  plan.add_task(std::vector<int32_t>{0, 1}, std::vector<int32_t>{0, 1},
                std::vector<uint64_t>{0b01, 0b01});
  plan.finish();
  const std::vector<float> q = {1.0f, 1.0f};
  const std::vector<float> kv = {1.0f, 1.0f};
  std::vector<float> out(2);
  EXPECT_DEATH(deft_attention_cpu(plan.view(), dims, q.data(), kv.data(), kv.data(), out.data()),
               "sees no token");
}

}  // namespace
}  // namespace deft::kernels
