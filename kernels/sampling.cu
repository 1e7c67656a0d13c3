#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <iterator>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/l2_discard.cuh"
#include "kernels/philox.h"
#include "kernels/sampling.h"

namespace deft::kernels {

namespace {

namespace cg = cooperative_groups;

// A cluster of kSplit blocks per row: each block finds the most and least likely keys and the
// log-softmax sum of its share of the row, block rank 0 combines them (distributed shared
// memory) and does the rest alone (greedy rows need nothing more). One block per row spent ~40
// µs on 20 rows' first two passes on the H100 (20 SMs busy). 512 threads, at most 64 registers
// each: two blocks per SM, so 20-32 rows' clusters run in one wave (1024-thread blocks, one per
// SM, took two: 29.0 µs for 20 rows in the H100's decode step under ncu, 18.8 with 512). A
// 128256-logit row is 501 KiB; it stays in L2 across passes.
constexpr int kThreads = 512;
// Blocks per row: 8 (the portable cluster size) while rows x 8 blocks fit on the GPU at once,
// else 4 or 2 (fewer, longer blocks in one wave rather than two waves: 64 rows took 38.8 µs in
// two waves of 8 blocks a row in the H100's decode step).
constexpr int kRowSplits[] = {8, 4, 2};
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;  // radix-select bins per pass
// Histogram masses are summed as 64-bit fixed point (weights are in [0, 1]) with two native
// 32-bit shared atomics, carry detected from the low word's old value: fp64 shared atomics are
// CAS loops that serialise when a warp's tokens share a bin (1.7 ms for top-p over 20 rows of
// 128256, measured). Exact, order-independent sums of weights rounded to 2^-40 (at most
// 128256 x 2^-41 = 6e-8 off the double sum of a whole row).
constexpr double kMassScale = 0x1p40;

// Order-preserving fp32 bits (-0 folded into +0: the CPU compares logits with ==).
__device__ __forceinline__ uint32_t ordered_bits(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float from_ordered_bits(uint32_t ordered) {
  const uint32_t bits = (ordered & 0x80000000u) != 0 ? ordered & 0x7FFFFFFFu : ~ordered;
  return __uint_as_float(bits);
}

// Likelihood key: larger = more likely (logit descending, then token id ascending); unique.
__device__ __forceinline__ uint64_t likelihood_key(float logit, int32_t token) {
  return (static_cast<uint64_t>(ordered_bits(logit)) << 32) | (0xFFFFFFFFu - uint32_t(token));
}

__device__ __forceinline__ int32_t key_token(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

__device__ __forceinline__ float key_logit(uint64_t key) {
  return from_ordered_bits(static_cast<uint32_t>(key >> 32));
}

// float4 loads a thread has in flight in for_each_logit (64 greedy rows of 128256 logits: 32.7 µs
// with one at a time, 31.0 with four; H100).
constexpr int kLoadBatch = 4;

// Calls f(token, logit) for every logit of the row, coalesced (float4 when aligned), each
// thread's tokens in ascending order.
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* row, int32_t vocab_size, F&& f) {
  int32_t begin = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
    const int32_t quads = vocab_size / 4;
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const auto visit = [&](int32_t q, const float4& v) {
      f(4 * q, v.x);
      f(4 * q + 1, v.y);
      f(4 * q + 2, v.z);
      f(4 * q + 3, v.w);
    };
    int32_t q = threadIdx.x;
    for (; q + (kLoadBatch - 1) * kThreads < quads; q += kLoadBatch * kThreads) {
      float4 v[kLoadBatch];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) v[j] = row4[q + j * kThreads];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) visit(q + j * kThreads, v[j]);
    }
    for (; q < quads; q += kThreads) visit(q, row4[q]);
    begin = quads * 4;
  }
  for (int32_t i = begin + threadIdx.x; i < vocab_size; i += kThreads) f(i, row[i]);
}

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T value, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  return value;
}

