// Checking macros for CUDA runtime calls. A failing call is a bug or a broken device, never
// bad user input (that is validated before it reaches kernels/), so it aborts in every build, in
// DEFT_CHECK's format (kernels/check.h): "check failed at FILE:LINE: CALL: CUDA error NAME:
// MESSAGE".
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/check.h"

namespace deft::kernels::detail {

[[noreturn]] inline void cuda_check_failed(cudaError_t error, const char* call, const char* file,
                                           int line) {
  ::deft::detail::check_failed(call, file, line, "CUDA error %s: %s", cudaGetErrorName(error),
                               cudaGetErrorString(error));
}

}  // namespace deft::kernels::detail

// DEFT_CUDA_CHECK(cudaMemcpyAsync(...)); aborts on any error.
#define DEFT_CUDA_CHECK(call)                                                                  \
  do {                                                                                         \
    const cudaError_t deft_cuda_error_ = (call);                                               \
    if (deft_cuda_error_ != cudaSuccess) {                                                     \
      ::deft::kernels::detail::cuda_check_failed(deft_cuda_error_, #call, __FILE__, __LINE__); \
    }                                                                                          \
  } while (0)

// After a kernel launch: reports launch-configuration errors (bad grid, too much shared memory).
// Does not synchronize, so it is safe inside CUDA graph capture.
#define DEFT_CUDA_CHECK_LAUNCH() DEFT_CUDA_CHECK(cudaGetLastError())
