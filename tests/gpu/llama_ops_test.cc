// The small forward-pass kernels (kernels/llama_ops.h) and the generic tree-attention kernel
// (kernels/tree_attention_generic.h) against their CPU twins, on inputs already rounded to the
// element type. Relative errors (L2) below gpu_test_support's tolerance(dtype).
#include "kernels/llama_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/deft_attention.h"
#include "kernels/deft_attention_cpu.h"
#include "kernels/tree_attention_generic.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::kernels {
namespace {

std::vector<float> widen(const std::vector<uint16_t>& bits, DType dtype) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = from_bits(bits[i], dtype);
  return values;
}

double error_of(const std::vector<float>& ours, const std::vector<float>& reference) {
  const std::vector<double> ref(reference.begin(), reference.end());
  const Comparison c = compare(ours, ref);
  EXPECT_EQ(c.nan_count, 0);
  return c.relative_error;
}

class LlamaOpsGpuTest : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    DEFT_SKIP_WITHOUT_GPU();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  DType dtype() const { return GetParam(); }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

TEST_P(LlamaOpsGpuTest, EmbeddingGathersRows) {
  const int32_t vocab = 50, width = 72, tokens = 9;
  const Tensor16 table = random_tensor(static_cast<size_t>(vocab) * width, dtype(), rng_);
  std::vector<int32_t> ids(tokens);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng_() % vocab);
  std::vector<float> expected(static_cast<size_t>(tokens) * width);
  embedding_cpu(tokens, width, ids.data(), table.values.data(), expected.data());
  DeviceBuffer d_table = to_device(table.bits), d_ids = to_device(ids);
  DeviceBuffer d_out(expected.size() * sizeof(float));
  launch_embedding(tokens, width, dtype(), d_ids.as<int32_t>(), d_table.data(), d_out.as<float>(),
                   nullptr);
  EXPECT_EQ(to_host<float>(d_out, expected.size()), expected) << "seed " << seed_;
}

// Widths of the vector kernel (a multiple of 4, up to 8192) and of the general one.
TEST_P(LlamaOpsGpuTest, RmsNormWithBiasAndGather) {
  for (const int32_t width : {1000, 4096, 8192, 1002, 8196}) {
    const int32_t rows = 7;
    const Tensor16 x = random_tensor(static_cast<size_t>(rows) * width, dtype(), rng_, 3.0f);
    const Tensor16 bias = random_tensor(width, dtype(), rng_, 0.5f);
    const Tensor16 weight = random_tensor(width, dtype(), rng_);
    const RmsNormDims dims{.num_rows = rows, .width = width, .eps = 1e-5f};
    // Pass 1: bias folded into the residual; pass 2: gathered rows, no bias.
    std::vector<float> residual = x.values;
    std::vector<float> expected(static_cast<size_t>(rows) * width);
    rms_norm_cpu(dims, nullptr, residual.data(), bias.values.data(), weight.values.data(),
                 expected.data());
    const std::vector<int32_t> gather = {6, 0, 3, 3};
    std::vector<float> expected_gathered(gather.size() * width);
    rms_norm_cpu({.num_rows = 4, .width = width, .eps = 1e-5f}, gather.data(), residual.data(),
                 nullptr, weight.values.data(), expected_gathered.data());

    DeviceBuffer d_x = to_device(x.values), d_bias = to_device(bias.values);
    DeviceBuffer d_weight = to_device(weight.values), d_gather = to_device(gather);
    DeviceBuffer d_out(expected.size() * 2);
    launch_rms_norm(dims, dtype(), nullptr, d_x.as<float>(), d_bias.as<float>(),
                    d_weight.as<float>(), d_out.data(), nullptr);
    const double error =
        error_of(widen(to_host<uint16_t>(d_out, expected.size()), dtype()), expected);
    EXPECT_LT(error, tolerance(dtype())) << "width " << width << ", seed " << seed_;
    EXPECT_LT(error_of(to_host<float>(d_x, residual.size()), residual), 1e-6) << "width " << width;
    launch_rms_norm({.num_rows = 4, .width = width, .eps = 1e-5f}, dtype(), d_gather.as<int32_t>(),
                    d_x.as<float>(), nullptr, d_weight.as<float>(), d_out.data(), nullptr);
    const double gathered_error = error_of(
        widen(to_host<uint16_t>(d_out, expected_gathered.size()), dtype()), expected_gathered);
    EXPECT_LT(gathered_error, tolerance(dtype())) << "width " << width << ", seed " << seed_;
    std::printf("[rms_norm] %s width %d: relative error %.3g, gathered %.3g\n",
                std::string(dtype_name(dtype())).c_str(), width, error, gathered_error);
  }
}

