// BenchResult's pure parts: the GPU tag that names result files, and the percentiles.
#include "bench/bench_result.h"

#include <gtest/gtest.h>

namespace deft::bench {
namespace {

TEST(BenchResult, GpuTagIsTheModelWordOfTheDriverName) {
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA H100 80GB HBM3"), "h100");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA H200"), "h200");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA H200", 2), "h200x2");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA GH200 480GB"), "gh200");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA B200"), "b200");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA A100-SXM4-80GB"), "a100");
  EXPECT_EQ(BenchResult::gpu_tag("NVIDIA GeForce RTX 4090"), "4090");
  EXPECT_EQ(BenchResult::gpu_tag(""), "gpu");
  EXPECT_EQ(BenchResult::gpu_tag("Unknown device", 4), "gpux4");
}

TEST(BenchResult, SummarizeTakesTheMedianAndTheTenthPercentiles) {
  std::vector<double> samples;
  for (int i = 10; i >= 0; --i) samples.push_back(i);
  const Samples s = summarize(samples);
  EXPECT_EQ(s.median, 5);
  EXPECT_EQ(s.p10, 1);
  EXPECT_EQ(s.p90, 9);
  EXPECT_EQ(summarize({}).median, 0);
}

}  // namespace
}  // namespace deft::bench
