// Prefill attention kernels (templates; included only by kernels/prefill_attention.cu, which
// instantiates bf16/fp16 x head_dim 64/128). Shares the element traits and PTX helpers of
// kernels/deft_attention.cuh.
//
// Main kernel: one CTA (4 warps, 64 rows) per (Q tile of a run, KV head, KV split). Row r of a
// tile is token (row0 + r) / group of the run, query head kv_head * group + (row0 + r) % group,
// so a KV tile in shared memory serves every query head of its KV head. The CTA walks the KV
// tiles its rows see (64 keys each: the run's prefix, then its own tokens up to the tile's last
// token), gathered through kv_slots with cp.async into a double-buffered padded ring; every warp
// computes S = Q K^T for its 16 rows x 64 keys and O += P V with mma.sync m16n8k16, online
// softmax in base 2. Keys below the warp's first token's limit are visible to all its rows: the
// per-element causal test runs only on the diagonal tiles. With one split the CTA writes the
// normalised output rows; with several it writes partial O and LSE that the merge kernel
// combines.
#pragma once

#include "kernels/deft_attention_common.cuh"

namespace deft::kernels::detail {

inline constexpr int kPrefillWarps = 4;
inline constexpr int kPrefillThreads = kPrefillWarps * 32;
inline constexpr int kPrefillRows = kPrefillWarps * kMmaRows;  // Q tile rows per CTA
inline constexpr int kPrefillMergeWarps = 4;

template <int kHeadDim>
struct PrefillSmem {
  static constexpr int kRowElems = kHeadDim + 8;  // +16 bytes: conflict-free ldmatrix rows
  static constexpr int kTileBytes = kKvTileTokens * kRowElems * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
  static constexpr int kBytes = 2 * kStageBytes;
};

struct PrefillParams {
  const PrefillRun* runs;  // device
  int32_t num_runs;
  const int32_t* kv_slots;  // device
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* scratch;  // split-KV partials: [split][prefill row][head] x (head_dim O, then 1 LSE)
  int32_t prefill_rows;
  int32_t kv_splits;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t group_size;
  float scale_log2;  // softmax_scale * log2(e)
};

// Partial layout of the split path: O rows first, LSEs after them.
__device__ __forceinline__ int64_t prefill_partial_row(const PrefillParams& p, int split,
                                                       int prefill_row, int head) {
  return (static_cast<int64_t>(split) * p.prefill_rows + prefill_row) * p.num_q_heads + head;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kPrefillThreads, 3)
    prefill_attention_kernel(const __grid_constant__ PrefillParams params) {
  using Smem = PrefillSmem<kHeadDim>;
  using Traits = ElemTraits<T>;
  constexpr int kKSteps = kHeadDim / 16;
  constexpr int kOBlocks = kHeadDim / 8;
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kBlocks = kKvTileTokens / 8;  // n-blocks of S per tile

  extern __shared__ __align__(16) unsigned char smem[];

  const int group = params.group_size;
  // Which run and Q tile: tiles of a run in order of decreasing work (the last tiles see the
  // most keys), so the long CTAs start first.
  int tile_index = blockIdx.x;
  int run = 0;
  int run_tiles = 0;
  int prefill_row_base = 0;
  for (; run < params.num_runs; ++run) {
    run_tiles = (params.runs[run].num_rows * group + kPrefillRows - 1) / kPrefillRows;
    if (tile_index < run_tiles) break;
    tile_index -= run_tiles;
    prefill_row_base += params.runs[run].num_rows;
  }
  if (run == params.num_runs) return;
  const PrefillRun r = params.runs[run];
  const int local_tile = run_tiles - 1 - tile_index;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_row = lane / 4;
  const int lane_col = lane % 4;

  const int total_rows = r.num_rows * group;
  const int row0 = local_tile * kPrefillRows;
  const int cta_rows = min(kPrefillRows, total_rows - row0);
  const int last_token = (row0 + cta_rows - 1) / group;
  const int key_end = r.prefix_tokens + last_token + 1;  // keys the CTA's rows see: [0, key_end)
  const int cta_tiles = (key_end + kKvTileTokens - 1) / kKvTileTokens;
  // This split's key tiles (splits cut the run's longest key range evenly).
  const int run_key_tiles = (r.prefix_tokens + r.num_rows + kKvTileTokens - 1) / kKvTileTokens;
  const int tiles_per_split = (run_key_tiles + params.kv_splits - 1) / params.kv_splits;
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min(cta_tiles, tile_begin + tiles_per_split);
  const int* slots = params.kv_slots + r.kv_begin;

  // This warp's rows; rows past the tile see nothing and are never written.
  const int warp_row0 = warp * kMmaRows;
  const bool warp_has_rows = warp_row0 < cta_rows;
  const int row_a = warp_row0 + lane_row;  // within the tile
  const int row_b = row_a + 8;
  const bool row_a_valid = row_a < cta_rows;
  const bool row_b_valid = row_b < cta_rows;
  const int token_a = (row0 + row_a) / group;
  const int token_b = (row0 + row_b) / group;
  const int limit_a = row_a_valid ? r.prefix_tokens + token_a + 1 : 0;  // keys [0, limit)
  const int limit_b = row_b_valid ? r.prefix_tokens + token_b + 1 : 0;
  // Keys below warp_full_end are visible to every row of the warp; none at or past warp_key_end.
  const int warp_first_token = (row0 + min(warp_row0, cta_rows - 1)) / group;
  const int warp_last_token = (row0 + min(warp_row0 + kMmaRows, cta_rows) - 1) / group;
  const int warp_full_end = r.prefix_tokens + warp_first_token + 1;
  const int warp_key_end = r.prefix_tokens + warp_last_token + 1;

  const T* q = static_cast<const T*>(params.q);
  const T* k_cache = static_cast<const T*>(params.k_cache);
  const T* v_cache = static_cast<const T*>(params.v_cache);
  const int q_row_stride = params.num_q_heads * kHeadDim;

  constexpr int kTokenStride = kPrefillThreads / kChunksPerRow;
  constexpr int kSlotsPerThread = kKvTileTokens / kTokenStride;
  static_assert(kKvTileTokens % kTokenStride == 0, "tile rows per thread");
  auto load_tile = [&](int tile, int stage) {
    unsigned char* k_tile = smem + stage * Smem::kStageBytes;
    unsigned char* v_tile = k_tile + Smem::kTileBytes;
    const int token0 = tile * kKvTileTokens;
    const int part = threadIdx.x % kChunksPerRow;
    const int first_token = threadIdx.x / kChunksPerRow;
    int slot[kSlotsPerThread];
#pragma unroll
    for (int i = 0; i < kSlotsPerThread; ++i) {
      const int key = token0 + first_token + i * kTokenStride;
      slot[i] = key < key_end ? __ldg(slots + key) : 0;
    }
#pragma unroll
    for (int i = 0; i < kSlotsPerThread; ++i) {
      const int token = first_token + i * kTokenStride;
      const bool valid = token0 + token < key_end;
      const int64_t offset =
          (static_cast<int64_t>(slot[i]) * params.num_kv_heads + kv_head) * kHeadDim + part * 8;
      const int smem_offset = (token * Smem::kRowElems + part * 8) * 2;
      cp_async_16(smem_address(k_tile + smem_offset), k_cache + offset, valid);
      cp_async_16(smem_address(v_tile + smem_offset), v_cache + offset, valid);
    }
  };

  int stage = 0;
  if (tile_begin < tile_end) load_tile(tile_begin, stage);
  cp_async_commit();

  uint32_t q_frag[kKSteps][4];
  {
    const int head_a = kv_head * group + (row0 + row_a) % group;
    const int head_b = kv_head * group + (row0 + row_b) % group;
    const T* q_row_a =
        q + static_cast<int64_t>(r.row_begin + (row_a_valid ? token_a : 0)) * q_row_stride +
        head_a * kHeadDim;
    const T* q_row_b =
        q + static_cast<int64_t>(r.row_begin + (row_b_valid ? token_b : 0)) * q_row_stride +
        head_b * kHeadDim;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int col = kk * 16 + 2 * lane_col;
      q_frag[kk][0] = row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col) : 0u;
      q_frag[kk][1] = row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col) : 0u;
      q_frag[kk][2] = row_a_valid ? *reinterpret_cast<const uint32_t*>(q_row_a + col + 8) : 0u;
      q_frag[kk][3] = row_b_valid ? *reinterpret_cast<const uint32_t*>(q_row_b + col + 8) : 0u;
    }
  }

  float o_acc[kOBlocks][4];