// Widths of the 8-wide vector kernel and of the general one (300, 12).
TEST_P(LlamaOpsGpuTest, SiluMul) {
  for (const int32_t width : {300, 12, 8, 1000, 14336}) {
    const int32_t rows = 5;
    const Tensor16 gate_up =
        random_tensor(static_cast<size_t>(rows) * 2 * width, dtype(), rng_, 2.0f);
    std::vector<float> expected(static_cast<size_t>(rows) * width);
    silu_mul_cpu(rows, width, gate_up.values.data(), expected.data());
    DeviceBuffer d_in = to_device(gate_up.bits), d_out(expected.size() * 2);
    launch_silu_mul(rows, width, dtype(), d_in.data(), d_out.data(), nullptr);
    const double error =
        error_of(widen(to_host<uint16_t>(d_out, expected.size()), dtype()), expected);
    EXPECT_LT(error, tolerance(dtype())) << "width " << width << ", seed " << seed_;
  }
}

// A WeightPrefetch adds CTAs that only touch L2: the outputs (and the residual) are the same bit
// for bit, for the vector and general kernels, with rows longer and shorter than the prefetch.
TEST_P(LlamaOpsGpuTest, WeightPrefetchLeavesOutputsUnchanged) {
  DeviceBuffer weights(size_t{3} << 20);
  const WeightPrefetch prefetches[] = {
      {.base = weights.data(), .rows = 1000, .row_bytes = 3072, .bytes_per_row = 1024},
      {.base = weights.data(), .rows = 96, .row_bytes = 32768, .bytes_per_row = 130},
      {.base = weights.data(), .rows = 7, .row_bytes = 16, .bytes_per_row = 256}};
  for (const WeightPrefetch& prefetch : prefetches) {
    for (const int32_t width : {4096, 1002}) {
      const int32_t rows = 5;
      const Tensor16 x = random_tensor(static_cast<size_t>(rows) * width, dtype(), rng_, 3.0f);
      const Tensor16 bias = random_tensor(width, dtype(), rng_, 0.5f);
      const Tensor16 weight = random_tensor(width, dtype(), rng_);
      const RmsNormDims dims{.num_rows = rows, .width = width, .eps = 1e-5f};
      DeviceBuffer d_bias = to_device(bias.values), d_weight = to_device(weight.values);
      DeviceBuffer d_x1 = to_device(x.values), d_x2 = to_device(x.values);
      DeviceBuffer d_out1(x.values.size() * 2), d_out2(x.values.size() * 2);
      launch_rms_norm(dims, dtype(), nullptr, d_x1.as<float>(), d_bias.as<float>(),
                      d_weight.as<float>(), d_out1.data(), nullptr);
      launch_rms_norm(dims, dtype(), nullptr, d_x2.as<float>(), d_bias.as<float>(),
                      d_weight.as<float>(), d_out2.data(), nullptr, prefetch);
      EXPECT_EQ(to_host<uint16_t>(d_out2, x.values.size()),
                to_host<uint16_t>(d_out1, x.values.size()))
          << "rms_norm width " << width << ", seed " << seed_;
      EXPECT_EQ(to_host<float>(d_x2, x.values.size()), to_host<float>(d_x1, x.values.size()))
          << "rms_norm residual, width " << width;
    }
    for (const int32_t width : {14336, 300}) {
      const int32_t rows = 64;
      const Tensor16 gate_up =
          random_tensor(static_cast<size_t>(rows) * 2 * width, dtype(), rng_, 2.0f);
      const size_t count = static_cast<size_t>(rows) * width;
      // Two inputs: the vector kernel drops what it read from L2 unwritten.
      DeviceBuffer d_in1 = to_device(gate_up.bits), d_in2 = to_device(gate_up.bits);
      DeviceBuffer d_out1(count * 2), d_out2(count * 2);
      launch_silu_mul(rows, width, dtype(), d_in1.data(), d_out1.data(), nullptr);
      launch_silu_mul(rows, width, dtype(), d_in2.data(), d_out2.data(), nullptr, prefetch);
      EXPECT_EQ(to_host<uint16_t>(d_out2, count), to_host<uint16_t>(d_out1, count))
          << "silu_mul width " << width << ", seed " << seed_;
    }
  }
}

