// Skinny GEMM (kernels/skinny_gemm.h): y^T = w · x^T on warpgroup MMAs, the weight rows on the
// 64-row side of wgmma m64nNk16 and the few x rows (padded to N = 32 or 64) on its N side.
//
// Work: the weight is cut into tiles of 128 rows (two wgmmas share each x box, so x, read from
// L2 for every tile, costs at most half as much traffic as w), each tile into k-blocks of 64
// columns. In each CTA a producer warp streams the [128 rows][64 K] boxes of w and the matching
// [N][64] boxes of x with the bulk tensor copy engine into a ring of stages completing on
// mbarriers, and one consumer warpgroup multiplies each stage straight from shared memory (both
// operands in the 128-byte swizzle) and frees it as soon as its MMAs are done. Before waiting for
// the kernel ahead of it (programmatic dependent launch) the producer already fills the ring with
// weights: they do not depend on that kernel.
//
// The grid (grid_for) takes one of three forms; every CTA's range of (tile, k-block) items is
// contiguous, tile by tile:
// - a tile per CTA when there are at least as many tiles as SMs (and at most two per SM);
// - each tile split along K among a cluster of 2..8 CTAs when there are fewer tiles: the CTAs
//   put their partial tiles in their (idle) rings, and after a cluster barrier rank r sums a
//   1/cluster share over the ranks in rank order through distributed shared memory;
// - stream-K for more than two tiles per SM: the items are divided evenly among two CTAs per SM.
//   A tile shared by several CTAs is owned by the one holding its first k-blocks (that piece is
//   the last of its range); every other CTA's piece is the first of its range, and it hands it
//   over, in its accumulator registers' layout, through a global workspace slot and a flag
//   (release / acquire). The owner adds the pieces in CTA order and clears the flags for the
//   next launch. Waits only go to higher CTAs, whose first piece comes before any wait of
//   theirs, so they cannot cycle.
// Sums are in a fixed order, so results are deterministic. Outputs are written from registers;
// fp32 accumulation into y is one reduction per element (y has one writer), with no round trip.
// SwiGLU (Params::swiglu_width): a tile is 64 gate rows and the same 64 up rows of w (two 64-row
// boxes a stage), so each output's gate and up sums land in the same accumulator slots of the
// tile's two wgmmas and the epilogue writes silu(gate) * up; never split over a cluster.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "kernels/bulk_copy.cuh"
#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/device_info.h"
#include "kernels/float_convert.cuh"
#include "kernels/per_device.h"
#include "kernels/skinny_gemm.h"
#include "kernels/tensor_map.h"
#include "kernels/wgmma.cuh"