#pragma unroll
  for (int nb = 0; nb < kOBlocks; ++nb) {
    o_acc[nb][0] = o_acc[nb][1] = o_acc[nb][2] = o_acc[nb][3] = 0.0f;
  }
  float max_a = kNegInf, max_b = kNegInf;
  float sum_a = 0.0f, sum_b = 0.0f;
  const int matrix = lane / 8;
  const int matrix_row = lane % 8;

  auto compute_tile = [&](int stage_index, int token0, bool causal) {
    const unsigned char* k_tile = smem + stage_index * Smem::kStageBytes;
    const unsigned char* v_tile = k_tile + Smem::kTileBytes;
    float scores[kBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb) {
      scores[nb][0] = scores[nb][1] = scores[nb][2] = scores[nb][3] = 0.0f;
    }
#pragma unroll
    for (int pair = 0; pair < kBlocks / 2; ++pair) {
      const int token = pair * 16 + (matrix >> 1) * 8 + matrix_row;
      const uint32_t row_address =
          smem_address(k_tile + token * Smem::kRowElems * 2) + (matrix & 1) * 8 * 2;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t k_frag[4];
        ldmatrix_x4(k_frag, row_address + kk * 16 * 2);
        Traits::mma(scores[2 * pair], q_frag[kk], k_frag[0], k_frag[1]);
        Traits::mma(scores[2 * pair + 1], q_frag[kk], k_frag[2], k_frag[3]);
      }
    }
    if (causal) {
#pragma unroll
      for (int nb = 0; nb < kBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = token0 + nb * 8 + 2 * lane_col + (e & 1);
          if (key >= (e < 2 ? limit_a : limit_b)) scores[nb][e] = kNegInf;
        }
      }
    }
    online_softmax_step(scores, o_acc, params.scale_log2, max_a, max_b, sum_a, sum_b);