// Block-wide reduction; every thread gets the result. `scratch` holds kWarps values.
template <typename T, typename Op>
__device__ T block_reduce(T value, Op op, T* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = warp_reduce(value, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = scratch[0];
  for (int w = 1; w < kWarps; ++w) value = op(value, scratch[w]);
  return value;
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};
struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// A block's share of the row: pass 1 and 2 results.
struct RowShare {
  uint64_t key_max, key_min;  // 0 / ~0 when the share is empty
  double sum;                 // sum of exp(logit - key_logit(key_max)); 0 when that is -inf
  int32_t bad;                // first non-finite logit's token, INT_MAX when none
};

struct SharedState {
  RowShare share;
  union {
    uint64_t u64[kWarps];
    double f64[kWarps];
    int32_t i32[kWarps];
  } reduce;
  uint32_t bin_count[kBins];
  uint32_t bin_mass_lo[kBins], bin_mass_hi[kBins];  // fixed-point mass, kMassScale units
  int32_t chosen_bin;
  uint32_t chosen_count;
  double chosen_above;
  uint64_t found_key;
  uint64_t top_keys[kSamplingMaxTopLogprobs];
  int32_t top_count;
};

// The likelihood key, within [lo, hi], at which the measure (1 per token, or the token's weight
// when kMass) summed over tokens in descending key order, starting from `above`, first reaches
// `needed`; the least likely key in range when it never does (rounding). Tokens outside
// [lo, hi] do not count. Radix-style: each pass cuts [lo, hi] into at most 256 bins, histograms
// the row into them and keeps the bin where the running measure crosses.
template <bool kMass>
__device__ uint64_t select_key(const float* row, const float* weights, int32_t vocab_size,
                               uint64_t lo, uint64_t hi, double needed, SharedState& sh) {
  double above = 0.0;
  while (lo != hi) {
    const uint64_t range = hi - lo;
    const int shift = range < kBins ? 0 : 64 - __clzll(static_cast<long long>(range)) - 8;
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      sh.bin_count[b] = 0;
      sh.bin_mass_lo[b] = 0;
      sh.bin_mass_hi[b] = 0;
    }
    __syncthreads();
    for_each_logit(row, vocab_size, [&](int32_t token, float logit) {
      const uint64_t key = likelihood_key(logit, token);
      if (key < lo || key > hi) return;
      const uint32_t bin = static_cast<uint32_t>((key - lo) >> shift);
      atomicAdd(&sh.bin_count[bin], 1u);
      if constexpr (kMass) {
        const auto fixed =
            static_cast<uint64_t>(static_cast<double>(weights[token]) * kMassScale + 0.5);
        const auto low = static_cast<uint32_t>(fixed);
        const uint32_t old = low != 0 ? atomicAdd(&sh.bin_mass_lo[bin], low) : 0u;
        const uint32_t high = static_cast<uint32_t>(fixed >> 32) + (old + low < old ? 1u : 0u);
        if (high != 0) atomicAdd(&sh.bin_mass_hi[bin], high);
      }
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds bins 255 - 8l ... 248 - 8l (most likely first).
      const int lane = threadIdx.x;
      double measure[8];
      double lane_total = 0.0;
      uint32_t nonempty = 0;
      for (int j = 0; j < 8; ++j) {
        const int b = kBins - 1 - 8 * lane - j;
        measure[j] =
            kMass ? static_cast<double>(uint64_t{sh.bin_mass_hi[b]} << 32 | sh.bin_mass_lo[b]) /
                        kMassScale
                  : static_cast<double>(sh.bin_count[b]);
        lane_total += measure[j];
        if (sh.bin_count[b] != 0) nonempty |= 1u << j;
      }
      double inclusive = lane_total;
      for (int offset = 1; offset < 32; offset *= 2) {
        const double other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      double exclusive = __shfl_up_sync(0xFFFFFFFFu, inclusive, 1);
      if (lane == 0) exclusive = 0.0;
      double running = above + exclusive;
      int crossing = -1;
      double before_crossing = 0.0;
      for (int j = 0; j < 8 && crossing < 0; ++j) {
        if (running + measure[j] >= needed && (nonempty >> j & 1u)) {
          crossing = j;
          before_crossing = running;
        }
        running += measure[j];
      }
      const uint32_t crossed = __ballot_sync(0xFFFFFFFFu, crossing >= 0);
      int winner;
      if (crossed != 0) {
        winner = __ffs(crossed) - 1;  // the most likely crossing bin
      } else {
        // Never reached: the least likely non-empty bin, all above it counted.
        winner = 31 - __clz(__ballot_sync(0xFFFFFFFFu, nonempty != 0));
        if (lane == winner) {
          crossing = 31 - __clz(nonempty);
          before_crossing = above + exclusive;
          for (int j = 0; j < crossing; ++j) before_crossing += measure[j];
        }
      }
      if (lane == winner) {
        const int b = kBins - 1 - 8 * lane - crossing;
        sh.chosen_bin = b;
        sh.chosen_count = sh.bin_count[b];
        sh.chosen_above = before_crossing;
      }
    }
    __syncthreads();
    const uint64_t bin_lo = lo + (static_cast<uint64_t>(sh.chosen_bin) << shift);
    const uint64_t width_minus_one = (uint64_t{1} << shift) - 1;
    hi = bin_lo + min(hi - bin_lo, width_minus_one);
    lo = bin_lo;
    above = sh.chosen_above;
    if (sh.chosen_count == 1 && lo != hi) {
      // One token left in range: find its key in one more pass.
      __syncthreads();
      for_each_logit(row, vocab_size, [&](int32_t token, float logit) {
        const uint64_t key = likelihood_key(logit, token);
        if (key >= lo && key <= hi) sh.found_key = key;
      });
      __syncthreads();
      const uint64_t found = sh.found_key;
      __syncthreads();
      return found;
    }
    __syncthreads();  // everyone has read sh.chosen_* before the next pass clears the bins
  }
  return lo;
}

template <int kSplit>
__global__ void __launch_bounds__(kThreads, 2)
    sample_rows_kernel(const SamplingDims dims, const float* __restrict__ logits,
                       const RowSamplingParams* __restrict__ params, float* __restrict__ workspace,
                       SampledRow* __restrict__ out, SampledTop* __restrict__ top,
                       bool drop_logits) {
  __shared__ SharedState sh;
  cg::cluster_group cluster = cg::this_cluster();
  const int32_t r = blockIdx.x / kSplit;
  const int32_t rank = static_cast<int32_t>(cluster.block_rank());
  const int32_t vocab = dims.vocab_size;
  const float* row = logits + static_cast<int64_t>(r) * dims.row_stride;
  const RowSamplingParams p = params[r];
  const bool greedy = p.temperature == 0.0f || p.top_k == 1;
  const bool wants_top = p.top_logprobs > 0 && top != nullptr;

  // Passes 1 and 2 over this block's share (a multiple of 4 tokens, so float4 alignment holds):
  // most and least likely keys, first non-finite logit, the sum relative to the share's max.
  {
    const int32_t share = (vocab + 4 * kSplit - 1) / (4 * kSplit) * 4;
    const int32_t begin = min(vocab, rank * share);
    const int32_t count = min(vocab, begin + share) - begin;
    // Per thread: the largest logit and its first token, the smallest and its last (the keys'
    // tie-breaks: a thread visits its tokens in ascending order), turned into likelihood keys
    // once (64-bit keys built and compared per logit: 31.0 µs for 64 greedy rows, with this and
    // the fp32 sum below 26.7; H100).
    float best = 0.0f, worst = 0.0f;
    int32_t best_at = -1, worst_at = -1;
    int32_t bad = INT_MAX;
    for_each_logit(row + begin, count, [&](int32_t i, float logit) {
      if (isnan(logit) || logit == INFINITY) bad = min(bad, begin + i);
      if (best_at < 0 || logit > best) {
        best = logit;
        best_at = i;
      }
      if (worst_at < 0 || logit <= worst) {
        worst = logit;
        worst_at = i;
      }
    });
    uint64_t key_max = best_at >= 0 ? likelihood_key(best, begin + best_at) : 0;
    uint64_t key_min = worst_at >= 0 ? likelihood_key(worst, begin + worst_at) : ~uint64_t{0};
    bad = block_reduce(bad, MinOp{}, sh.reduce.i32);
    key_max = block_reduce(key_max, MaxOp{}, sh.reduce.u64);
    key_min = block_reduce(key_min, MinOp{}, sh.reduce.u64);
    double sum = 0.0;
    const float share_max = key_max != 0 ? key_logit(key_max) : -INFINITY;
    if (bad == INT_MAX && share_max != -INFINITY) {
      // fp32 with a compensation term (Kahan): a thread's weights in [0, 1] (a few hundred at
      // most) sum to within a few ulp, without a conversion and a double add per logit.
      float partial = 0.0f, compensation = 0.0f;
      for_each_logit(row + begin, count, [&](int32_t, float logit) {
        const float term = expf(logit - share_max) - compensation;
        const float next = partial + term;
        compensation = (next - partial) - term;
        partial = next;
      });
      sum = block_reduce(static_cast<double>(partial), SumOp{}, sh.reduce.f64);
    }
    if (threadIdx.x == 0) sh.share = {key_max, key_min, sum, bad};
    // Nothing reads a greedy row's logits after passes 1 and 2 (rank 0 finishes from the shares'
    // keys and sums, and reads a logit only at the first non-finite one, whose share is kept).
    if (drop_logits && greedy && !wants_top && p.keep_logits == 0 && bad == INT_MAX) {
      __syncthreads();  // every thread's loads of the share are done
      detail::discard_l2_range(row + begin, int64_t{count} * sizeof(float), threadIdx.x, kThreads);
    }
  }
  cluster.sync();  // every share is written
  uint64_t key_max = 0, key_min = ~uint64_t{0};
  int32_t bad = INT_MAX;
  double share_sums[kSplit];
  float share_maxes[kSplit];
  if (rank == 0) {
#pragma unroll
    for (int b = 0; b < kSplit; ++b) {
      const RowShare other = *cluster.map_shared_rank(&sh.share, b);
      key_max = max(key_max, other.key_max);
      key_min = min(key_min, other.key_min);
      bad = min(bad, other.bad);
      share_sums[b] = other.sum;
      share_maxes[b] = other.key_max != 0 ? key_logit(other.key_max) : -INFINITY;
    }
  }
  cluster.sync();  // rank 0 has read the other blocks' shares: they may exit
  if (rank != 0) return;
  const float max_logit = key_logit(key_max);
  if (bad != INT_MAX || max_logit == -INFINITY) {
    if (threadIdx.x == 0) {
      SampledRow result;
      result.status = bad != INT_MAX ? kSampledNonFiniteLogit : kSampledNoFiniteLogit;
      result.error_token = bad != INT_MAX ? bad : -1;
      result.error_logit = bad != INT_MAX ? row[bad] : 0.0f;
      out[r] = result;
    }
    return;
  }

  // The raw log-softmax normaliser from the shares' sums.
  double raw_sum = 0.0;
#pragma unroll
  for (int b = 0; b < kSplit; ++b) {
    if (share_maxes[b] != -INFINITY) {
      raw_sum += share_sums[b] * exp(static_cast<double>(share_maxes[b]) - max_logit);
    }
  }
  const double log_normaliser = static_cast<double>(max_logit) + log(raw_sum);

  int32_t chosen = key_token(key_max);
  // A greedy row's chosen logit from its key (the row may be dropped from L2 by now).
  float chosen_logit = key_logit(key_max);
  if (!greedy) {
    // Weights as the CPU computes them: fp32 (logit - max) / T, exp rounded once to fp32.
    float* weights = workspace + static_cast<int64_t>(r) * vocab;
    for_each_logit(row, vocab, [&](int32_t token, float logit) {
      const float scaled = (logit - max_logit) / p.temperature;
      weights[token] = static_cast<float>(exp(static_cast<double>(scaled)));
    });
    __syncthreads();  // weights are read by other threads below

    uint64_t boundary = 0;  // keep keys >= boundary; 0 keeps every token
    if (p.top_k > 0 && p.top_k < vocab) {
      boundary = select_key<false>(row, weights, vocab, key_min, key_max,
                                   static_cast<double>(p.top_k), sh);
    }
    if (p.top_p < 1.0f) {
      const uint64_t floor_key = max(boundary, key_min);
      double candidate_mass = 0.0;
      for_each_logit(row, vocab, [&](int32_t token, float logit) {
        if (likelihood_key(logit, token) >= floor_key) {
          candidate_mass += static_cast<double>(weights[token]);
        }
      });
      candidate_mass = block_reduce(candidate_mass, SumOp{}, sh.reduce.f64);
      boundary = select_key<true>(row, weights, vocab, floor_key, key_max,
                                  static_cast<double>(p.top_p) * candidate_mass, sh);
    }

    // Inverse CDF in token-id order: each thread owns a contiguous run of ids.
    const int32_t per_thread = (vocab + kThreads - 1) / kThreads;
    const int32_t begin = min(vocab, static_cast<int32_t>(threadIdx.x) * per_thread);
    const int32_t end = min(vocab, begin + per_thread);
    const auto kept_weight = [&](int32_t token) -> float {
      return likelihood_key(row[token], token) >= boundary ? weights[token] : 0.0f;
    };
    double local_mass = 0.0;
    int32_t last_kept = -1;
    for (int32_t token = begin; token < end; ++token) {
      const float w = kept_weight(token);
      if (w != 0.0f) {
        local_mass += static_cast<double>(w);
        last_kept = token;
      }
    }
    // Exclusive scan of the runs' masses (warp shuffles, then the warp totals).
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    double inclusive = local_mass;
    for (int offset = 1; offset < 32; offset *= 2) {
      const double other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    __syncthreads();
    if (lane == 31) sh.reduce.f64[warp] = inclusive;
    __syncthreads();
    double warp_before = 0.0, kept_mass = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) warp_before += sh.reduce.f64[w];
      kept_mass += sh.reduce.f64[w];
    }
    double exclusive = __shfl_up_sync(0xFFFFFFFFu, inclusive, 1);
    if (lane == 0) exclusive = 0.0;
    const double before = warp_before + exclusive;
    const double target = philox_uniform(p.seed, p.step) * kept_mass;
    // The first run whose mass passes the target owns the token; its walk repeats the sum that
    // made local_mass, so it stops inside the run.
    const double needed_here = target - before;
    const int32_t crossing_thread = block_reduce(
        local_mass > needed_here && last_kept >= 0 ? static_cast<int32_t>(threadIdx.x) : INT_MAX,
        MinOp{}, sh.reduce.i32);
    const int32_t last_kept_row = block_reduce(last_kept, MaxOp{}, sh.reduce.i32);
    if (crossing_thread == INT_MAX) {
      chosen = last_kept_row;  // rounding at the top end: the last kept token
    } else {
      if (static_cast<int32_t>(threadIdx.x) == crossing_thread) {
        double cumulative = 0.0;
        int32_t pick = last_kept;
        for (int32_t token = begin; token < end; ++token) {
          const float w = kept_weight(token);
          if (w == 0.0f) continue;
          cumulative += static_cast<double>(w);
          if (cumulative > needed_here) {
            pick = token;
            break;
          }
        }
        sh.found_key = static_cast<uint64_t>(pick);
      }
      __syncthreads();
      chosen = static_cast<int32_t>(sh.found_key);
      __syncthreads();
    }
  }

  int32_t num_top = 0;
  if (wants_top) {
    num_top = min(p.top_logprobs, min(vocab, kSamplingMaxTopLogprobs));
    const uint64_t nth =
        select_key<false>(row, nullptr, vocab, key_min, key_max, static_cast<double>(num_top), sh);
    if (threadIdx.x == 0) sh.top_count = 0;
    __syncthreads();
    for_each_logit(row, vocab, [&](int32_t token, float logit) {
      const uint64_t key = likelihood_key(logit, token);
      if (key >= nth) sh.top_keys[atomicAdd(&sh.top_count, 1)] = key;
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 1; i < num_top; ++i) {  // insertion sort, most likely first
        const uint64_t key = sh.top_keys[i];
        int j = i;
        for (; j > 0 && sh.top_keys[j - 1] < key; --j) sh.top_keys[j] = sh.top_keys[j - 1];
        sh.top_keys[j] = key;
      }
      SampledTop* row_top = top + static_cast<int64_t>(r) * kSamplingMaxTopLogprobs;
      for (int i = 0; i < num_top; ++i) {
        const uint64_t key = sh.top_keys[i];
        row_top[i].token = key_token(key);
        row_top[i].logprob =
            static_cast<float>(static_cast<double>(key_logit(key)) - log_normaliser);
      }
    }
  }
  if (threadIdx.x == 0) {
    SampledRow result;
    result.token = chosen;
    if (!greedy) chosen_logit = row[chosen];
    result.logprob = static_cast<float>(static_cast<double>(chosen_logit) - log_normaliser);
    result.status = kSampledOk;
    result.num_top = num_top;
    out[r] = result;
  }
}

}  // namespace

