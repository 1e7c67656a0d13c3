// The GPU sampler (kernels/sampling.h) against its CPU twin engine::Sampler on fresh random
// rows (vocab 7, 1001, 32000 and 128256): greedy, temperature, top-k, top-p and their
// combinations, a new seed and step per row. Greedy tokens must be equal; a sampled token may
// differ only where the reference's decision margin (tests/gpu/sampling_reference.h: the draw's or
// top-p's distance to a cumulative-mass boundary, relative to the mass) is below kBoundaryMargin,
// i.e. within the rounding of double sums taken in another order; such cases are counted and
// printed. Raw logprobs within kLogprobAbs + kLogprobRel |ref|; top logprob lists token for token.
#include "kernels/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/sampler.h"
#include "kernels/philox.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/gpu/sampling_reference.h"

namespace deft::kernels {
namespace {

using engine::SamplingParams;

constexpr double kBoundaryMargin = 1e-9;
constexpr double kLogprobAbs = 1e-5;
constexpr double kLogprobRel = 1e-5;

// Row shapes: flat, peaked (LLM-like), many exact ties, a masked vocabulary (-inf), one hot.
std::vector<float> random_row(int32_t vocab, int kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(static_cast<size_t>(vocab));
  for (float& x : row) {
    switch (kind) {
      case 0:
        x = normal(rng);
        break;
      case 1:
        x = 4.0f * normal(rng);
        break;
      case 2:
        x = std::round(2.0f * normal(rng)) * 0.5f;
        break;
      case 3:
        x = rng() % 10 < 3 ? -std::numeric_limits<float>::infinity() : 3.0f * normal(rng);
        break;
      default:
        x = 2.0f * normal(rng);
        break;
    }
  }
  if (kind == 4) {
    for (int i = 0; i < 5; ++i) row[rng() % vocab] = 12.0f + 2.0f * normal(rng);
  }
  // A masked row keeps at least one finite logit (a row with none is an error case, tested
  // on its own): with a tiny vocabulary, 30 % masking empties a row now and then.
  if (kind == 3 && std::none_of(row.begin(), row.end(), [](float x) { return std::isfinite(x); })) {
    row[rng() % vocab] = 3.0f * normal(rng);
  }
  return row;
}

struct Config {
  const char* name;
  float temperature;
  int32_t top_k;
  float top_p;
  int32_t top_logprobs;
};

const Config kConfigs[] = {
    {"greedy", 0.0f, 0, 1.0f, 0},
    {"greedy_top5", 0.0f, 0, 1.0f, 5},
    {"top_k_1", 1.0f, 1, 1.0f, 0},
    {"temperature_1", 1.0f, 0, 1.0f, 0},
    {"temperature_0.7_top3", 0.7f, 0, 1.0f, 3},
    {"temperature_1.5_top_k_50", 1.5f, 50, 1.0f, 0},
    {"top_p_0.9", 1.0f, 0, 0.9f, 0},
    {"top_k_40_top_p_0.95_t0.8_top20", 0.8f, 40, 0.95f, 20},
    {"top_k_2000", 1.0f, 2000, 1.0f, 0},
    {"top_p_0.5_t2_top1", 2.0f, 0, 0.5f, 1},
    {"t0.001_top_p_0.9", 0.001f, 0, 0.9f, 0},
    {"top_p_0.999", 1.0f, 0, 0.999f, 0},
    {"top_k_7_top_p_0.6", 1.2f, 7, 0.6f, 0},
};

struct GpuRows {
  std::vector<SampledRow> rows;
  std::vector<SampledTop> top;
};

// drop_logits: the launch may drop the logits from L2 (the runner's decode steps). The logits
// buffer then holds NaN first and gets the logits from a device-to-device copy, so a read of a
// dropped line is likely to see the NaN still in DRAM.
GpuRows sample_on_gpu(const std::vector<float>& logits, int32_t vocab,
                      const std::vector<RowSamplingParams>& params, bool drop_logits = false,
                      bool batch_invariant = false) {
  const auto rows = static_cast<int32_t>(params.size());
  DeviceBuffer d_logits = to_device(logits);
  if (drop_logits) {
    DeviceBuffer source = to_device(logits);
    DEFT_CUDA_CHECK(cudaMemset(d_logits.data(), 0xFF, sizeof(float) * logits.size()));
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());
    DEFT_CUDA_CHECK(cudaMemcpy(d_logits.data(), source.data(), sizeof(float) * logits.size(),
                               cudaMemcpyDeviceToDevice));
  }
  DeviceBuffer d_params = to_device(params);
  DeviceBuffer workspace(sampling_workspace_bytes(rows, vocab));
  DeviceBuffer d_out(sizeof(SampledRow) * rows);
  DeviceBuffer d_top(sizeof(SampledTop) * rows * kSamplingMaxTopLogprobs);
  launch_sample_rows({.num_rows = rows, .vocab_size = vocab, .row_stride = vocab},
                     d_logits.as<float>(), d_params.as<RowSamplingParams>(), workspace.as<float>(),
                     d_out.as<SampledRow>(), d_top.as<SampledTop>(), nullptr, drop_logits,
                     batch_invariant);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  return {to_host<SampledRow>(d_out, rows),
          to_host<SampledTop>(d_top, static_cast<size_t>(rows) * kSamplingMaxTopLogprobs)};
}

// Equal values pass too: -inf (a masked token among the top logprobs) on both sides.
bool logprob_close(float ours, float ref) {
  if (ours == ref) return true;
  return std::abs(double{ours} - ref) <= kLogprobAbs + kLogprobRel * std::abs(double{ref});
}

TEST(SamplingGpu, PhiloxUniformMatchesEngine) {
  std::mt19937_64 rng(fresh_seed());
  for (int i = 0; i < 100000; ++i) {
    const uint64_t seed = rng();
    const uint64_t step = i % 3 == 0 ? rng() : rng() % 5000;
    ASSERT_EQ(philox_uniform(seed, step), engine::sampling_uniform(seed, step))
        << "seed " << seed << " step " << step;
  }
}

// (vocab, rows per config): the row count picks the blocks per row (8, 4 or 2 on an H100's 132
// SMs: 20, 40 and 100 rows).
class SamplingGpuTest : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

TEST_P(SamplingGpuTest, MatchesEngineSampler) {
  DEFT_SKIP_WITHOUT_GPU();
  const auto [vocab, rows_per_config] = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::mt19937_64 rng64(seed);
  engine::Sampler sampler;
  int64_t compared = 0, boundary_cases = 0;
  double worst_logprob = 0.0;
  for (const Config& config : kConfigs) {
    std::vector<float> logits;
    std::vector<RowSamplingParams> params;
    std::vector<SamplingParams> engine_params;
    for (int r = 0; r < rows_per_config; ++r) {
      const std::vector<float> row = random_row(vocab, r % 5, rng);
      logits.insert(logits.end(), row.begin(), row.end());
      SamplingParams p{.temperature = config.temperature,
                       .top_k = config.top_k,
                       .top_p = config.top_p,
                       .seed = rng64(),
                       .top_logprobs = config.top_logprobs};
      const uint64_t step = r % 2 == 0 ? rng64() % 10000 : rng64();
      engine_params.push_back(p);
      params.push_back({.temperature = p.temperature,
                        .top_k = p.top_k,
                        .top_p = p.top_p,
                        .top_logprobs = p.top_logprobs,
                        .seed = p.seed,
                        .step = step});
    }
    const GpuRows gpu = sample_on_gpu(logits, vocab, params);
    // Dropping the logits from L2 as they are read changes nothing.
    const GpuRows dropped = sample_on_gpu(logits, vocab, params, /*drop_logits=*/true);
    for (int r = 0; r < rows_per_config; ++r) {
      const SampledRow& a = gpu.rows[r];
      const SampledRow& b = dropped.rows[r];
      EXPECT_TRUE(a.token == b.token && std::memcmp(&a.logprob, &b.logprob, sizeof(float)) == 0 &&
                  a.status == b.status && a.num_top == b.num_top)
          << config.name << " row " << r << " with drop_logits: token " << b.token << " logprob "
          << b.logprob << " against " << a.token << " " << a.logprob;
      for (int32_t j = 0; j < a.num_top; ++j) {
        const size_t at = static_cast<size_t>(r) * kSamplingMaxTopLogprobs + j;
        EXPECT_TRUE(gpu.top[at].token == dropped.top[at].token &&
                    gpu.top[at].logprob == dropped.top[at].logprob)
            << config.name << " row " << r << " top " << j << " with drop_logits";
      }
    }
    for (int r = 0; r < rows_per_config; ++r) {
      const std::span<const float> row(logits.data() + static_cast<size_t>(r) * vocab, vocab);
      absl::StatusOr<engine::SampledToken> ref =
          sampler.sample(row, engine_params[r], params[r].step);
      ASSERT_TRUE(ref.ok()) << ref.status();
      const SampledRow& ours = gpu.rows[r];
      ASSERT_EQ(ours.status, kSampledOk) << config.name << " row " << r;
      ++compared;
      if (ours.token != ref->token) {
        const double margin =
            testing::sampling_decision_margin(row, engine_params[r], params[r].step);
        ++boundary_cases;
        std::printf("[sampling] %s vocab %d row %d (kind %d): gpu %d, cpu %d, margin %.3g\n",
                    config.name, vocab, r, r % 5, ours.token, ref->token, margin);
        EXPECT_LT(margin, kBoundaryMargin)
            << config.name << " row " << r << " kind " << r % 5 << ": gpu token " << ours.token
            << ", cpu token " << ref->token;
        continue;
      }
      EXPECT_TRUE(logprob_close(ours.logprob, ref->logprob))
          << config.name << " row " << r << ": logprob " << ours.logprob << " vs " << ref->logprob;
      worst_logprob = std::max(worst_logprob, std::abs(double{ours.logprob} - ref->logprob) /
                                                  std::max(1.0, std::abs(double{ref->logprob})));
      ASSERT_EQ(ours.num_top, static_cast<int32_t>(ref->top_logprobs.size()))
          << config.name << " row " << r;
      for (int32_t j = 0; j < ours.num_top; ++j) {
        const SampledTop& top = gpu.top[static_cast<size_t>(r) * kSamplingMaxTopLogprobs + j];
        EXPECT_EQ(top.token, ref->top_logprobs[j].token)
            << config.name << " row " << r << " top " << j;
        EXPECT_TRUE(logprob_close(top.logprob, ref->top_logprobs[j].logprob))
            << config.name << " row " << r << " top " << j << ": " << top.logprob << " vs "
            << ref->top_logprobs[j].logprob;
      }
    }
  }
  EXPECT_LE(boundary_cases * 100, compared) << "more than 1% boundary cases";
  std::printf(
      "[sampling] vocab %d: %lld rows over %zu configs, %lld boundary cases (margin < %.0e), "
      "worst logprob error %.3g (abs, or rel above 1)\n",
      vocab, static_cast<long long>(compared), std::size(kConfigs),
      static_cast<long long>(boundary_cases), kBoundaryMargin, worst_logprob);
}

// 7 and 1001: fewer tokens than threads or top logprobs asked, rows not 16-byte aligned.
INSTANTIATE_TEST_SUITE_P(
    Vocab, SamplingGpuTest,
    ::testing::Values(std::tuple{7, 40}, std::tuple{1001, 40}, std::tuple{32000, 40},
                      std::tuple{128256, 40}, std::tuple{128256, 20}, std::tuple{1001, 100},
                      std::tuple{128256, 100}),
    [](const ::testing::TestParamInfo<std::tuple<int32_t, int32_t>>& info) {
      return "v" + std::to_string(std::get<0>(info.param)) + "_r" +
             std::to_string(std::get<1>(info.param));
    });

TEST(SamplingGpu, ReportsNonFiniteRows) {
  DEFT_SKIP_WITHOUT_GPU();
  const int32_t vocab = 1000;
  std::vector<float> logits(static_cast<size_t>(vocab) * 3, 0.5f);
  logits[17] = std::numeric_limits<float>::quiet_NaN();
  logits[5] = std::numeric_limits<float>::quiet_NaN();
  logits[vocab + 400] = std::numeric_limits<float>::infinity();
  for (int32_t t = 0; t < vocab; ++t) logits[2 * vocab + t] = -INFINITY;
  const std::vector<RowSamplingParams> params(3, RowSamplingParams{.temperature = 0.8f});
  const GpuRows gpu = sample_on_gpu(logits, vocab, params);
  EXPECT_EQ(gpu.rows[0].status, kSampledNonFiniteLogit);
  EXPECT_EQ(gpu.rows[0].error_token, 5);
  EXPECT_EQ(gpu.rows[1].status, kSampledNonFiniteLogit);
  EXPECT_EQ(gpu.rows[1].error_token, 400);
  EXPECT_EQ(gpu.rows[2].status, kSampledNoFiniteLogit);
  // Greedy rows with drop_logits: a share holding the bad logit is kept, so it is reported.
  const std::vector<RowSamplingParams> greedy(3, RowSamplingParams{.temperature = 0.0f});
  const GpuRows dropped = sample_on_gpu(logits, vocab, greedy, /*drop_logits=*/true);
  EXPECT_EQ(dropped.rows[0].status, kSampledNonFiniteLogit);
  EXPECT_EQ(dropped.rows[0].error_token, 5);
  EXPECT_TRUE(std::isnan(dropped.rows[0].error_logit));
  EXPECT_EQ(dropped.rows[1].status, kSampledNonFiniteLogit);
  EXPECT_EQ(dropped.rows[1].error_token, 400);
  EXPECT_EQ(dropped.rows[1].error_logit, std::numeric_limits<float>::infinity());
  EXPECT_EQ(dropped.rows[2].status, kSampledNoFiniteLogit);
}

// Ties everywhere: greedy and top-n pick the lowest ids; top-k cuts inside a run of ties.
TEST(SamplingGpu, TiesGoToTheLowerTokenId) {
  DEFT_SKIP_WITHOUT_GPU();
  const int32_t vocab = 50000;
  std::vector<float> logits(static_cast<size_t>(vocab), 1.0f);
  logits[30000] = 2.0f;
  logits[40000] = 2.0f;
  logits[100] = -INFINITY;
  std::vector<RowSamplingParams> params = {
      {.temperature = 0.0f, .top_logprobs = 4},
      {.temperature = 1.0f, .top_k = 3, .seed = 1},
      {.temperature = 1.0f, .top_k = 3, .seed = 2},
  };
  std::vector<float> rows;
  for (size_t i = 0; i < params.size(); ++i) rows.insert(rows.end(), logits.begin(), logits.end());
  const GpuRows gpu = sample_on_gpu(rows, vocab, params);
  EXPECT_EQ(gpu.rows[0].token, 30000);
  ASSERT_EQ(gpu.rows[0].num_top, 4);
  EXPECT_EQ(gpu.top[0].token, 30000);
  EXPECT_EQ(gpu.top[1].token, 40000);
  EXPECT_EQ(gpu.top[2].token, 0);
  EXPECT_EQ(gpu.top[3].token, 1);
  engine::Sampler sampler;
  for (size_t i = 1; i < params.size(); ++i) {
    const SamplingParams p{.temperature = 1.0f, .top_k = 3, .seed = params[i].seed};
    absl::StatusOr<engine::SampledToken> ref = sampler.sample(logits, p, 0);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(gpu.rows[i].token, ref->token) << "seed " << p.seed;
    EXPECT_TRUE(gpu.rows[i].token == 0 || gpu.rows[i].token == 30000 || gpu.rows[i].token == 40000);
  }
}

// Batch-invariant launches (deterministic mode): a row's token, log-probability and top list are
// the same bits in a launch of 1, 30, 70 or 200 rows (the default launch splits a row over fewer
// blocks as rows grow, so its log-probabilities may differ in the last bits: counted, printed).
TEST(SamplingGpu, BatchInvariantRowsKeepTheirBitsAtAnyRowCount) {
  DEFT_SKIP_WITHOUT_GPU();
  const int32_t vocab = 128256;
  const uint32_t seed = static_cast<uint32_t>(fresh_seed());
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int32_t total = 200;
  std::vector<float> logits;
  std::vector<RowSamplingParams> params;
  for (int32_t r = 0; r < total; ++r) {
    const std::vector<float> row = random_row(vocab, r % 5, rng);
    logits.insert(logits.end(), row.begin(), row.end());
    const Config& c = kConfigs[r % std::size(kConfigs)];
    params.push_back({.temperature = c.temperature,
                      .top_k = c.top_k,
                      .top_p = c.top_p,
                      .top_logprobs = c.top_logprobs,
                      .seed = rng(),
                      .step = static_cast<uint64_t>(r)});
  }
  const auto same = [](const GpuRows& a, int32_t ra, const GpuRows& b, int32_t rb) {
    const SampledRow& x = a.rows[ra];
    const SampledRow& y = b.rows[rb];
    if (x.token != y.token || std::memcmp(&x.logprob, &y.logprob, sizeof(float)) != 0 ||
        x.num_top != y.num_top) {
      return false;
    }
    const size_t k = kSamplingMaxTopLogprobs;
    return std::memcmp(&a.top[ra * k], &b.top[rb * k], sizeof(SampledTop) * x.num_top) == 0;
  };
  for (const bool batch_invariant : {true, false}) {
    const GpuRows all = sample_on_gpu(logits, vocab, params, false, batch_invariant);
    int32_t differ = 0, compared = 0;
    for (const int32_t count : {1, 30, 70}) {
      for (int32_t first = 0; first + count <= total; first += 67) {
        const std::vector<float> part(logits.begin() + static_cast<int64_t>(first) * vocab,
                                      logits.begin() + static_cast<int64_t>(first + count) * vocab);
        const std::vector<RowSamplingParams> part_params(params.begin() + first,
                                                         params.begin() + first + count);
        const GpuRows some = sample_on_gpu(part, vocab, part_params, false, batch_invariant);
        for (int32_t r = 0; r < count; ++r, ++compared) {
          ASSERT_EQ(all.rows[first + r].status, kSampledOk);
          EXPECT_EQ(all.rows[first + r].token, some.rows[r].token) << "row " << first + r;
          if (!same(all, first + r, some, r)) ++differ;
        }
      }
    }
    std::printf("[ batch invariance ] %s launch: %d of %d rows differ from the 200-row launch\n",
                batch_invariant ? "batch-invariant" : "default", differ, compared);
    if (batch_invariant) {
      EXPECT_EQ(differ, 0);
    }
  }
}

// Times (printed, not asserted): 20 and 64 rows of 128256 logits, greedy, plain temperature,
// top-k, top-p and top-k + top-p with 20 top logprobs.
TEST(SamplingGpu, Timing) {
  DEFT_SKIP_WITHOUT_GPU();
  const int32_t vocab = 128256;
  std::mt19937 rng(5);
  for (int32_t rows : {20, 64}) {
    std::vector<float> logits;
    for (int32_t r = 0; r < rows; ++r) {
      const std::vector<float> row = random_row(vocab, 4, rng);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    DeviceBuffer d_logits = to_device(logits);
    DeviceBuffer workspace(sampling_workspace_bytes(rows, vocab));
    DeviceBuffer d_out(sizeof(SampledRow) * rows);
    DeviceBuffer d_top(sizeof(SampledTop) * rows * kSamplingMaxTopLogprobs);
    for (const Config& config : {kConfigs[0], kConfigs[3], kConfigs[5], kConfigs[6], kConfigs[7]}) {
      const std::vector<RowSamplingParams> params(
          rows, RowSamplingParams{.temperature = config.temperature,
                                  .top_k = config.top_k,
                                  .top_p = config.top_p,
                                  .top_logprobs = config.top_logprobs,
                                  .seed = 3});
      DeviceBuffer d_params = to_device(params);
      const auto launch = [&] {
        launch_sample_rows({.num_rows = rows, .vocab_size = vocab, .row_stride = vocab},
                           d_logits.as<float>(), d_params.as<RowSamplingParams>(),
                           workspace.as<float>(), d_out.as<SampledRow>(), d_top.as<SampledTop>(),
                           nullptr);
      };
      launch();
      cudaEvent_t start, stop;
      DEFT_CUDA_CHECK(cudaEventCreate(&start));
      DEFT_CUDA_CHECK(cudaEventCreate(&stop));
      constexpr int kIterations = 20;
      DEFT_CUDA_CHECK(cudaEventRecord(start));
      for (int i = 0; i < kIterations; ++i) launch();
      DEFT_CUDA_CHECK(cudaEventRecord(stop));
      DEFT_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      std::printf("[sampling timing] %d rows x %d, %s: %.1f us per launch\n", rows, vocab,
                  config.name, 1e3 * ms / kIterations);
      DEFT_CUDA_CHECK(cudaEventDestroy(start));
      DEFT_CUDA_CHECK(cudaEventDestroy(stop));
    }
  }
}

}  // namespace
}  // namespace deft::kernels