#pragma unroll
    for (int pair = 0; pair < kBlocks / 2; ++pair) {
      const uint32_t p_frag[4] = {Traits::pack(scores[2 * pair][0], scores[2 * pair][1]),
                                  Traits::pack(scores[2 * pair][2], scores[2 * pair][3]),
                                  Traits::pack(scores[2 * pair + 1][0], scores[2 * pair + 1][1]),
                                  Traits::pack(scores[2 * pair + 1][2], scores[2 * pair + 1][3])};
      const int token = pair * 16 + (matrix & 1) * 8 + matrix_row;
      const uint32_t row_address =
          smem_address(v_tile + token * Smem::kRowElems * 2) + (matrix >> 1) * 8 * 2;
#pragma unroll
      for (int nb2 = 0; nb2 < kHeadDim / 16; ++nb2) {
        uint32_t v_frag[4];
        ldmatrix_x4_trans(v_frag, row_address + nb2 * 16 * 2);
        Traits::mma(o_acc[2 * nb2], p_frag, v_frag[0], v_frag[1]);
        Traits::mma(o_acc[2 * nb2 + 1], p_frag, v_frag[2], v_frag[3]);
      }
    }
  };

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    if (tile + 1 < tile_end) load_tile(tile + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int token0 = tile * kKvTileTokens;
    if (warp_has_rows && token0 < warp_key_end) {
      // Tiles wholly below the warp's first row's limit need no causal test (tail keys past
      // key_end are past every limit, so they fall in the causal case too).
      compute_tile(stage, token0, token0 + kKvTileTokens > warp_full_end);
    }
    __syncthreads();
    stage ^= 1;
  }
  cp_async_wait<0>();

  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
  const float inv_a = sum_a > 0.0f ? 1.0f / sum_a : 0.0f;
  const float inv_b = sum_b > 0.0f ? 1.0f / sum_b : 0.0f;
  const int head_a = kv_head * group + (row0 + row_a) % group;
  const int head_b = kv_head * group + (row0 + row_b) % group;
  if (params.kv_splits == 1) {
    T* out = static_cast<T*>(params.out);
    T* out_a = out + static_cast<int64_t>(r.row_begin + token_a) * q_row_stride + head_a * kHeadDim;
    T* out_b = out + static_cast<int64_t>(r.row_begin + token_b) * q_row_stride + head_b * kHeadDim;
#pragma unroll
    for (int nb = 0; nb < kOBlocks; ++nb) {
      const int col = nb * 8 + 2 * lane_col;
      if (row_a_valid) {
        *reinterpret_cast<uint32_t*>(out_a + col) =
            Traits::pack(o_acc[nb][0] * inv_a, o_acc[nb][1] * inv_a);
      }
      if (row_b_valid) {
        *reinterpret_cast<uint32_t*>(out_b + col) =
            Traits::pack(o_acc[nb][2] * inv_b, o_acc[nb][3] * inv_b);
      }
    }
    return;
  }
  // Split path: normalised partial O and natural-log LSE (-inf where the split saw nothing).
  float* partial_o = params.scratch;
  float* partial_lse =
      params.scratch + static_cast<int64_t>(params.kv_splits) * params.prefill_rows *
                           params.num_q_heads * kHeadDim;
  const int64_t prow_a = prefill_partial_row(params, split, prefill_row_base + token_a, head_a);
  const int64_t prow_b = prefill_partial_row(params, split, prefill_row_base + token_b, head_b);
