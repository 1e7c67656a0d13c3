// CPU twin of the skinny GEMM (kernels/skinny_gemm_cpu.h): y (= or +=) x · w^T.
#include "kernels/skinny_gemm_cpu.h"

#include <gtest/gtest.h>

#include <vector>

namespace deft::kernels {
namespace {

TEST(SkinnyGemmCpu, SetsAndAccumulates) {
  // x [2][3], w [4][3]: y[m][n] = sum_k x[m][k] * w[n][k].
  const std::vector<float> x = {1, 2, 3, -1, 0, 2};
  const std::vector<float> w = {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1};
  std::vector<float> y(8, 100.0f);
  skinny_gemm_cpu({.rows = 2, .in = 3, .out = 4}, x.data(), w.data(), y.data(), false);
  EXPECT_EQ(y, (std::vector<float>{1, 2, 3, 6, -1, 0, 2, 1}));
  skinny_gemm_cpu({.rows = 2, .in = 3, .out = 4}, x.data(), w.data(), y.data(), true);
  EXPECT_EQ(y, (std::vector<float>{2, 4, 6, 12, -2, 0, 4, 2}));
}

}  // namespace
}  // namespace deft::kernels
