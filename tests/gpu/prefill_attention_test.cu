// GPU tests of the prefill attention kernel (kernels/prefill_attention.h) against a float64
// reference over exactly the keys each row sees, on fresh random inputs (the seed is printed on
// failure). Runs of 1, 17, 300 and 4000 tokens, without and with a 1000-token prefix in
// scattered pages, GQA groups 1/4/8, bf16/fp16, head_dim 64/128; every run alone (short runs
// under a long prefix take the split-KV path) and all of them in one launch (several runs per
// launch). The output is poisoned with NaN before each launch and unused KV slots hold NaN: the
// runs' rows must come back finite and every other row untouched. Long runs are checked on a
// sample of rows (every row's reference costs O(keys) in double on one core).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/device_buffer.h"
#include "kernels/prefill_attention.h"
#include "kernels/prefill_attention_cpu.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::kernels {
namespace {

constexpr int32_t kPageTokens = 16;
constexpr int32_t kKvHeads = 2;

struct RunSpec {
  int32_t num_rows;
  int32_t prefix_tokens;
};

struct Config {
  DType dtype;
  int32_t head_dim;
  int32_t group;
};

std::string config_name(const testing::TestParamInfo<Config>& info) {
  return std::string(info.param.dtype == DType::kBf16 ? "bf16" : "fp16") + "_d" +
         std::to_string(info.param.head_dim) + "_g" + std::to_string(info.param.group);
}

// One launch's inputs: runs on rows separated by one unused row, keys in shuffled pages.
struct Case {
  AttentionDims dims;
  std::vector<PrefillRun> runs;
  std::vector<int32_t> kv_slots;
  int32_t num_queries = 0;
  int32_t num_slots = 0;
};

Case make_case(const Config& config, const std::vector<RunSpec>& specs, std::mt19937& rng) {
  Case c;
  c.dims.num_kv_heads = kKvHeads;
  c.dims.num_q_heads = kKvHeads * config.group;
  c.dims.head_dim = config.head_dim;
  c.dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  int32_t pages = 0;
  for (const RunSpec& spec : specs) {
    pages += (spec.prefix_tokens + spec.num_rows + kPageTokens - 1) / kPageTokens;
  }
  const int32_t pool_pages = pages + pages / 2 + 1;  // a third of the pool stays NaN
  std::vector<int32_t> page_order(pool_pages);
  std::iota(page_order.begin(), page_order.end(), 0);
  std::shuffle(page_order.begin(), page_order.end(), rng);
  int32_t next_page = 0;
  int32_t row = 1;  // row 0 stays unused
  for (const RunSpec& spec : specs) {
    PrefillRun run;
    run.row_begin = row;
    run.num_rows = spec.num_rows;
    run.prefix_tokens = spec.prefix_tokens;
    run.kv_begin = static_cast<int32_t>(c.kv_slots.size());
    const int32_t keys = spec.prefix_tokens + spec.num_rows;
    for (int32_t k = 0; k < keys; ++k) {
      if (k % kPageTokens == 0) ++next_page;
      c.kv_slots.push_back(page_order[next_page - 1] * kPageTokens + k % kPageTokens);
    }
    c.runs.push_back(run);
    row += spec.num_rows + 1;
  }
  c.num_queries = row;
  c.num_slots = pool_pages * kPageTokens;
  return c;
}

// Rows compared against the reference: all of short runs, a sample of long ones (first, last,
// around the prefix boundary, and a stride).
std::vector<int32_t> checked_rows(const PrefillRun& run) {
  std::vector<int32_t> rows;
  if (run.num_rows <= 80) {
    for (int32_t i = 0; i < run.num_rows; ++i) rows.push_back(i);
    return rows;
  }
  for (int32_t i = 0; i < 16; ++i) rows.push_back(i);
  for (int32_t i = 16; i < run.num_rows - 16; i += std::max(7, run.num_rows / 40)) rows.push_back(i);
  for (int32_t i = run.num_rows - 16; i < run.num_rows; ++i) rows.push_back(i);
  return rows;
}

class PrefillAttentionGpuTest : public testing::TestWithParam<Config> {
 protected:
  // Launches `specs` as one plan and checks every run.
  void check(const std::vector<RunSpec>& specs) {
    const Config config = GetParam();
    const uint32_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const Case c = make_case(config, specs, rng);
    const AttentionDims& dims = c.dims;
    const size_t head_dim = static_cast<size_t>(dims.head_dim);
    const size_t q_elems = static_cast<size_t>(c.num_queries) * dims.num_q_heads * head_dim;
    const size_t kv_elems = static_cast<size_t>(c.num_slots) * dims.num_kv_heads * head_dim;
    Tensor16 q = random_tensor(q_elems, config.dtype, rng);
    Tensor16 k = random_tensor(kv_elems, config.dtype, rng);
    Tensor16 v = random_tensor(kv_elems, config.dtype, rng);
    // Slots no run lists hold NaN: a wrong gather shows.
    std::vector<bool> used(static_cast<size_t>(c.num_slots), false);
    for (int32_t slot : c.kv_slots) used[slot] = true;
    const size_t kv_row = static_cast<size_t>(dims.num_kv_heads) * head_dim;
    for (int32_t slot = 0; slot < c.num_slots; ++slot) {
      if (used[slot]) continue;
      for (size_t i = 0; i < kv_row; ++i) {
        k.bits[slot * kv_row + i] = nan_bits(config.dtype);
        v.bits[slot * kv_row + i] = nan_bits(config.dtype);
      }
    }

    AttentionPlanView host_plan;
    host_plan.num_queries = c.num_queries;
    host_plan.num_kv_indices = static_cast<int32_t>(c.kv_slots.size());
    host_plan.kv_slots = c.kv_slots.data();
    host_plan.num_prefill_runs = static_cast<int32_t>(c.runs.size());
    host_plan.prefill_runs = c.runs.data();
    const std::vector<int32_t> zero(1, 0);
    host_plan.task_entry_begin = zero.data();
    host_plan.query_entry_begin = nullptr;  // no tasks: only the prefill runs' arrays are read

    DevicePlan device_plan;
    device_plan.upload(host_plan, dims, nullptr);
    DeviceBuffer q_dev = to_device(q.bits);
    DeviceBuffer k_dev = to_device(k.bits);
    DeviceBuffer v_dev = to_device(v.bits);
    DeviceBuffer out_dev = to_device(std::vector<uint16_t>(q_elems, nan_bits(config.dtype)));
    PrefillAttentionBuffers buffers;
    launch_prefill_attention(device_plan.view(), device_plan.prefill_runs(), dims, config.dtype,
                             q_dev.data(), k_dev.data(), v_dev.data(), buffers, out_dev.data(),
                             nullptr);
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out_bits = to_host<uint16_t>(out_dev, q_elems);
    const size_t row_elems = static_cast<size_t>(dims.num_q_heads) * head_dim;

    // Rows outside the runs untouched (still NaN), rows of the runs finite.
    std::vector<bool> in_run(static_cast<size_t>(c.num_queries), false);
    for (const PrefillRun& run : c.runs) {
      for (int32_t i = 0; i < run.num_rows; ++i) in_run[run.row_begin + i] = true;
    }
    int64_t nan_in_runs = 0, written_outside = 0;
    for (int32_t row = 0; row < c.num_queries; ++row) {
      for (size_t i = 0; i < row_elems; ++i) {
        const bool nan = std::isnan(from_bits(out_bits[row * row_elems + i], config.dtype));
        if (in_run[row] && nan) ++nan_in_runs;
        if (!in_run[row] && !nan) ++written_outside;
      }
    }
    EXPECT_EQ(nan_in_runs, 0);
    EXPECT_EQ(written_outside, 0);

    // Float64 reference on the checked rows of every run.
    const size_t group = static_cast<size_t>(dims.group_size());
    for (const PrefillRun& run : c.runs) {
      std::vector<float> got;
      std::vector<double> ref;
      for (int32_t i : checked_rows(run)) {
        const size_t row = static_cast<size_t>(run.row_begin + i);
        const int32_t keys = run.prefix_tokens + i + 1;
        std::vector<double> scores(static_cast<size_t>(keys));
        for (size_t head = 0; head < static_cast<size_t>(dims.num_q_heads); ++head) {
          const size_t kv_head = head / group;
          const float* q_vec = q.values.data() + (row * dims.num_q_heads + head) * head_dim;
          double max_score = -INFINITY;
          for (int32_t key = 0; key < keys; ++key) {
            const float* k_vec =
                k.values.data() + c.kv_slots[run.kv_begin + key] * kv_row + kv_head * head_dim;
            double dot = 0.0;
            for (size_t d = 0; d < head_dim; ++d) dot += double{q_vec[d]} * k_vec[d];
            scores[key] = dot * dims.softmax_scale;
            max_score = std::max(max_score, scores[key]);
          }
          std::vector<double> acc(head_dim, 0.0);
          double sum = 0.0;
          for (int32_t key = 0; key < keys; ++key) {
            const double weight = std::exp(scores[key] - max_score);
            sum += weight;
            const float* v_vec =
                v.values.data() + c.kv_slots[run.kv_begin + key] * kv_row + kv_head * head_dim;
            for (size_t d = 0; d < head_dim; ++d) acc[d] += weight * v_vec[d];
          }
          for (size_t d = 0; d < head_dim; ++d) {
            ref.push_back(acc[d] / sum);
            got.push_back(from_bits(out_bits[(row * dims.num_q_heads + head) * head_dim + d],
                                    config.dtype));
          }
        }
      }
      const Comparison cmp = compare(got, ref);
      EXPECT_EQ(cmp.nan_count, 0);
      EXPECT_LE(cmp.relative_error, tolerance(config.dtype))
          << "run of " << run.num_rows << " rows under a " << run.prefix_tokens
          << "-token prefix";
    }
  }
};

const std::vector<RunSpec> kRunSpecs = {{1, 0},   {17, 0},   {300, 0},   {4000, 0},
                                        {1, 1000}, {17, 1000}, {300, 1000}, {4000, 1000}};

TEST_P(PrefillAttentionGpuTest, EachRunAlone) {
  DEFT_SKIP_WITHOUT_GPU();
  for (const RunSpec& spec : kRunSpecs) {
    SCOPED_TRACE("run " + std::to_string(spec.num_rows) + " prefix " +
                 std::to_string(spec.prefix_tokens));
    check({spec});
  }
}

TEST_P(PrefillAttentionGpuTest, AllRunsInOneLaunch) {
  DEFT_SKIP_WITHOUT_GPU();
  check(kRunSpecs);
}

// Small enough for compute-sanitizer: short runs, both the direct and the split-KV path.
TEST_P(PrefillAttentionGpuTest, SmallRuns) {
  DEFT_SKIP_WITHOUT_GPU();
  check({{70, 0}});
  check({{5, 600}});
  check({{1, 3}, {33, 0}, {70, 130}});
}

INSTANTIATE_TEST_SUITE_P(Configs, PrefillAttentionGpuTest,
                         testing::Values(Config{DType::kBf16, 128, 1}, Config{DType::kBf16, 128, 4},
                                         Config{DType::kBf16, 128, 8}, Config{DType::kBf16, 64, 1},
                                         Config{DType::kBf16, 64, 4}, Config{DType::kBf16, 64, 8},
                                         Config{DType::kFp16, 128, 1}, Config{DType::kFp16, 128, 4},
                                         Config{DType::kFp16, 128, 8}, Config{DType::kFp16, 64, 1},
                                         Config{DType::kFp16, 64, 4}, Config{DType::kFp16, 64, 8}),
                         config_name);

// The CPU twin agrees with the same float64 reference semantics on a small mixed plan.
TEST(PrefillAttentionCpu, MatchesGpuKernel) {
  DEFT_SKIP_WITHOUT_GPU();
  std::mt19937 rng(fresh_seed());
  const Config config{DType::kBf16, 64, 4};
  const Case c = make_case(config, {{3, 40}, {90, 0}, {20, 300}}, rng);
  const size_t q_elems = static_cast<size_t>(c.num_queries) * c.dims.num_q_heads * 64;
  const size_t kv_elems = static_cast<size_t>(c.num_slots) * c.dims.num_kv_heads * 64;
  Tensor16 q = random_tensor(q_elems, config.dtype, rng);
  Tensor16 k = random_tensor(kv_elems, config.dtype, rng);
  Tensor16 v = random_tensor(kv_elems, config.dtype, rng);
  AttentionPlanView plan;
  plan.num_queries = c.num_queries;
  plan.num_kv_indices = static_cast<int32_t>(c.kv_slots.size());
  plan.kv_slots = c.kv_slots.data();
  plan.num_prefill_runs = static_cast<int32_t>(c.runs.size());
  plan.prefill_runs = c.runs.data();
  std::vector<float> cpu_out(q_elems, 0.0f);
  prefill_attention_cpu(plan, c.dims, q.values.data(), k.values.data(), v.values.data(),
                        cpu_out.data());
  DevicePlan device_plan;
  device_plan.upload(plan, c.dims, nullptr);
  DeviceBuffer q_dev = to_device(q.bits), k_dev = to_device(k.bits), v_dev = to_device(v.bits);
  DeviceBuffer out_dev = to_device(std::vector<uint16_t>(q_elems, 0));
  PrefillAttentionBuffers buffers;
  launch_prefill_attention(device_plan.view(), device_plan.prefill_runs(), c.dims, config.dtype,
                           q_dev.data(), k_dev.data(), v_dev.data(), buffers, out_dev.data(),
                           nullptr);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> bits = to_host<uint16_t>(out_dev, q_elems);
  std::vector<float> gpu_out(q_elems);
  std::vector<double> ref(q_elems);
  for (size_t i = 0; i < q_elems; ++i) {
    gpu_out[i] = from_bits(bits[i], config.dtype);
    ref[i] = cpu_out[i];
  }
  const Comparison cmp = compare(gpu_out, ref);
  EXPECT_EQ(cmp.nan_count, 0);
  EXPECT_LE(cmp.relative_error, tolerance(config.dtype));
}

}  // namespace
}  // namespace deft::kernels
