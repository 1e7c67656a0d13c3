// A value made once for each CUDA device, on its first use while that device is current: what
// CUDA keeps per device (a kernel's dynamic shared-memory limit) or what differs between devices
// (occupancy, the SM count, whether the sm_90a machine code runs). A process may run a model on
// each of its GPUs (LlamaCudaOptions::device), so a process-wide `static` would set up the first
// device only.
#pragma once

#include <array>
#include <mutex>

#include "kernels/device_info.h"

namespace deft::kernels {

template <typename T>
class PerDevice {
 public:
  // The current device's value; `make()` runs once per device (with that device current).
  // Devices past kMaxDevices make it every time.
  template <typename Make>
  T get(Make&& make) {
    const int device = current_device();
    if (device < 0 || device >= kMaxDevices) return make();
    std::call_once(once_[device], [&] { values_[device] = make(); });
    return values_[device];
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::array<std::once_flag, kMaxDevices> once_;
  std::array<T, kMaxDevices> values_{};
};

}  // namespace deft::kernels