namespace deft::kernels {
namespace {

namespace cg = cooperative_groups;
using detail::mbarrier_wait;

constexpr int kMmaRows = 64;       // the M of a wgmma
constexpr int kTileRows = 128;     // weight rows per tile: two wgmmas
constexpr int kBlockK = 64;        // K elements per stage: one swizzled row
constexpr int kConsumerWarps = 4;  // one warpgroup
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kCtasPerSm = 2;                    // one CTA's epilogue overlaps the other's stream
constexpr int kMaxCluster = 8;                   // portable cluster size
constexpr int kMaxN = 64;
constexpr int kWBoxBytes = kTileRows * kBlockK * 2;
constexpr int kSlotFloats = kMaxN * kTileRows;  // a CTA's workspace slot

// Shared memory for N padded x rows: the ring and its barriers (two CTAs fit on an SM's 228 KB).
template <int kN>
struct Layout {
  static constexpr int kXBoxBytes = kN * kBlockK * 2;
  static constexpr int kStageBytes = kWBoxBytes + kXBoxBytes;  // a multiple of 1024
  static constexpr int kStages = kN == 32 ? 5 : 4;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  // full[kStages], empty[kStages]
  static constexpr int kAlignSlack = 1024;  // swizzled boxes need 1024-byte alignment
  static constexpr int kBytes = kBarrierOffset + 2 * kStages * 8 + kAlignSlack;
};

struct Params {
  void* y;
  float* workspace;  // [ctas][kMaxN * kTileRows]: each CTA's handed-over piece
  uint32_t* flags;   // [ctas]: 1 while a CTA's piece waits for its owner
  int32_t rows, in, out;
  int32_t k_blocks;  // ceil(in / kBlockK)
  int64_t items;     // tiles * k_blocks
  int32_t cluster;   // > 1: the grid is tiles x cluster, a tile's CTAs one cluster (see top)
  bool y_fp32, accumulate;
  // > 0 (SwiGLU, launch_skinny_gemm_swiglu): w is [2 * swiglu_width][in], gate rows then up
  // rows; tile t holds gate rows [64 t, 64 t + 64) and the same up rows, and y[rows][swiglu_width]
  // gets silu(gate) * up (out == swiglu_width).
  int32_t swiglu_width;
};

// First item of CTA c's range.
__device__ __forceinline__ int64_t range_begin(int64_t items, int ctas, int c) {
  return items * c / ctas;
}

// The CTA whose range holds `item`.
__device__ __forceinline__ int cta_of(int64_t items, int ctas, int64_t item) {
  int c = static_cast<int>(item * ctas / items);
  while (c + 1 < ctas && range_begin(items, ctas, c + 1) <= item) ++c;
  while (range_begin(items, ctas, c) > item) --c;
  return c;
}

__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// y[at] = value, or y[at] += value (fp32: a reduction in L2, no round trip; each element has one
// writer, so the single add keeps the result deterministic).
template <typename T>
__device__ __forceinline__ void write_y(const Params& p, int64_t at, float value) {
  if (p.y_fp32) {
    float* y = static_cast<float*>(p.y) + at;
    if (p.accumulate) {
      atomicAdd(y, value);
    } else {
      *y = value;
    }
  } else {
    T* y = static_cast<T*>(p.y) + at;
    *y = from_float<T>(p.accumulate ? to_float(*y) + value : value);
  }
}

// All threads of every CTA of the cluster (barrier.cluster, not warp-aligned: the producer
// warp's lanes arrive apart).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

__device__ __forceinline__ void flag_release(uint32_t* flag) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
}

__device__ __forceinline__ void flag_acquire(const uint32_t* flag) {
  uint32_t value = 0;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
    if (value != 0) return;
    __nanosleep(64);
  }
}