size_t sampling_workspace_bytes(int32_t num_rows, int32_t vocab_size) {
  return sizeof(float) * static_cast<size_t>(num_rows) * static_cast<size_t>(vocab_size);
}

void launch_sample_rows(const SamplingDims& dims, const float* logits,
                        const RowSamplingParams* params, float* workspace, SampledRow* out,
                        SampledTop* top, cudaStream_t stream, bool drop_logits,
                        bool batch_invariant) {
  if (dims.num_rows <= 0) return;
  // Two blocks an SM (the kernel's launch bounds). Batch-invariant launches keep the widest
  // split, the one decode-sized steps (up to 33 rows on an H200) use anyway.
  const int64_t resident_blocks = int64_t{2} * current_device_sm_count();
  int split = kRowSplits[0];
  if (!batch_invariant) {
    split = kRowSplits[std::size(kRowSplits) - 1];
    for (int candidate : kRowSplits) {
      if (int64_t{dims.num_rows} * candidate <= resident_blocks) {
        split = candidate;
        break;
      }
    }
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(split);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(dims.num_rows * split));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  auto* kernel = split == 8   ? &sample_rows_kernel<8>
                 : split == 4 ? &sample_rows_kernel<4>
                              : &sample_rows_kernel<2>;
  DEFT_CUDA_CHECK(
      cudaLaunchKernelEx(&config, kernel, dims, logits, params, workspace, out, top, drop_logits));
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace deft::kernels
