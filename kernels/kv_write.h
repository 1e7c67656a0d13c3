// Writes the step's new K and V rows into their paged KV-cache slots (GPU).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/kv_write_cpu.h"

namespace deft::kernels {

// k_new / v_new: device, token t's row at k_new + t * dims.new_token_stride; slots: device
// [num_tokens]. Same contract as kv_write_cpu. No host synchronisation (graph-capturable).
void launch_kv_write(const KvWriteDims& dims, DType dtype, const int32_t* slots,
                     const void* k_new, const void* v_new, void* k_cache, void* v_cache,
                     cudaStream_t stream);

}  // namespace deft::kernels
