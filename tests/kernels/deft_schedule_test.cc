// Stage 1's work division (kernels/deft_schedule.h): row slices per task and the grid's table of
// CTAs, longest first. Host code only, so these run in every build.
#include "kernels/deft_schedule.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/attention_params.h"

namespace deft::kernels {
namespace {

// A task's row passes (entries x group, 64 rows a pass), at least 1 and at most kMaxRowSlices.
TEST(DeftSchedule, RowSlicesArePassesUpToTheCap) {
  AttentionDims dims;
  dims.head_dim = 128;
  dims.num_kv_heads = 8;
  dims.num_q_heads = 32;  // group 4: 16 entries a pass
  EXPECT_EQ(deft_attention_row_slices(0, dims), 1);
  EXPECT_EQ(deft_attention_row_slices(1, dims), 1);
  EXPECT_EQ(deft_attention_row_slices(16, dims), 1);
  EXPECT_EQ(deft_attention_row_slices(17, dims), 2);
  EXPECT_EQ(deft_attention_row_slices(64, dims), 4);
  EXPECT_EQ(deft_attention_row_slices(16 * kMaxRowSlices, dims), kMaxRowSlices);
  EXPECT_EQ(deft_attention_row_slices(16 * kMaxRowSlices + 1, dims), kMaxRowSlices);
  dims.num_q_heads = 8;  // group 1: 64 entries a pass
  EXPECT_EQ(deft_attention_row_slices(64, dims), 1);
  EXPECT_EQ(deft_attention_row_slices(65, dims), 2);
}

// Stage 1's grid gives each task the row slices its own rows need (64 rows a pass, at most 32
// slices) times the KV heads, the longest CTAs first (tiles, masked ones twice, + 2), ties in
// (task, KV head, slice) order.
TEST(DeftSchedule, StageOneCtasFollowEachTasksRowsLongestFirst) {
  AttentionDims dims;
  dims.head_dim = 128;
  dims.num_kv_heads = 8;
  dims.num_q_heads = 32;  // group 4: 16 entries a pass
  // Tasks of 1, 20, 64, 3, 600 and 0 entries: 1, 2, 4, 1, 32 (38 passes, capped) and 1 slices;
  // 2, 8, 1 (masked), 1, 10 and 1 tiles: work 4, 10, 4, 3, 12, 3.
  const int32_t task_entry_begin[] = {0, 1, 21, 85, 88, 688, 688};
  const int32_t task_kv_begin[] = {0, 100, 612, 676, 740, 1380};
  const int32_t task_kv_end[] = {100, 612, 676, 740, 1380, 1390};
  const int32_t task_mask_begin[] = {-1, -1, 0, -1, -1, -1};
  AttentionPlanView plan;
  plan.num_tasks = 6;
  plan.task_entry_begin = task_entry_begin;
  plan.task_kv_begin = task_kv_begin;
  plan.task_kv_end = task_kv_end;
  plan.task_mask_begin = task_mask_begin;
  std::vector<Stage1Cta> ctas = {Stage1Cta{.task = 7}};  // replaced, not appended to
  build_stage1_ctas(plan, dims, ctas);
  const int32_t slices[] = {1, 2, 4, 1, 32, 1};
  ASSERT_EQ(ctas.size(), 8u * (1 + 2 + 4 + 1 + 32 + 1));
  size_t at = 0;
  for (int32_t task : {4, 1, 0, 2, 3, 5}) {
    for (int32_t head = 0; head < 8; ++head) {
      for (int32_t slice = 0; slice < slices[task]; ++slice, ++at) {
        EXPECT_EQ(ctas[at].task, task) << at;
        EXPECT_EQ(ctas[at].kv_head, head) << at;
        EXPECT_EQ(ctas[at].slice, slice) << at;
        EXPECT_EQ(ctas[at].slices, slices[task]) << at;
      }
    }
  }
  dims.num_q_heads = 8;  // group 1: 64 entries a pass
  build_stage1_ctas(plan, dims, ctas);
  EXPECT_EQ(ctas.size(), 8u * (1 + 1 + 1 + 1 + 10 + 1));
  AttentionPlanView no_entries;  // a prefill-only view: no tasks, no CTAs
  build_stage1_ctas(no_entries, dims, ctas);
  EXPECT_TRUE(ctas.empty());
}

// Graph buckets: never below the count, powers of two up to 16, then at most 1/8 of padding.
TEST(DeftSchedule, GraphBucketsCoverTheCountWithLittlePadding) {
  EXPECT_EQ(pow2_bucket(0), 0);
  EXPECT_EQ(pow2_bucket(1), 1);
  EXPECT_EQ(pow2_bucket(5), 8);
  EXPECT_EQ(pow2_bucket(64), 64);
  EXPECT_EQ(task_bucket(3), 4);
  EXPECT_EQ(task_bucket(16), 16);
  EXPECT_EQ(task_bucket(17), 18);
  EXPECT_EQ(task_bucket(100), 104);
  for (int32_t count = 1; count < 5000; ++count) {
    const int32_t bucket = task_bucket(count);
    ASSERT_GE(bucket, count);
    if (count > 16) {
      ASSERT_LE(bucket - count, count / 8) << count;
    }
    ASSERT_EQ(task_bucket(bucket), bucket) << "a bucket is its own bucket: " << count;
  }
}

}  // namespace
}  // namespace deft::kernels
