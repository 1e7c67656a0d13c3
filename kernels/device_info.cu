#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/per_device.h"

namespace deft::kernels {

int current_device() {
  int device = 0;
  DEFT_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int32_t current_device_sm_count() {
  static PerDevice<int32_t> counts;
  return counts.get([] {
    int sms = 0;
    DEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current_device()));
    return static_cast<int32_t>(sms);
  });
}

}  // namespace deft::kernels