// An L2Discard drops only whole 128-byte lines inside its ranges, and only after the norm's own
// work: the outputs are the same bit for bit, and the bytes of a range's partial first and last
// lines (and everything outside the ranges) keep the values a kernel wrote there last. The
// buffer is NaN in DRAM first, then rewritten by a device copy, so a dropped line that was
// still needed would likely read back as NaN.
TEST_P(LlamaOpsGpuTest, L2DiscardKeepsOutputsAndPartialLines) {
  const size_t scratch_floats = 4096;
  std::vector<float> pattern(scratch_floats);
  for (size_t i = 0; i < scratch_floats; ++i) pattern[i] = static_cast<float>(i) + 0.25f;
  for (const int32_t width : {4096, 1002}) {
    const int32_t rows = 5;
    const Tensor16 x = random_tensor(static_cast<size_t>(rows) * width, dtype(), rng_, 3.0f);
    const Tensor16 weight = random_tensor(width, dtype(), rng_);
    const RmsNormDims dims{.num_rows = rows, .width = width, .eps = 1e-5f};
    DeviceBuffer d_weight = to_device(weight.values);
    DeviceBuffer d_x1 = to_device(x.values), d_x2 = to_device(x.values);
    DeviceBuffer d_out1(x.values.size() * 2), d_out2(x.values.size() * 2);
    DeviceBuffer scratch(scratch_floats * sizeof(float));
    DeviceBuffer source = to_device(pattern);
    DEFT_CUDA_CHECK(cudaMemset(scratch.data(), 0xFF, scratch_floats * sizeof(float)));
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());
    DEFT_CUDA_CHECK(cudaMemcpy(scratch.data(), source.data(), scratch_floats * sizeof(float),
                               cudaMemcpyDeviceToDevice));
    // Two ranges starting and ending inside lines (bytes 100 .. 5100 and 6000 .. 6010), one
    // shorter than a line.
    const char* base = scratch.as<char>();
    const L2Discard discard = L2Discard{}.add(base + 100, 5000).add(base + 6000, 10);
    launch_rms_norm(dims, dtype(), nullptr, d_x1.as<float>(), nullptr, d_weight.as<float>(),
                    d_out1.data(), nullptr);
    launch_rms_norm(dims, dtype(), nullptr, d_x2.as<float>(), nullptr, d_weight.as<float>(),
                    d_out2.data(), nullptr, {}, discard);
    EXPECT_EQ(to_host<uint16_t>(d_out2, x.values.size()),
              to_host<uint16_t>(d_out1, x.values.size()))
        << "rms_norm width " << width << ", seed " << seed_;
    const std::vector<float> kept = to_host<float>(scratch, scratch_floats);
    for (size_t i = 0; i < scratch_floats; ++i) {
      const size_t byte = i * sizeof(float);
      const bool dropped = byte >= 128 && byte < 5100 / 128 * 128;  // whole lines of range 1
      if (!dropped) {
        ASSERT_EQ(kept[i], pattern[i]) << "byte " << byte << " outside the dropped lines";
      }
    }
  }
}

