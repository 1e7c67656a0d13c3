#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/peer_all_reduce.h"

namespace deft::kernels {
namespace {

constexpr int kThreads = 512;

// One rank's buffer: flags [blocks][max ranks] (peer p writes slot [b][p] of this rank's), the
// CTAs' call counters [blocks], then the two staging halves, 256-byte aligned.
constexpr size_t kFlagsBytes = sizeof(uint32_t) * kPeerAllReduceBlocks * kPeerAllReduceMaxRanks;
constexpr size_t kCountersBytes = sizeof(uint32_t) * kPeerAllReduceBlocks;
constexpr size_t kStagingOffset = (kFlagsBytes + kCountersBytes + 255) / 256 * 256;

struct Params {
  char* buffers[kPeerAllReduceMaxRanks];
  float* data;
  int64_t count;
  int64_t capacity;
  int32_t rank;
  int32_t ranks;
};

__device__ __forceinline__ uint32_t* flags_of(char* buffer) {
  return reinterpret_cast<uint32_t*>(buffer);
}
__device__ __forceinline__ uint32_t* counters_of(char* buffer) {
  return reinterpret_cast<uint32_t*>(buffer + kFlagsBytes);
}
__device__ __forceinline__ float* staging_of(char* buffer, int64_t capacity, uint32_t half) {
  return reinterpret_cast<float*>(buffer + kStagingOffset) + half * capacity;
}

__device__ __forceinline__ void store_release_system(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// \brief The CTA's elements: [begin, end) of the count, in float4 steps where aligned.
__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(Params p) {
  const int b = static_cast<int>(blockIdx.x);
  char* own = p.buffers[p.rank];
  __shared__ uint32_t call_shared;
  if (threadIdx.x == 0) call_shared = counters_of(own)[b] + 1;
  __syncthreads();
  const uint32_t call = call_shared;
  const uint32_t half = call & 1u;
  const int64_t per_block = (p.count + kPeerAllReduceBlocks - 1) / kPeerAllReduceBlocks;
  const int64_t begin = min(p.count, per_block * b);
  const int64_t end = min(p.count, begin + per_block);

  // 1. This rank's input into its staging half.
  float* mine = staging_of(own, p.capacity, half);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) mine[i] = p.data[i];
  __syncthreads();

  // 2. Signal every peer (release: the staging writes first), then wait for every peer's signal.
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int32_t r = 0; r < p.ranks; ++r) {
      if (r == p.rank) continue;
      store_release_system(flags_of(p.buffers[r]) + b * kPeerAllReduceMaxRanks + p.rank, call);
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

  // 3. The sum in rank order over every rank's staging (the peers' over NVLink, uncached).
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float sum = 0.0f;
    for (int32_t r = 0; r < p.ranks; ++r) {
      const float* staging = staging_of(p.buffers[r], p.capacity, half);
      sum = r == 0 ? __ldcv(staging + i) : sum + __ldcv(staging + i);
    }
    p.data[i] = sum;
  }
}

}  // namespace

size_t peer_all_reduce_buffer_bytes(int64_t capacity) {
  return kStagingOffset + 2 * sizeof(float) * static_cast<size_t>(capacity);
}

void launch_peer_all_reduce(const PeerAllReduceTable& table, int32_t rank, float* data,
                            int64_t count, cudaStream_t stream) {
  DEFT_CHECK(table.ranks >= 2 && table.ranks <= kPeerAllReduceMaxRanks && rank >= 0 &&
                 rank < table.ranks && count >= 0 && count <= table.capacity,
             "launch_peer_all_reduce: rank %d of %d, %lld floats (capacity %lld)", rank,
             table.ranks, static_cast<long long>(count), static_cast<long long>(table.capacity));
  Params p{};
  for (int32_t r = 0; r < table.ranks; ++r) p.buffers[r] = static_cast<char*>(table.buffers[r]);
  p.data = data;
  p.count = count;
  p.capacity = table.capacity;
  p.rank = rank;
  p.ranks = table.ranks;
  peer_all_reduce_kernel<<<kPeerAllReduceBlocks, kThreads, 0, stream>>>(p);
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
