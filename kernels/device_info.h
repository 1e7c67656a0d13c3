// The current device's properties that launches size their grids by.
#pragma once

#include <cstdint>

namespace deft::kernels {

// Number of SMs of the current device (cudaGetDevice), read once per device.
int32_t current_device_sm_count();

}  // namespace deft::kernels