// head_dim / 2 a multiple of 4 (the vector kernel: 32, 64, 128; 40 heads cross its head runs)
// and not (the general kernel: 6, 20).
TEST_P(LlamaOpsGpuTest, QkvBiasRopeAndKvWrite) {
  for (const QkvRopeDims dims :
       {QkvRopeDims{.num_tokens = 6, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 32},
        QkvRopeDims{.num_tokens = 24, .num_q_heads = 32, .num_kv_heads = 8, .head_dim = 128},
        QkvRopeDims{.num_tokens = 5, .num_q_heads = 8, .num_kv_heads = 1, .head_dim = 64},
        QkvRopeDims{.num_tokens = 6, .num_q_heads = 3, .num_kv_heads = 1, .head_dim = 6},
        QkvRopeDims{.num_tokens = 6, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 20}}) {
    const int32_t slots_total = 64;
    const Tensor16 qkv =
        random_tensor(static_cast<size_t>(dims.num_tokens) * dims.qkv_width(), dtype(), rng_);
    const Tensor16 bias = random_tensor(dims.qkv_width(), dtype(), rng_, 0.3f);
    std::vector<int32_t> positions = {0, 1, 7, 100, 4000, 3};
    std::vector<int32_t> slots = {3, 19, -1, 0, 7, 8};
    for (int32_t t = 6; t < dims.num_tokens; ++t) {
      positions.push_back(static_cast<int32_t>(rng_() % 100000));
      slots.push_back(t + 30);
    }
    positions.resize(dims.num_tokens);
    slots.resize(dims.num_tokens);
    std::vector<float> inv_freq(dims.head_dim / 2);
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      inv_freq[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / dims.head_dim);
    }
    const size_t kv_size = static_cast<size_t>(dims.num_kv_heads) * dims.head_dim;
    std::vector<float> q_expected(static_cast<size_t>(dims.num_tokens) * dims.num_q_heads *
                                  dims.head_dim);
    std::vector<float> k_expected(slots_total * kv_size, 0.0f), v_expected = k_expected;
    qkv_rope_write_cpu(dims, positions.data(), slots.data(), inv_freq.data(), qkv.values.data(),
                       bias.values.data(), q_expected.data(), k_expected.data(), v_expected.data());
    DeviceBuffer d_qkv = to_device(qkv.bits), d_bias = to_device(bias.values);
    DeviceBuffer d_pos = to_device(positions), d_slots = to_device(slots);
    DeviceBuffer d_freq = to_device(inv_freq), d_q(q_expected.size() * 2);
    DeviceBuffer d_k = to_device(std::vector<uint16_t>(k_expected.size(), 0));
    DeviceBuffer d_v = to_device(std::vector<uint16_t>(v_expected.size(), 0));
    launch_qkv_rope_write(dims, dtype(), d_pos.as<int32_t>(), d_slots.as<int32_t>(),
                          d_freq.as<float>(), d_qkv.data(), d_bias.as<float>(), d_q.data(),
                          d_k.data(), d_v.data(), nullptr);
    for (auto [device, expected, name] :
         {std::tuple{&d_q, &q_expected, "q"}, std::tuple{&d_k, &k_expected, "k"},
          std::tuple{&d_v, &v_expected, "v"}}) {
      const double error =
          error_of(widen(to_host<uint16_t>(*device, expected->size()), dtype()), *expected);
      EXPECT_LT(error, tolerance(dtype()))
          << name << " head_dim " << dims.head_dim << " seed " << seed_;
    }
  }
}

