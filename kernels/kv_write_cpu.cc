#include "kernels/kv_write_cpu.h"

#include <algorithm>

namespace deft::kernels {

void kv_write_cpu(const KvWriteDims& dims, const int32_t* slots, const float* k_new,
                  const float* v_new, float* k_cache, float* v_cache) {
  const int64_t row = int64_t{dims.num_kv_heads} * dims.head_dim;
  for (int32_t token = 0; token < dims.num_tokens; ++token) {
    const int32_t slot = slots[token];
    if (slot < 0) continue;
    std::copy_n(k_new + token * dims.new_token_stride, row, k_cache + slot * row);
    std::copy_n(v_new + token * dims.new_token_stride, row, v_cache + slot * row);
  }
}

}  // namespace deft::kernels
