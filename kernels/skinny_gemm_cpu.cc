#include "kernels/skinny_gemm_cpu.h"

#include <cstddef>

namespace deft::kernels {

void skinny_gemm_cpu(const SkinnyGemmDims& dims, const float* x, const float* w, float* y,
                     bool accumulate) {
  for (int32_t m = 0; m < dims.rows; ++m) {
    const float* x_row = x + static_cast<size_t>(m) * dims.in;
    for (int32_t n = 0; n < dims.out; ++n) {
      const float* w_row = w + static_cast<size_t>(n) * dims.in;
      double sum = 0.0;
      for (int32_t k = 0; k < dims.in; ++k) sum += static_cast<double>(x_row[k]) * w_row[k];
      float& out = y[static_cast<size_t>(m) * dims.out + n];
      out = accumulate ? static_cast<float>(out + sum) : static_cast<float>(sum);
    }
  }
}

}  // namespace deft::kernels
