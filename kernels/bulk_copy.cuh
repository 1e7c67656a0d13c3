// Hopper's bulk tensor copy engine (TMA, sm_90) and the shared-memory barriers it completes on:
// a thread issues a 2-D tile copy global -> shared described by a CUtensorMap (see
// kernels/tensor_map.h); the copy adds its bytes to an mbarrier's transaction count, and threads
// wait on the barrier's phase parity.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/cp_async.cuh"  // smem_address

namespace deft::kernels::detail {

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(barrier)),
               "r"(arrivals)
               : "memory");
}

// Makes barrier initialisation visible to the copy engine (follow with a CTA barrier).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also expects `bytes` more of transactions (the copies issued next).
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(barrier)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(barrier))
               : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  const uint32_t address = smem_address(barrier);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}

// An L2 policy for data read once (weights streamed by a decode GEMM): evicted first.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// An L2 policy for data every CTA reads again (a decode GEMM's activations): evicted last.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Copies the box of `map` at (c0 innermost, c1) into `dst` (aligned as the map's swizzle needs),
// completing `bytes` of the box on `barrier`. Out-of-range elements arrive as zeros.
__device__ __forceinline__ void bulk_copy_tile_2d(void* dst, const CUtensorMap* map, int32_t c0,
                                                  int32_t c1, uint64_t* barrier, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_address(barrier)),
      "l"(policy)
      : "memory");
}

}  // namespace deft::kernels::detail