template <typename T, int kN>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    skinny_gemm_kernel(const __grid_constant__ CUtensorMap w_map,
                       const __grid_constant__ CUtensorMap x_map, const Params p) {
#if DEFT_HAS_WGMMA
  using L = Layout<kN>;
  constexpr int kFragVecs = kTileRows / kMmaRows * kN / 8;  // accumulator float4s a thread
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + L::kAlignSlack - 1) &
                                 ~uintptr_t{L::kAlignSlack - 1});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  uint64_t* empty = full + L::kStages;

  const int ctas = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int64_t begin = range_begin(p.items, ctas, cta);
  const int64_t end = range_begin(p.items, ctas, cta + 1);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      detail::mbarrier_init(&full[s], 1);
      detail::mbarrier_init(&empty[s], kConsumerWarps);
    }
    detail::mbarrier_init_fence();
  }
  // The kernel after this one may be scheduled now; it waits for our outputs itself.
  detail::allow_dependent_launch();
  __syncthreads();

  if (warp == kConsumerWarps) {
    // Producer: ring index i is item begin + i.
    if (lane == 0) {
      const uint64_t stream_policy = detail::l2_evict_first_policy();
      const uint64_t keep_policy = detail::l2_evict_last_policy();
      const int total = static_cast<int>(end - begin);
      const auto issue_w = [&](int i) {
        const int64_t item = begin + i;
        const int s = i % L::kStages;
        const int k = static_cast<int>(item % p.k_blocks) * kBlockK;
        const int tile = static_cast<int>(item / p.k_blocks);
        detail::mbarrier_arrive_expect_bytes(&full[s], L::kStageBytes);
        if (p.swiglu_width > 0) {
          // Two boxes of 64 rows (w_map's box): the tile's gate rows, then its up rows.
          detail::bulk_copy_tile_2d(smem + s * L::kStageBytes, &w_map, k, tile * kMmaRows, &full[s],
                                    stream_policy);
          detail::bulk_copy_tile_2d(smem + s * L::kStageBytes + kMmaRows * detail::kSwizzleRowBytes,
                                    &w_map, k, p.swiglu_width + tile * kMmaRows, &full[s],
                                    stream_policy);
        } else {
          detail::bulk_copy_tile_2d(smem + s * L::kStageBytes, &w_map, k, tile * kTileRows,
                                    &full[s], stream_policy);
        }
      };
      const auto issue_x = [&](int i) {
        const int s = i % L::kStages;
        detail::bulk_copy_tile_2d(smem + s * L::kStageBytes + kWBoxBytes, &x_map,
                                  static_cast<int>((begin + i) % p.k_blocks) * kBlockK, 0, &full[s],
                                  keep_policy);
      };
      // Weights do not depend on the kernel before: fill the ring with them first.
      const int head = min(total, L::kStages);
      for (int i = 0; i < head; ++i) issue_w(i);
      detail::wait_for_prerequisite_grid();  // x is that kernel's output
      for (int i = 0; i < head; ++i) issue_x(i);
      for (int i = head; i < total; ++i) {
        mbarrier_wait(&empty[i % L::kStages], ((i / L::kStages) & 1) ^ 1);
        issue_w(i);
        issue_x(i);
      }
    }
    if (p.cluster > 1) {
      cluster_sync();  // the consumers' two (their partial tiles written; read)
      cluster_sync();
    }
    return;
  }

  // Consumers: one segment (a tile's k-blocks within our range) at a time.
  detail::wait_for_prerequisite_grid();  // y (accumulated into), the flags, and their readers
  const int g = lane / 4, t4 = lane % 4;
  const int tid = static_cast<int>(threadIdx.x);
  int i = 0;
  for (int64_t item = begin; item < end;) {
    const int tile_index = static_cast<int>(item / p.k_blocks);
    const int64_t tile_end = int64_t{tile_index + 1} * p.k_blocks;
    const int64_t segment_end = min(end, tile_end);
    const int count = static_cast<int>(segment_end - item);
    const bool owner = item % p.k_blocks == 0;
    const int tile_row0 = tile_index * kTileRows;
    float d[kTileRows / kMmaRows][kN / 8][4];
    for (int kb = 0; kb < count; ++kb, ++i) {
      const int s = i % L::kStages;
      mbarrier_wait(&full[s], (i / L::kStages) & 1);
      const uint32_t w_address = detail::smem_address(smem + s * L::kStageBytes);
      const uint64_t a = detail::wgmma_descriptor(w_address, 16, 8 * detail::kSwizzleRowBytes);
      const uint64_t b =
          detail::wgmma_descriptor(w_address + kWBoxBytes, 16, 8 * detail::kSwizzleRowBytes);
      detail::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 16; ++k) {
#pragma unroll
        for (int mb = 0; mb < kTileRows / kMmaRows; ++mb) {
          detail::wgmma_ss<T, kN>(d[mb],
                                  detail::wgmma_descriptor_advance(a, mb * kMmaRows * 128 + 32 * k),
                                  detail::wgmma_descriptor_advance(b, 32 * k), kb > 0 || k > 0);
        }
      }
      detail::wgmma_commit();
      // Free the stage at once (the MMAs are short): every stage but the one being read stays
      // in flight.
      detail::wgmma_wait<0>();
      if (lane == 0) detail::mbarrier_arrive(&empty[s]);
    }
