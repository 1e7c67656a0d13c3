#include "kernels/device_info.h"

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace deft::kernels {

int32_t current_device_sm_count() {
  static const int32_t count = [] {
    int device = 0, sms = 0;
    DEFT_CUDA_CHECK(cudaGetDevice(&device));
    DEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return static_cast<int32_t>(sms);
  }();
  return count;
}

}  // namespace deft::kernels
