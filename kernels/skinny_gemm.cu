// Skinny GEMM (kernels/skinny_gemm.h): y^T = w · x^T on tensor cores, so the weight rows fill
// the 16-row side of mma.sync m16n8k16 and the few x rows its 8-column side.
//
// Work: a CTA of 8 warps owns a slab of 128 weight rows (16 per warp) and one K slice; the
// split_k CTAs of a slab form one cluster. Each warp streams its 16 rows with 16-byte loads
// (L1 bypassed) straight into A fragments, kStages 32-wide K chunks in flight per thread; x is
// read through L1 (all 8 warps of a CTA read the same x chunk, so it is fetched from L2 once per
// CTA: x traffic / w traffic = rows / 128).
//
// No shared memory in the main loop: the dot product does not care in which order K is summed,
// so A and B use the same permutation of each 32-wide chunk. Thread (g, t) of the warp loads
// w[row g][8t, 8t+8) and w[row g+8][8t, 8t+8) (one uint4 each) and x[col g][8t, 8t+8); in mma
// k-step s, its logical k pairs {2t, 2t+1} and {2t+8, 2t+9} are the physical elements
// 8t + 4s + {0, 1} and 8t + 4s + {2, 3}, for A and B alike.
//
// Epilogue: accumulators go to shared memory ([cols][128 rows], padded); with split_k > 1 the
// cluster synchronises and CTA rank r sums a 1/split_k share of the tile over all ranks through
// distributed shared memory, in rank order (deterministic), adds y when accumulating and writes
// fp32 or 16-bit outputs.
#include "kernels/skinny_gemm.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/float_convert.cuh"

namespace deft::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kSlabRows = kWarps * 16;  // weight rows per CTA
constexpr int kChunk = 32;              // K elements per pipeline stage
constexpr int kTileStride = kSlabRows + 4;  // floats per column of the shared tile: no conflicts
constexpr int kMaxSplit = 8;            // portable cluster size

// Weights are read once: no L1 allocation, keep L1 for x.
__device__ __forceinline__ uint4 load_stream(const void* ptr, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr));
  }
  return v;
}

__device__ __forceinline__ uint4 load_cached(const void* ptr, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) v = __ldg(static_cast<const uint4*>(ptr));
  return v;
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

struct Params {
  const void* x;
  const void* w;
  void* y;
  int32_t rows, in, out;
  int32_t chunks;  // ceil(in / kChunk)
  bool y_fp32, accumulate;
};

// kCols: mma columns of 8 x rows (rows <= 8 * kCols); kStages: K chunks of w in flight per
// thread; kXDepth: chunks of x loaded ahead (x comes from L1/L2: its latency must not sit
// between a chunk's mma and the next w load). kStages % kXDepth == 0 (ring slots by stage).
template <typename T, int kCols, int kStages, int kXDepth>
__global__ void __launch_bounds__(kThreads, 2) skinny_gemm_kernel(const Params p) {
  static_assert(kStages % kXDepth == 0);
  extern __shared__ float tile[];  // [8 * kCols][kTileStride]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int split = gridDim.y, rank = blockIdx.y;
  const int slab_row = blockIdx.x * kSlabRows;
  const int row_lo = slab_row + warp * 16 + g, row_hi = row_lo + 8;
  const bool lo_ok = row_lo < p.out, hi_ok = row_hi < p.out;
  const int chunk_begin = static_cast<int>(static_cast<int64_t>(rank) * p.chunks / split);
  const int chunk_count =
      static_cast<int>(static_cast<int64_t>(rank + 1) * p.chunks / split) - chunk_begin;
  const int k_first = chunk_begin * kChunk + 8 * t;  // this thread's first element

  const T* w = static_cast<const T*>(p.w);
  const T* w_lo = w + static_cast<int64_t>(lo_ok ? row_lo : 0) * p.in + k_first;
  const T* w_hi = w + static_cast<int64_t>(hi_ok ? row_hi : 0) * p.in + k_first;
  // Column c of x is row 8c + g; rows past p.rows are read as zeros.
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(g) * p.in + k_first;
  const int64_t x_col_step = int64_t{8} * p.in;
  const int x_cols_ok = p.rows > g ? (p.rows - g + 7) / 8 : 0;  // columns c with 8c + g < rows

  float acc[kCols][4];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;

  const auto k_ok = [&](int chunk) {
    return chunk < chunk_count && k_first + chunk * kChunk < p.in;
  };
  uint4 a_lo[kStages], a_hi[kStages];
  uint4 b[kXDepth][kCols];
  const auto load_x = [&](uint4(&slot)[kCols], int chunk) {
    const bool ok = k_ok(chunk);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      slot[c] = load_cached(x + c * x_col_step + chunk * kChunk, ok && c < x_cols_ok);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    const bool ok = k_ok(s);
    a_lo[s] = load_stream(w_lo + s * kChunk, ok && lo_ok);
    a_hi[s] = load_stream(w_hi + s * kChunk, ok && hi_ok);
  }
#pragma unroll
  for (int d = 0; d < kXDepth; ++d) load_x(b[d], d);
  for (int base = 0; base < chunk_count; base += kStages) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const int chunk = base + s;
      uint4(&bx)[kCols] = b[s % kXDepth];
      if (chunk < chunk_count) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          mma_16816<T>(acc[c], a_lo[s].x, a_hi[s].x, a_lo[s].y, a_hi[s].y, bx[c].x, bx[c].y);
          mma_16816<T>(acc[c], a_lo[s].z, a_hi[s].z, a_lo[s].w, a_hi[s].w, bx[c].z, bx[c].w);
        }
      }
      const int next = chunk + kStages;
      const bool ok = k_ok(next);
      a_lo[s] = load_stream(w_lo + next * kChunk, ok && lo_ok);
      a_hi[s] = load_stream(w_hi + next * kChunk, ok && hi_ok);
      load_x(bx, chunk + kXDepth);
    }
  }

  // C fragment: rows g / g + 8 of the warp's 16, columns 2t, 2t + 1 of each 8.
  const int r = warp * 16 + g;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int m = c * 8 + 2 * t;
    tile[m * kTileStride + r] = acc[c][0];
    tile[(m + 1) * kTileStride + r] = acc[c][1];
    tile[m * kTileStride + r + 8] = acc[c][2];
    tile[(m + 1) * kTileStride + r + 8] = acc[c][3];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (split > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  const int elements = p.rows * kSlabRows;
  const int share = (elements + split - 1) / split;
  const int end = min(elements, (rank + 1) * share);
  for (int i = rank * share + static_cast<int>(threadIdx.x); i < end; i += kThreads) {
    const int m = i / kSlabRows, rr = i % kSlabRows, n = slab_row + rr;
    if (n >= p.out) continue;
    float sum = 0.0f;
    for (int q = 0; q < split; ++q) {
      const float* part = split > 1 ? cluster.map_shared_rank(tile, q) : tile;
      sum += part[m * kTileStride + rr];
    }
    const int64_t at = static_cast<int64_t>(m) * p.out + n;
    if (p.y_fp32) {
      float* y = static_cast<float*>(p.y);
      y[at] = p.accumulate ? y[at] + sum : sum;
    } else {
      T* y = static_cast<T*>(p.y);
      y[at] = from_float<T>(p.accumulate ? to_float(y[at]) + sum : sum);
    }
  }
  // No CTA may leave while others still read its shared memory.
  if (split > 1) cluster.sync();
}