#pragma unroll
    for (int mb = 0; mb < kTileRows / kMmaRows; ++mb) detail::wgmma_fence_operands(d[mb]);

    // Accumulator block c8 of wgmma mb holds weight rows 64 mb + 16 warp + g (+ 8) and x rows
    // 8 c8 + 2 t4 (+ 1). Pieces travel in this layout: float4 j of thread tid at j * 128 + tid.
    float4* const mine = reinterpret_cast<float4*>(d);
    if (p.cluster > 1) {
      // Our range is this one segment, so the ring is idle: each CTA puts its partial tile there,
      // and rank r sums a 1/cluster share of the float4s over the ranks in rank order.
      float4* staged = reinterpret_cast<float4*>(smem);
#pragma unroll
      for (int j = 0; j < kFragVecs; ++j) staged[j * kConsumerThreads + tid] = mine[j];
      cluster_sync();
      cg::cluster_group cluster = cg::this_cluster();
      const int rank = static_cast<int>(cluster.block_rank());
      constexpr int kVecs = kFragVecs * kConsumerThreads;
      const int share = (kVecs + p.cluster - 1) / p.cluster;
      for (int k = rank * share + tid; k < min(kVecs, (rank + 1) * share); k += kConsumerThreads) {
        float4 sum = cluster.map_shared_rank(staged, 0)[k];
        for (int q = 1; q < p.cluster; ++q) add4(sum, cluster.map_shared_rank(staged, q)[k]);
        // Float4 k is accumulator block j = k / 128 of thread k % 128 (layout above).
        const int j = k / kConsumerThreads, owner_tid = k % kConsumerThreads;
        const int mb = j / (kN / 8), c8 = j % (kN / 8);
        const int owner_lane = owner_tid % 32;
        const float v[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = c8 * 8 + 2 * (owner_lane % 4) + (e & 1);
          const int n =
              tile_row0 + mb * kMmaRows + (owner_tid / 32) * 16 + owner_lane / 4 + 8 * (e >> 1);
          if (m < p.rows && n < p.out) write_y<T>(p, int64_t{m} * p.out + n, v[e]);
        }
      }
      cluster_sync();  // every rank has read our partial tile
    } else if (!owner) {
      // Hand the piece to the tile's owner (a lower CTA).
      float4* slot = reinterpret_cast<float4*>(p.workspace + int64_t{cta} * kSlotFloats) + tid;
#pragma unroll
      for (int j = 0; j < kFragVecs; ++j) slot[j * kConsumerThreads] = mine[j];
      __threadfence();
      consumer_barrier();
      if (tid == 0) flag_release(&p.flags[cta]);
    } else {
      const int last = segment_end == tile_end ? cta : cta_of(p.items, ctas, tile_end - 1);
      if (last > cta) {
        // The other CTAs' pieces, added in CTA order.
        if (tid == 0) {
          for (int c = cta + 1; c <= last; ++c) flag_acquire(&p.flags[c]);
        }
        consumer_barrier();
        for (int c = cta + 1; c <= last; ++c) {
          const float4* slot =
              reinterpret_cast<const float4*>(p.workspace + int64_t{c} * kSlotFloats) + tid;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float4 piece[kFragVecs / 2];
#pragma unroll
            for (int j = 0; j < kFragVecs / 2; ++j) {
              piece[j] = __ldcg(slot + (half * kFragVecs / 2 + j) * kConsumerThreads);
            }
#pragma unroll
            for (int j = 0; j < kFragVecs / 2; ++j) add4(mine[half * kFragVecs / 2 + j], piece[j]);
          }
        }
        consumer_barrier();
        if (tid == 0) {
          for (int c = cta + 1; c <= last; ++c) p.flags[c] = 0;  // for the next launch
        }
      }
      if (p.swiglu_width > 0) {
        // The gate (wgmma 0) and up (wgmma 1) values of one output sit in the same registers.
#pragma unroll
        for (int c8 = 0; c8 < kN / 8; ++c8) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = c8 * 8 + 2 * t4 + (e & 1);
            const int n = tile_index * kMmaRows + warp * 16 + g + 8 * (e >> 1);
            const float gate = d[0][c8][e];
            if (m < p.rows && n < p.out) {
              write_y<T>(p, int64_t{m} * p.out + n, gate / (1.0f + __expf(-gate)) * d[1][c8][e]);
            }
          }
        }
      } else {
#pragma unroll
        for (int mb = 0; mb < kTileRows / kMmaRows; ++mb) {
#pragma unroll
          for (int c8 = 0; c8 < kN / 8; ++c8) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = c8 * 8 + 2 * t4 + (e & 1);
              const int n = tile_row0 + mb * kMmaRows + warp * 16 + g + 8 * (e >> 1);
              if (m < p.rows && n < p.out) write_y<T>(p, int64_t{m} * p.out + n, d[mb][c8][e]);
            }
          }
        }
      }
    }
    item = segment_end;
  }
