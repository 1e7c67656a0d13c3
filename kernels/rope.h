// Rotary position embedding on the GPU (in place), Hugging Face Llama "rotate_half" convention;
// the contract is rope_cpu's (kernels/rope_cpu.h). Math in fp32, one rounding per element.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/rope_cpu.h"

namespace deft::kernels {

// positions: device [num_tokens]; inv_freq: device [head_dim / 2]; q, k: device, either null.
void launch_rope(const RopeDims& dims, DType dtype, const int32_t* positions,
                 const float* inv_freq, void* q, void* k, cudaStream_t stream);

}  // namespace deft::kernels
