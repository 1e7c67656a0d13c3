// The GPU kernels on plans made by the real planner (engine/attention_planner.h), every plan
// kind, without and with prefill runs (min_prefill_run = 64: the reasoning snapshot's 90-token
// extend goes to the prefill kernel, its decode queries to the DeFT kernels, in one plan),
// against the CPU twin (kernels/deft_attention_cpu.h) executing the same plan. Fresh random
// trees and values; outputs poisoned with NaN; unused KV slots hold NaN.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/deft_attention.h"
#include "kernels/deft_attention_cpu.h"
#include "kernels/deft_schedule.h"
#include "kernels/prefill_attention.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::kernels {
namespace {

using engine::AttentionPlan;
using engine::AttentionPlanner;
using engine::NodeId;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;

struct Snapshot {
  std::unique_ptr<engine::KvCacheManager> kv;
  std::unique_ptr<SequenceTree> tree;
  std::vector<QueryToken> queries;
};

Snapshot make_snapshot() {
  Snapshot s;
  s.kv = std::make_unique<engine::KvCacheManager>(engine::KvCacheConfig{.num_pages = 512});
  s.tree = std::make_unique<SequenceTree>(0, s.kv.get());
  return s;
}

void append(SequenceTree& tree, NodeId node, int tokens) {
  ASSERT_TRUE(tree.append(node, std::vector<TokenId>(tokens, 7)).ok());
}

// Few-shot: a prompt with `branches` suffixes of random length; queries are the last tokens.
Snapshot few_shot(std::mt19937& rng) {
  Snapshot s = make_snapshot();
  append(*s.tree, 0, 530);
  const std::vector<NodeId> leaves = s.tree->branch(0, 70).value();
  for (NodeId leaf : leaves) {
    const int length = 1 + static_cast<int>(rng() % 90);
    append(*s.tree, leaf, length);
    s.queries.push_back({leaf, length - 1});
  }
  return s;
}

// Speculative decoding: a prefix and a random token tree of 150 one-token nodes, all queries.
Snapshot token_tree(std::mt19937& rng) {
  Snapshot s = make_snapshot();
  append(*s.tree, 0, 700);
  std::vector<NodeId> nodes = {0};
  for (int i = 0; i < 150; ++i) {
    const NodeId parent = nodes[rng() % nodes.size()];
    const NodeId child = s.tree->branch(parent, 1).value()[0];
    append(*s.tree, child, 1);
    nodes.push_back(child);
    s.queries.push_back({child, 0});
  }
  return s;
}

// Reasoning: root, children and grandchildren of random lengths; one query per leaf, plus an
// extend of 90 tokens on one leaf (causal queries among themselves).
Snapshot reasoning(std::mt19937& rng) {
  Snapshot s = make_snapshot();
  append(*s.tree, 0, 300);
  const std::vector<NodeId> children = s.tree->branch(0, 6).value();
  for (NodeId child : children) {
    append(*s.tree, child, 20 + static_cast<int>(rng() % 100));
    const std::vector<NodeId> leaves = s.tree->branch(child, 4).value();
    for (NodeId leaf : leaves) {
      const int length = 1 + static_cast<int>(rng() % 60);
      append(*s.tree, leaf, length);
      s.queries.push_back({leaf, length - 1});
    }
  }
  const NodeId extended = s.queries.back().node;
  const int old_length = s.queries.back().token_index + 1;
  s.queries.pop_back();
  append(*s.tree, extended, 90);
  for (int i = 0; i < 90; ++i) s.queries.push_back({extended, old_length + i});
  return s;
}

struct Case {
  DType dtype;
  int head_dim;
  int group_size;
};

class DeftAttentionPlannerGpuTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    DEFT_SKIP_WITHOUT_GPU();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }

  void check_all_kinds(const Snapshot& s, const char* name) {
    for (PlanKind kind : {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                          PlanKind::kSequence, PlanKind::kDenseMask}) {
      for (int chunk_tokens : {64, 128}) {
        for (int min_prefill_run : {0, 64}) {
          SCOPED_TRACE(testing::Message() << name << " " << engine::plan_kind_name(kind)
                                          << " B=" << chunk_tokens << " min_prefill_run="
                                          << min_prefill_run << " seed=" << seed_);
          AttentionPlanner planner(
              {.kind = kind, .chunk_tokens = chunk_tokens, .min_prefill_run = min_prefill_run});
          AttentionPlan plan;
          const std::vector<engine::TreeQueries> input = {{s.tree.get(), s.queries}};
          ASSERT_TRUE(planner.plan(input, plan).ok());
          check_plan(plan, static_cast<int32_t>(s.kv->num_slots()), name, kind, chunk_tokens);
        }
      }
    }
  }

  // Two KV heads of the case's group and head size.
  static AttentionDims case_dims(const Case& c) {
    AttentionDims dims;
    dims.num_kv_heads = 2;
    dims.num_q_heads = 2 * c.group_size;
    dims.head_dim = c.head_dim;
    dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    return dims;
  }

  void check_plan(const AttentionPlan& plan, int32_t num_slots, const char* name, PlanKind kind,
                  int chunk_tokens) {
    const Case c = GetParam();
    const AttentionDims dims = case_dims(c);
    const size_t q_count = static_cast<size_t>(plan.num_queries) * dims.num_q_heads * c.head_dim;
    const size_t kv_row = static_cast<size_t>(dims.num_kv_heads) * c.head_dim;
    const Tensor16 q = random_tensor(q_count, c.dtype, rng_);
    Tensor16 k = random_tensor(num_slots * kv_row, c.dtype, rng_);
    Tensor16 v = random_tensor(num_slots * kv_row, c.dtype, rng_);
    std::vector<bool> used(num_slots, false);
    for (int32_t slot : plan.kv_slots) used[slot] = true;
    for (int32_t slot = 0; slot < num_slots; ++slot) {
      if (used[slot]) continue;
      std::fill_n(k.bits.begin() + slot * kv_row, kv_row, nan_bits(c.dtype));
      std::fill_n(v.bits.begin() + slot * kv_row, kv_row, nan_bits(c.dtype));
    }

    std::vector<float> cpu_out(q_count);
    deft_attention_cpu(plan.view(), dims, q.values.data(), k.values.data(), v.values.data(),
                       cpu_out.data());

    const DeviceBuffer q_dev = to_device(q.bits);
    const DeviceBuffer k_dev = to_device(k.bits);
    const DeviceBuffer v_dev = to_device(v.bits);
    DeviceBuffer out_dev(q_count * 2);
    DeftAttentionBuffers buffers;
    buffers.reserve(plan.num_entries(), dims);
    DEFT_CUDA_CHECK(cudaMemset(out_dev.data(), 0xff, q_count * 2));
    DEFT_CUDA_CHECK(cudaMemset(buffers.partial_out(), 0xff, buffers.partial_out_bytes()));
    DEFT_CUDA_CHECK(cudaMemset(buffers.partial_lse(), 0xff, buffers.partial_lse_bytes()));
    DevicePlan device_plan;
    device_plan.upload(plan.view(), dims, nullptr);
    launch_deft_attention(device_plan, dims, c.dtype, q_dev.data(), k_dev.data(), v_dev.data(),
                          buffers, out_dev.data(), nullptr);
    PrefillAttentionBuffers prefill_buffers;
    launch_prefill_attention(device_plan.view(), device_plan.prefill_runs(), dims, c.dtype,
                             q_dev.data(), k_dev.data(), v_dev.data(), prefill_buffers,
                             out_dev.data(), nullptr);
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());

    const std::vector<uint16_t> out_bits = to_host<uint16_t>(out_dev, q_count);
    std::vector<float> out(q_count);
    for (size_t i = 0; i < q_count; ++i) out[i] = from_bits(out_bits[i], c.dtype);
    const Comparison result = compare(out, std::vector<double>(cpu_out.begin(), cpu_out.end()));
    EXPECT_EQ(result.nan_count, 0);
    EXPECT_LE(result.relative_error, tolerance(c.dtype));
    std::printf(
        "  %-10s %-16s B=%-3d tasks %5d entries %5d prefill runs %d  rel err vs CPU twin %.2e\n",
        name, std::string(engine::plan_kind_name(kind)).c_str(), chunk_tokens, plan.num_tasks(),
        plan.num_entries(), static_cast<int>(plan.prefill_runs.size()), result.relative_error);
  }

  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