#else
  (void)w_map;
  (void)x_map;
  (void)p;
  __trap();  // built without sm_90a: skinny_gemm_available() is false
#endif
}

template <typename T, int kN>
auto kernel_of() {
  return skinny_gemm_kernel<T, kN>;
}

// Raises the kernel's dynamic shared-memory limit (once per instantiation and device).
template <typename T, int kN>
void prepare() {
  static PerDevice<bool> prepared;
  prepared.get([] {
    DEFT_CUDA_CHECK(cudaFuncSetAttribute(
        kernel_of<T, kN>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<kN>::kBytes));
    return true;
  });
}

// The handed-over pieces and their flags for the largest grid, one set per (device, stream):
// launches on one stream are ordered, launches on different streams (two runners) never share.
struct Workspace {
  int device = -1;
  cudaStream_t stream = nullptr;
  float* pieces = nullptr;
  uint32_t* flags = nullptr;
};

std::mutex workspaces_mutex;
std::vector<Workspace> workspaces;  // guarded by workspaces_mutex

// Created on the stream's first use, which must not be inside a graph capture of `stream`.
Workspace workspace(cudaStream_t stream) {
  int device = 0;
  DEFT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(workspaces_mutex);
  for (const Workspace& w : workspaces) {
    if (w.device == device && w.stream == stream) return w;
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (stream != nullptr) DEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  DEFT_CHECK(capturing == cudaStreamCaptureStatusNone,
             "launch_skinny_gemm: call skinny_gemm_reserve(stream) before capturing a graph");
  const size_t ctas = static_cast<size_t>(kCtasPerSm) * current_device_sm_count();
  Workspace w{.device = device, .stream = stream};
  DEFT_CUDA_CHECK(cudaMalloc(&w.pieces, ctas * kSlotFloats * sizeof(float)));
  DEFT_CUDA_CHECK(cudaMalloc(&w.flags, ctas * sizeof(uint32_t)));
  DEFT_CUDA_CHECK(cudaMemset(w.flags, 0, ctas * sizeof(uint32_t)));
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  workspaces.push_back(w);
  return w;
}

int tiles_of(const SkinnyGemmDims& dims) { return (dims.out + kTileRows - 1) / kTileRows; }
int k_blocks_of(const SkinnyGemmDims& dims) { return (dims.in + kBlockK - 1) / kBlockK; }

struct Grid {
  int ctas = 1;
  int cluster = 1;  // > 1: ctas = tiles x cluster, each tile's k-blocks split among one cluster
};

// The grid (bench/results/skinny_gemm-h100-notes.md has the sweep behind it): for many tiles two
// CTAs per SM sharing the items evenly; for at least one tile per SM a tile each (no partial
// sums); for fewer, each tile split among a cluster of up to 8 CTAs, about one CTA per SM.
// split_k > 0: tiles x split_k. At most two CTAs per SM, at least 4 k-blocks each.
Grid grid_for(int tiles, int k_blocks, int split_k) {
  const int64_t sms = current_device_sm_count();
  const int64_t items = int64_t{tiles} * k_blocks;
  int64_t split;
  if (split_k > 0) {
    split = split_k;
  } else if (tiles >= kCtasPerSm * sms) {
    split = 0;  // stream-K over two CTAs per SM
  } else if (tiles >= sms) {
    split = 1;
  } else {
    split = std::min<int64_t>(kMaxCluster, sms / tiles);
  }
  if (split > 0 && split <= kMaxCluster && split <= k_blocks / 4 &&
      tiles * split <= kCtasPerSm * sms) {
    return {static_cast<int>(tiles * split), static_cast<int>(split)};
  }
  int64_t ctas = split > 0 ? tiles * split : kCtasPerSm * sms;
  ctas = std::min<int64_t>(ctas, kCtasPerSm * sms);
  ctas = std::min<int64_t>(ctas, std::max<int64_t>(1, items / 4));
  return {static_cast<int>(std::max<int64_t>(1, ctas)), 1};
}

template <typename T, int kN>
void launch_pass(const Params& p, const void* x, const void* w, DType dtype, int ctas,
                 cudaStream_t stream) {
  // p.cluster > 1: the tile's CTAs form one cluster.
  prepare<T, kN>();
  const CUtensorMap w_map =
      p.swiglu_width > 0 ? swizzled_tile_map(w, int64_t{2} * p.swiglu_width, p.in, dtype, kMmaRows)
                         : swizzled_tile_map(w, p.out, p.in, dtype, kTileRows);
  const CUtensorMap x_map = swizzled_tile_map(x, p.rows, p.in, dtype, kN);
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = static_cast<unsigned>(p.cluster);
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = Layout<kN>::kBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = p.cluster > 1 ? 2 : 1;
  DEFT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel_of<T, kN>(), w_map, x_map, p));
  DEFT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_rows(const Params& p, const void* x, const void* w, DType dtype, int ctas,
                 cudaStream_t stream, bool batch_invariant) {
  if (p.rows <= 32 && !batch_invariant) {
    launch_pass<T, 32>(p, x, w, dtype, ctas, stream);
  } else {
    launch_pass<T, 64>(p, x, w, dtype, ctas, stream);
  }
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemmDims& dims, const void* x, const void* w) {
  return dims.rows >= 1 && dims.rows <= 2 * kSkinnyGemmMaxRows && dims.in > 0 && dims.out > 0 &&
         dims.in % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

bool skinny_gemm_available() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  static PerDevice<bool> available;  // a process may drive GPUs of different architectures
  return available.get([] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, kernel_of<__nv_bfloat16, 32>()) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion == 90;  // the sm_90a machine code is in the binary
  });
}

