#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/peer_all_reduce.h"

namespace deft::kernels {
namespace {

constexpr int kThreads = 512;

// One rank's buffer: flags [blocks][max ranks] (peer p writes slot [b][p] of this rank's), the
// CTAs' call counters [blocks], then the two staging halves, each [ranks][capacity] floats (slot
// p: what rank p sent), 256-byte aligned.
constexpr size_t kFlagsBytes = sizeof(uint32_t) * kPeerAllReduceBlocks * kPeerAllReduceMaxRanks;
constexpr size_t kCountersBytes = sizeof(uint32_t) * kPeerAllReduceBlocks;
constexpr size_t kStagingOffset = (kFlagsBytes + kCountersBytes + 255) / 256 * 256;

struct Params {
  char* buffers[kPeerAllReduceMaxRanks];
  float* data;
  int64_t count;
  int64_t capacity;  // floats of one slot (a multiple of 4)
  int32_t rank;
  int32_t ranks;
};

__device__ __forceinline__ uint32_t* flags_of(char* buffer) {
  return reinterpret_cast<uint32_t*>(buffer);
}
__device__ __forceinline__ uint32_t* counters_of(char* buffer) {
  return reinterpret_cast<uint32_t*>(buffer + kFlagsBytes);
}
// Slot `from` of staging half `half` in `buffer`.
__device__ __forceinline__ float* slot_of(char* buffer, const Params& p, uint32_t half,
                                          int32_t from) {
  return reinterpret_cast<float*>(buffer + kStagingOffset) +
         (static_cast<int64_t>(half) * p.ranks + from) * p.capacity;
}

__device__ __forceinline__ void store_release_system(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// \brief Push, signal, wait, sum: CTA b sends its float4s of the data to slot `rank` of every
// rank's staging half (remote stores are posted, so the NVLink latency is paid once, at the
// signal), signals, waits for every peer's CTA b, then sums its slots locally in rank order.
__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(Params p) {
  const int b = static_cast<int>(blockIdx.x);
  char* own = p.buffers[p.rank];
  __shared__ uint32_t call_shared;
  if (threadIdx.x == 0) call_shared = counters_of(own)[b] + 1;
  __syncthreads();
  const uint32_t call = call_shared;
  const uint32_t half = call & 1u;
  // The CTA's float4s [begin, end); the count's last count % 4 floats go to the last CTA.
  const int64_t vectors = p.count / 4;
  const int64_t per_block = (vectors + kPeerAllReduceBlocks - 1) / kPeerAllReduceBlocks;
  const int64_t begin = min(vectors, per_block * b);
  const int64_t end = min(vectors, begin + per_block);
  const bool tail = b == kPeerAllReduceBlocks - 1;

  // 1. Push.
  const float4* data4 = reinterpret_cast<const float4*>(p.data);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float4 v = data4[i];
    for (int32_t r = 0; r < p.ranks; ++r) {
      reinterpret_cast<float4*>(slot_of(p.buffers[r], p, half, p.rank))[i] = v;
    }
  }
  if (tail) {
    for (int64_t i = vectors * 4 + threadIdx.x; i < p.count; i += kThreads) {
      for (int32_t r = 0; r < p.ranks; ++r) slot_of(p.buffers[r], p, half, p.rank)[i] = p.data[i];
    }
  }
  __syncthreads();

  // 2. Signal every peer (release, after the CTA's stores), wait for every peer's CTA b.
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int32_t r = 0; r < p.ranks; ++r) {
      if (r != p.rank) {
        store_release_system(flags_of(p.buffers[r]) + b * kPeerAllReduceMaxRanks + p.rank, call);
      }
    }
    for (int32_t r = 0; r < p.ranks; ++r) {
      if (r == p.rank) continue;
      const uint32_t* flag = flags_of(own) + b * kPeerAllReduceMaxRanks + r;
      while (static_cast<int32_t>(load_acquire_system(flag) - call) < 0) {
      }
    }
    counters_of(own)[b] = call;
  }
  __syncthreads();

  // 3. The sum of the local slots in rank order (uncached: peers wrote them).
  float4* out4 = reinterpret_cast<float4*>(p.data);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float4 sum = __ldcv(reinterpret_cast<const float4*>(slot_of(own, p, half, 0)) + i);
    for (int32_t r = 1; r < p.ranks; ++r) {
      const float4 v = __ldcv(reinterpret_cast<const float4*>(slot_of(own, p, half, r)) + i);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    out4[i] = sum;
  }
  if (tail) {
    for (int64_t i = vectors * 4 + threadIdx.x; i < p.count; i += kThreads) {
      float sum = __ldcv(slot_of(own, p, half, 0) + i);
      for (int32_t r = 1; r < p.ranks; ++r) sum += __ldcv(slot_of(own, p, half, r) + i);
      p.data[i] = sum;
    }
  }
}

}  // namespace

size_t peer_all_reduce_buffer_bytes(int32_t ranks, int64_t capacity) {
  const size_t slot = static_cast<size_t>((capacity + 3) / 4 * 4);
  return kStagingOffset + 2 * sizeof(float) * static_cast<size_t>(ranks) * slot;
}

void launch_peer_all_reduce(const PeerAllReduceTable& table, int32_t rank, float* data,
                            int64_t count, cudaStream_t stream) {
  DEFT_CHECK(reinterpret_cast<uintptr_t>(data) % 16 == 0,
             "launch_peer_all_reduce: data must be 16-byte aligned");
  DEFT_CHECK(table.ranks >= 2 && table.ranks <= kPeerAllReduceMaxRanks && rank >= 0 &&
                 rank < table.ranks && count >= 0 && count <= table.capacity,
             "launch_peer_all_reduce: rank %d of %d, %lld floats (capacity %lld)", rank,
             table.ranks, static_cast<long long>(count), static_cast<long long>(table.capacity));
  Params p{};
  for (int32_t r = 0; r < table.ranks; ++r) p.buffers[r] = static_cast<char*>(table.buffers[r]);
  p.data = data;
  p.count = count;
  p.capacity = (table.capacity + 3) / 4 * 4;
  p.rank = rank;
  p.ranks = table.ranks;
  peer_all_reduce_kernel<<<kPeerAllReduceBlocks, kThreads, 0, stream>>>(p);
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