TEST_P(LlamaOpsGpuTest, RandomUniformMatchesTwin) {
  const int64_t count = 100000;
  std::vector<float> expected(count);
  random_uniform_cpu(count, 42, 0.25f, 1.0f, expected.data());
  DeviceBuffer d_out(count * 2);
  launch_random_uniform(count, 42, 0.25f, 1.0f, dtype(), d_out.data(), nullptr);
  const std::vector<uint16_t> bits = to_host<uint16_t>(d_out, count);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) mismatches += bits[i] != to_bits(expected[i], dtype());
  EXPECT_EQ(mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LlamaOpsGpuTest, testing::Values(DType::kBf16, DType::kFp16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// Generic attention on real planner output: a prompt, branches of random lengths (last tokens
// query), and an extend of 12 tokens on one branch (causal among themselves).
class TreeAttentionGenericGpuTest : public testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(TreeAttentionGenericGpuTest, MatchesCpuTwinOnPlannerOutput) {
  DEFT_SKIP_WITHOUT_GPU();
  const auto [head_dim, group] = GetParam();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 64});
  engine::SequenceTree tree(0, &kv);
  ASSERT_TRUE(tree.append(0, std::vector<engine::TokenId>(45, 3)).ok());
  std::vector<engine::QueryToken> queries;
  const std::vector<engine::NodeId> leaves = tree.branch(0, 5).value();
  for (engine::NodeId leaf : leaves) {
    const int length = 1 + static_cast<int>(rng() % 30);
    ASSERT_TRUE(tree.append(leaf, std::vector<engine::TokenId>(length, 3)).ok());
    queries.push_back({leaf, length - 1});
  }
  const engine::NodeId extended = leaves[0];
  const int32_t old_length = queries[0].token_index + 1;
  ASSERT_TRUE(tree.append(extended, std::vector<engine::TokenId>(12, 3)).ok());
  for (int32_t i = 0; i < 12; ++i) queries.push_back({extended, old_length + i});

  const AttentionDims dims{.num_q_heads = 2 * group,
                           .num_kv_heads = 2,
                           .head_dim = head_dim,
                           .softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim))};
  const DType dtype = DType::kBf16;
  const size_t slots = static_cast<size_t>(kv.num_slots());
  const Tensor16 k = random_tensor(slots * dims.num_kv_heads * head_dim, dtype, rng);
  const Tensor16 v = random_tensor(slots * dims.num_kv_heads * head_dim, dtype, rng);
  for (engine::PlanKind kind : {engine::PlanKind::kDeftFlatten, engine::PlanKind::kSequence,
                                engine::PlanKind::kDenseMask}) {
    engine::AttentionPlanner planner({.kind = kind, .chunk_tokens = 16});
    engine::AttentionPlan plan;
    const std::vector<engine::TreeQueries> input = {{&tree, queries}};
    ASSERT_TRUE(planner.plan(input, plan).ok());
    const Tensor16 q =
        random_tensor(static_cast<size_t>(plan.num_queries) * dims.num_q_heads * head_dim, dtype, rng);
    std::vector<float> expected(q.values.size());
    deft_attention_cpu(plan.view(), dims, q.values.data(), k.values.data(), v.values.data(),
                       expected.data());
    DevicePlan device_plan;
    device_plan.upload(plan.view(), dims, nullptr);
    DeviceBuffer d_q = to_device(q.bits), d_k = to_device(k.bits), d_v = to_device(v.bits);
    DeviceBuffer d_out(expected.size() * 2);
    launch_tree_attention_generic(device_plan.view(), dims, dtype, d_q.data(), d_k.data(),
                                  d_v.data(), d_out.data(), nullptr);
    const double error =
        error_of(widen(to_host<uint16_t>(d_out, expected.size()), dtype), expected);
    EXPECT_LT(error, tolerance(dtype))
        << engine::plan_kind_name(kind) << " head_dim " << head_dim << " seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TreeAttentionGenericGpuTest,
                         testing::Combine(testing::Values(8, 32, 96, 256), testing::Values(1, 4)));

}  // namespace
}  // namespace deft::kernels