void skinny_gemm_reserve(cudaStream_t stream) {
  if (skinny_gemm_available()) workspace(stream);
}

void skinny_gemm_release(cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return;
  std::lock_guard<std::mutex> lock(workspaces_mutex);
  for (auto it = workspaces.begin(); it != workspaces.end(); ++it) {
    if (it->device == device && it->stream == stream) {
      DEFT_CUDA_CHECK(cudaFree(it->pieces));  // synchronises with the device's work
      DEFT_CUDA_CHECK(cudaFree(it->flags));
      workspaces.erase(it);
      return;
    }
  }
}

bool skinny_gemm_wide(const SkinnyGemmDims& dims) {
  return tiles_of(dims) >= current_device_sm_count();
}

int32_t skinny_gemm_ctas(const SkinnyGemmDims& dims, int32_t split_k) {
  return grid_for(tiles_of(dims), k_blocks_of(dims), split_k).ctas;
}

namespace {

// Both launchers' contract (a caller bug otherwise: they abort, naming what is wrong). The
// product must be skinny_gemm_supported, and the current device must run the sm_90a code.
void check_launchable(const char* what, const SkinnyGemmDims& dims, const void* x, const void* w) {
  DEFT_CHECK(skinny_gemm_supported(dims, x, w),
             "%s: unsupported product: rows %d (1..%d), in %d (> 0, a multiple of 8), out %d "
             "(> 0), x and w 16-byte aligned (%s, %s)",
             what, dims.rows, 2 * kSkinnyGemmMaxRows, dims.in, dims.out,
             reinterpret_cast<uintptr_t>(x) % 16 == 0 ? "yes" : "no",
             reinterpret_cast<uintptr_t>(w) % 16 == 0 ? "yes" : "no");
  DEFT_CHECK(skinny_gemm_available(),
             "%s: no skinny GEMM on the current device (it needs an sm_90 GPU and a build with "
             "sm_90a machine code; see skinny_gemm_available)",
             what);
}

// Both launchers: passes of up to kSkinnyGemmMaxRows rows over `tiles` tiles of w.
void launch_passes(const SkinnyGemmDims& dims, DType dtype, const void* x, const void* w, void* y,
                   bool y_fp32, bool accumulate, cudaStream_t stream, int tiles, const Grid& grid,
                   int32_t swiglu_width, bool batch_invariant) {
  const Workspace work = workspace(stream);
  const int k_blocks = k_blocks_of(dims);
  const int32_t out = swiglu_width > 0 ? swiglu_width : dims.out;
  const size_t y_bytes = y_fp32 ? 4 : 2;
  for (int32_t begin = 0; begin < dims.rows; begin += kSkinnyGemmMaxRows) {
    Params p{};
    const void* x_pass = static_cast<const char*>(x) + static_cast<size_t>(begin) * dims.in * 2;
    p.y = static_cast<char*>(y) + static_cast<size_t>(begin) * out * y_bytes;
    p.workspace = work.pieces;
    p.flags = work.flags;
    p.rows = std::min(kSkinnyGemmMaxRows, dims.rows - begin);
    p.in = dims.in;
    p.out = out;
    p.k_blocks = k_blocks;
    p.items = int64_t{tiles} * k_blocks;
    p.cluster = grid.cluster;
    p.y_fp32 = y_fp32;
    p.accumulate = accumulate;
    p.swiglu_width = swiglu_width;
    if (dtype == DType::kBf16) {
      launch_rows<__nv_bfloat16>(p, x_pass, w, dtype, grid.ctas, stream, batch_invariant);
    } else {
      launch_rows<__half>(p, x_pass, w, dtype, grid.ctas, stream, batch_invariant);
    }
  }
}

}  // namespace