int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    DEFT_CUDA_CHECK(cudaGetDevice(&device));
    DEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

template <typename T, int kCols>
void launch_cols(const Params& p, int split, cudaStream_t stream) {
  // Registers (2 CTAs of 256 threads per SM: 128 a thread) hold kCols * 4 accumulators,
  // kStages * 8 words of w in flight and kXDepth * kCols * 4 words of x.
  // (ptxas -v: no spills with these).
  constexpr int kStages = kCols <= 2 ? 8 : kCols == 4 ? 6 : 4;
  constexpr int kXDepth = kCols == 1 ? 4 : kCols <= 4 ? 2 : 1;
  const auto kernel = skinny_gemm_kernel<T, kCols, kStages, kXDepth>;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((p.out + kSlabRows - 1) / kSlabRows, split, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = sizeof(float) * 8 * kCols * kTileStride;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = split;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  DEFT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  DEFT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_pass(const Params& p, int split, cudaStream_t stream) {
  const int cols = (p.rows + 7) / 8;
  switch (cols) {
    case 1: return launch_cols<T, 1>(p, split, stream);
    case 2: return launch_cols<T, 2>(p, split, stream);
    case 3: return launch_cols<T, 3>(p, split, stream);
    case 4: return launch_cols<T, 4>(p, split, stream);
    case 5:
    case 6: return launch_cols<T, 6>(p, split, stream);
    default: return launch_cols<T, 8>(p, split, stream);
  }
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemmDims& dims, const void* x, const void* w) {
  return dims.rows >= 1 && dims.rows <= 2 * kSkinnyGemmMaxRows && dims.in > 0 && dims.out > 0 &&
         dims.in % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

int32_t skinny_gemm_auto_split(const SkinnyGemmDims& dims) {
  // About 1.5 CTAs per SM, clusters of at most 6 (bench/results/skinny_gemm-h100-*.json sweep:
  // QKV and O shapes were fastest at 192 CTAs, clusters of 8 were slow), K slices of at least
  // 8 chunks (256 elements) so the pipeline fills.
  const int slabs = (dims.out + kSlabRows - 1) / kSlabRows;
  const int chunks = (dims.in + kChunk - 1) / kChunk;
  int split = (3 * sm_count() / 2 + slabs / 2) / slabs;
  split = std::min(split, std::max(1, chunks / 8));
  return std::clamp(split, 1, 6);
}

void launch_skinny_gemm(const SkinnyGemmDims& dims, DType dtype, const void* x, const void* w,
                        void* y, bool y_fp32, bool accumulate, cudaStream_t stream,
                        int32_t split_k) {
  if (!skinny_gemm_supported(dims, x, w)) {
    std::fprintf(stderr, "launch_skinny_gemm: unsupported product rows %d in %d out %d\n",
                 dims.rows, dims.in, dims.out);
    std::abort();
  }
  const int split = split_k > 0 ? std::min<int>(split_k, kMaxSplit) : skinny_gemm_auto_split(dims);
  const size_t y_bytes = y_fp32 ? 4 : 2;
  for (int32_t begin = 0; begin < dims.rows; begin += kSkinnyGemmMaxRows) {
    Params p{};
    p.x = static_cast<const char*>(x) + static_cast<size_t>(begin) * dims.in * 2;
    p.w = w;
    p.y = static_cast<char*>(y) + static_cast<size_t>(begin) * dims.out * y_bytes;
    p.rows = std::min(kSkinnyGemmMaxRows, dims.rows - begin);
    p.in = dims.in;
    p.out = dims.out;
    p.chunks = (dims.in + kChunk - 1) / kChunk;
    p.y_fp32 = y_fp32;
    p.accumulate = accumulate;
    if (dtype == DType::kBf16) {
      launch_pass<__nv_bfloat16>(p, split, stream);
    } else {
      launch_pass<__half>(p, split, stream);
    }
  }
}

}  // namespace deft::kernels
