// Token sampling on the GPU: a cluster of blocks per fp32 logits row picks the row's token (greedy,
// temperature, top-k, top-p, seeded), the raw log-probability of that token and, when asked,
// the n most likely tokens with theirs, so only a few bytes per row go back to the host.
//
// The contract is engine::Sampler's (engine/sampler.h; that is this kernel's CPU twin, kernels/
// may not include it): likelihood order is logit descending then token id ascending; greedy
// (temperature 0 or top_k 1) takes the argmax; otherwise weights exp((logit - max) / T) (fp32,
// rounded once from a double exp, as glibc's expf rounds), top-k keeps the k most likely, top-p
// then the smallest most-likely prefix of those reaching top_p of their mass, and the token is
// the inverse CDF, in token-id order over the kept tokens, of the uniform
// philox_uniform(seed, step) (kernels/philox.h) times the kept mass. The inverse CDF sums in
// double, in another order than the CPU's; top-p's select sums weights rounded to 2^-40 (fixed
// point, see sampling.cu). So a token can differ from engine::Sampler's only where the uniform's
// target (or top-p's needed mass) lies within that rounding of a cumulative-mass boundary.
//
// Selection without a sort: a radix-style select over the 64-bit likelihood key
// (order-preserving logit bits << 32 | ~token id), 256 bins a pass over the row, each pass
// narrowing the key range to the bin where the running count (top-k, top-n) or mass (top-p)
// reaches the target; a few passes over an L2-resident row.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deft::kernels {

// Most top logprobs one row may ask for (engine::kMaxTopLogprobs).
inline constexpr int32_t kSamplingMaxTopLogprobs = 20;

// Per row, plain data uploaded with the step. Validated by the caller (engine's
// validate_sampling_params): temperature >= 0 finite, top_k >= 0, top_p in (0, 1],
// top_logprobs in [0, kSamplingMaxTopLogprobs].
struct RowSamplingParams {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  int32_t top_logprobs = 0;
  uint64_t seed = 0;
  uint64_t step = 0;
  // 1: the caller reads this row's logits after sampling (drop_logits spares it).
  int32_t keep_logits = 0;
};

enum SampledRowStatus : int32_t {
  kSampledOk = 0,
  kSampledNonFiniteLogit = 1,  // a NaN or +inf logit: error_token, error_logit say the first
  kSampledNoFiniteLogit = 2,   // every logit is -inf
};

struct SampledRow {
  int32_t token = -1;
  float logprob = 0.0f;  // log softmax of the raw logits
  int32_t status = kSampledOk;
  int32_t error_token = -1;
  float error_logit = 0.0f;
  int32_t num_top = 0;  // entries written to this row's top list
};

struct SampledTop {
  int32_t token = -1;
  float logprob = 0.0f;
};

struct SamplingDims {
  int32_t num_rows = 0;
  int32_t vocab_size = 0;
  int64_t row_stride = 0;  // floats between rows of `logits`
};

// Scratch the launch needs for rows that sample (temperature > 0, top_k != 1): one fp32
// weight per logit.
size_t sampling_workspace_bytes(int32_t num_rows, int32_t vocab_size);

// logits: [num_rows][row_stride] fp32 on the device; params: [num_rows]; workspace:
// sampling_workspace_bytes(num_rows, vocab_size) bytes (may be null when no row samples);
// out: [num_rows]; top: [num_rows][kSamplingMaxTopLogprobs], most likely first (may be null when
// no row asks for top logprobs). No host synchronisation (graph-capturable).
// drop_logits: the caller never reads `logits` again but for rows with keep_logits; greedy rows
// without top logprobs or keep_logits drop theirs from L2 unwritten once read (their contents are
// undefined afterwards), so 33 MB of a 64-row step's fp32 logits are not written back to DRAM
// during the next step's first GEMMs.
// batch_invariant: every row's log-probabilities (and token) are the same bits whatever the
// launch's row count. A row is split over a fixed number of blocks (the softmax normaliser's sum
// is partitioned by that split); otherwise the split shrinks as rows grow, so that the rows' blocks
// fit in one wave, and a log-probability may differ in its last bits between row counts (the
// token never does: it is chosen from exact keys and weights).
void launch_sample_rows(const SamplingDims& dims, const float* logits,
                        const RowSamplingParams* params, float* workspace, SampledRow* out,
                        SampledTop* top, cudaStream_t stream, bool drop_logits = false,
                        bool batch_invariant = false);

}  // namespace deft::kernels