void launch_skinny_gemm(const SkinnyGemmDims& dims, DType dtype, const void* x, const void* w,
                        void* y, bool y_fp32, bool accumulate, cudaStream_t stream, int32_t split_k,
                        bool batch_invariant) {
  check_launchable("launch_skinny_gemm", dims, x, w);
  const int tiles = tiles_of(dims);
  launch_passes(dims, dtype, x, w, y, y_fp32, accumulate, stream, tiles,
                grid_for(tiles, k_blocks_of(dims), split_k), /*swiglu_width=*/0, batch_invariant);
}

void launch_skinny_gemm_swiglu(int32_t rows, int32_t in, int32_t width, DType dtype, const void* x,
                               const void* w, void* out, cudaStream_t stream,
                               bool batch_invariant) {
  const SkinnyGemmDims dims{.rows = rows, .in = in, .out = 2 * width};
  DEFT_CHECK(width > 0, "launch_skinny_gemm_swiglu: width %d must be > 0", width);
  check_launchable("launch_skinny_gemm_swiglu", dims, x, w);
  // Tiles of 64 gate and 64 up rows; every tile's sum complete in one CTA (no K split over a
  // cluster: the pair of an output would sit in different CTAs' shares).
  const int tiles = (width + kMmaRows - 1) / kMmaRows;
  const int k_blocks = k_blocks_of(dims);
  Grid grid = grid_for(tiles, k_blocks, 0);
  if (grid.cluster > 1) grid = grid_for(tiles, k_blocks, 1);
  launch_passes(dims, dtype, x, w, out, /*y_fp32=*/false, /*accumulate=*/false, stream, tiles, grid,
                width, batch_invariant);
}

}  // namespace deft::kernels
