// The current device's properties that launches size their grids by.
#pragma once

#include <cstdint>

namespace deft::kernels {

// The current device (cudaGetDevice).
int current_device();

// Number of SMs of the current device, read once per device.
int32_t current_device_sm_count();

}  // namespace deft::kernels
