// CPU twin of the KV write kernel (kernels/kv_write.h): copies each new token's K and V rows
// into its cache slot. Cache layout: [num_slots][num_kv_heads][head_dim].
#pragma once

#include <cstdint>

namespace deft::kernels {

struct KvWriteDims {
  int32_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  // Elements between consecutive tokens of k_new / v_new (num_kv_heads * head_dim when packed;
  // larger when K and V are slices of a fused QKV projection).
  int64_t new_token_stride = 0;
};

// Token t's K row (num_kv_heads * head_dim elements) goes to k_cache slot slots[t], V likewise.
// A negative slot means "no slot" (a padding token) and is skipped.
void kv_write_cpu(const KvWriteDims& dims, const int32_t* slots, const float* k_new,
                  const float* v_new, float* k_cache, float* v_cache);

}  // namespace deft::kernels