#pragma unroll
  for (int nb = 0; nb < kOBlocks; ++nb) {
    const int col = nb * 8 + 2 * lane_col;
    if (row_a_valid) {
      *reinterpret_cast<float2*>(partial_o + prow_a * kHeadDim + col) =
          make_float2(o_acc[nb][0] * inv_a, o_acc[nb][1] * inv_a);
    }
    if (row_b_valid) {
      *reinterpret_cast<float2*>(partial_o + prow_b * kHeadDim + col) =
          make_float2(o_acc[nb][2] * inv_b, o_acc[nb][3] * inv_b);
    }
  }
  if (lane_col == 0) {
    constexpr float kLn2 = 0.69314718055994531f;
    if (row_a_valid) partial_lse[prow_a] = sum_a > 0.0f ? (max_a + log2f(sum_a)) * kLn2 : kNegInf;
    if (row_b_valid) partial_lse[prow_b] = sum_b > 0.0f ? (max_b + log2f(sum_b)) * kLn2 : kNegInf;
  }
}

// Merge of the split path: one warp per (prefill row, head), kPrefillMergeWarps heads per CTA.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kPrefillMergeWarps * 32)
    prefill_attention_merge_kernel(const __grid_constant__ PrefillParams params) {
  constexpr int kPerLane = kHeadDim / 32;
  const int prefill_row = blockIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * kPrefillMergeWarps + warp;
  if (head >= params.num_q_heads) return;
  int query = -1;
  for (int run = 0, base = 0; run < params.num_runs; ++run) {
    const int rows = params.runs[run].num_rows;
    if (prefill_row < base + rows) {
      query = params.runs[run].row_begin + (prefill_row - base);
      break;
    }
    base += rows;
  }
  if (query < 0) return;
  const float* partial_o = params.scratch;
  const float* partial_lse =
      params.scratch + static_cast<int64_t>(params.kv_splits) * params.prefill_rows *
                           params.num_q_heads * kHeadDim;
  float lse_max = kNegInf;
  for (int s = 0; s < params.kv_splits; ++s) {
    lse_max = fmaxf(lse_max, partial_lse[prefill_partial_row(params, s, prefill_row, head)]);
  }
  const float base = lse_max == kNegInf ? 0.0f : lse_max;
  float acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = 0.0f;
  float denom = 0.0f;
  for (int s = 0; s < params.kv_splits; ++s) {
    const int64_t row = prefill_partial_row(params, s, prefill_row, head);
    const float weight = expf(partial_lse[row] - base);
    if (weight == 0.0f) continue;  // an empty split: its O may be anything finite (zeros)
    denom += weight;
    const float* o = partial_o + row * kHeadDim + lane * kPerLane;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] += weight * o[j];
  }
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  T* out = static_cast<T*>(params.out) +
           (static_cast<int64_t>(query) * params.num_q_heads + head) * kHeadDim + lane * kPerLane;
#pragma unroll
  for (int j = 0; j < kPerLane; j += 2) {
    *reinterpret_cast<uint32_t*>(out + j) = ElemTraits<T>::pack(acc[j] * inv, acc[j + 1] * inv);
  }
}

}  // namespace deft::kernels::detail