TEST_P(DeftAttentionPlannerGpuTest, FewShot) { check_all_kinds(few_shot(rng_), "few-shot"); }
TEST_P(DeftAttentionPlannerGpuTest, TokenTree) { check_all_kinds(token_tree(rng_), "token-tree"); }
TEST_P(DeftAttentionPlannerGpuTest, Reasoning) { check_all_kinds(reasoning(rng_), "reasoning"); }

// Flatten's adaptive B under a wave (engine::PlannerOptions::wave): this GPU's (B kept, or grown
// where a grid spills over), and a wave of 4 CTAs, over which every tree spills (B grows to the
// estimate's minimum, up to twice the base rule's: sizes no fixed-B case runs).
TEST_P(DeftAttentionPlannerGpuTest, AdaptiveChunkUnderAWave) {
  const Case c = GetParam();
  const AttentionDims dims = case_dims(c);
  const int32_t resident = deft_attention_resident_ctas(dims, c.dtype);
  int device = 0, sms = 0;
  DEFT_CUDA_CHECK(cudaGetDevice(&device));
  DEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  EXPECT_GT(resident, 0);
  EXPECT_EQ(resident % sms, 0) << resident << " CTAs on " << sms << " SMs";
  std::printf("  stage-1 CTAs resident at once: %d (%d SMs)\n", resident, sms);
  const Snapshot snapshots[] = {few_shot(rng_), token_tree(rng_), reasoning(rng_)};
  const char* names[] = {"few-shot", "token-tree", "reasoning"};
  for (const int32_t ctas : {resident, 4}) {
    for (int i = 0; i < 3; ++i) {
      SCOPED_TRACE(testing::Message() << names[i] << " wave " << ctas << " seed=" << seed_);
      AttentionPlanner planner(
          {.wave = {.ctas = ctas, .kv_heads = dims.num_kv_heads, .group_size = c.group_size}});
      AttentionPlan plan;
      const std::vector<engine::TreeQueries> input = {{snapshots[i].tree.get(),
                                                       snapshots[i].queries}};
      ASSERT_TRUE(planner.plan(input, plan).ok());
      check_plan(plan, static_cast<int32_t>(snapshots[i].kv->num_slots()), names[i],
                 PlanKind::kDeftFlatten, plan.io.max_chunk_tokens);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DeftAttentionPlannerGpuTest,
                         testing::Values(Case{DType::kBf16, 128, 4}, Case{DType::kFp16, 128, 8},
                                         Case{DType::kBf16, 64, 1}, Case{DType::kFp16, 64, 2}),
                         [](const testing::TestParamInfo<Case>& info) {
                           return std::string(dtype_name(info.param.dtype)) + "_d" +
                                  std::to_string(info.param.head_dim) + "_g" +
                                  std::to_string(info.param.group_size);
                         });

}  // namespace
}  // namespace deft::kernels
