// CPU twin of the skinny GEMM (kernels/skinny_gemm.h): y[rows][out] (= or +=) x[rows][in] ·
// w[out][in]^T, the products summed in double, y fp32.
#pragma once

#include <cstdint>

namespace deft::kernels {

struct SkinnyGemmDims {
  int32_t rows = 0;  // M: rows of x and y (query rows of a step)
  int32_t in = 0;    // K: columns of x and w
  int32_t out = 0;   // N: rows of w, columns of y
};

void skinny_gemm_cpu(const SkinnyGemmDims& dims, const float* x, const float* w, float* y,
                     bool accumulate);

}  // namespace deft::kernels
