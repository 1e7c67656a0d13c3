#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"

namespace deft::kernels {

int32_t current_device_sm_count() {
  // Read once per device (0: not read yet); a process may run a runner on each of its GPUs.
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int32_t>, kMaxDevices> counts{};
  int device = 0;
  DEFT_CUDA_CHECK(cudaGetDevice(&device));
  const auto read = [device] {
    int sms = 0;
    DEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return static_cast<int32_t>(sms);
  };
  if (device < 0 || device >= kMaxDevices) return read();
  int32_t count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    count = read();
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

}  // namespace deft::kernels
