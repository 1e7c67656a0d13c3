// Makes a device current for a scope and gives the caller's back at its end: a model on one GPU
// may be driven from a thread whose current device is another (LlamaCudaOptions::device).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace deft::kernels {

class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    DEFT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) DEFT_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceScope() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace deft::kernels
