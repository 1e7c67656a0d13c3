// Tensor parallelism, the host side: how a Llama-family model is cut over `ranks` GPUs (or CPU
// ranks, the twin), Megatron-style, so that every rank reads 1/ranks of the weights and the
// ranks meet in two all-reduces per layer:
//   q/k/v, gate/up   by output rows (whole heads: rank r holds query heads [r H/N, (r+1) H/N)
//                    and KV heads [r KV/N, (r+1) KV/N), so every GQA group stays on one rank)
//   o, down          by input columns: each rank's product is a partial sum of the full one
//   embedding,       by vocabulary rows: rank r holds tokens [r S, r S + count) with
//   LM head          S = ceil(vocab / ranks) (the last rank's shard is zero-padded to S rows)
//   norms, o bias    whole on every rank
// One step on every rank: embedding of the rank's tokens (zeros for the others), all-reduce
// (sum) -> per layer: attention on the rank's heads, O partial, all-reduce into the residual;
// MLP on the rank's columns, down partial, all-reduce into the residual -> LM head of the rank's
// vocabulary rows, all-gather, logits [rows][vocab] assembled on rank 0 (which samples).
// The residual stream is replicated: rank 0 adds its partial to it, the others write their
// partial in its place, so the all-reduce's sum is residual + every rank's partial (fp32, the
// residual's own type: no rounding beyond the sum's order).
// Sampling: rank 0 alone samples, from the gathered logits; the tokens reach the other ranks as
// the next step's inputs, uploaded with the plan to every rank, so no broadcast is needed (ranks
// are threads of the engine's process). Every rank sampling from the same seeds would work too
// but would gather the full logits everywhere and repeat the sampling work N times.
// The collectives run on each rank's stream between its kernels, so a decode step's CUDA graph
// (models/step_graphs.h) captures them with the rest; every rank picks the same bucket for the
// same step, so the ranks' graphs hold the same collectives in the same order.
// Runners: models/llama_cpu.h (the twin, collectives in models/host_collectives.h) and
// models/llama_cuda.h (NCCL); models/tensor_parallel_runner.h drives their ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace deft::models {

// Which rank of how many a runner is; {0, 1} is a whole model.
struct TensorParallelRank {
  int32_t rank = 0;
  int32_t ranks = 1;
};

// OK when `config` splits over `ranks`: query heads, KV heads and the MLP width divide by it.
// INVALID_ARGUMENT naming the count that does not ("8 KV heads do not split over 3 ranks ...").
absl::Status check_tensor_parallel(const ModelConfig& config, int32_t ranks);

// One rank's shape: heads, KV heads and intermediate_size divided by `ranks`; hidden, head_dim
// and vocab_size (the logits' width: the whole vocabulary) unchanged. check_tensor_parallel first.
ModelConfig shard_config(const ModelConfig& config, int32_t ranks);

// A rank's rows of the vocabulary (embedding and LM head).
struct VocabShard {
  int32_t begin = 0;  // first token id held
  int32_t count = 0;  // tokens held (the last rank may hold fewer than rows, even none)
  int32_t rows = 0;   // rows of every rank's shard: ceil(vocab / ranks)
};
VocabShard vocab_shard(int32_t vocab_size, TensorParallelRank rank);

// How a [out][in] weight (nn.Linear layout) or a [n] vector is cut.
enum class ShardAxis {
  kRows,     // dim 0 (a linear's output features; a vector's elements)
  kColumns,  // dim 1 (a linear's input features)
};

// A rank's part of one tensor: rows or columns [begin, begin + count), zero-padded to
// `padded` along that axis; a view into the checkpoint where no copy is needed (whole rows,
// no padding), else its own bytes. Its view() is valid while it and the checkpoint live.
class TensorShard {
 public:
  TensorShard(const TensorView& tensor, ShardAxis axis, int64_t begin, int64_t count,
              int64_t padded);
  TensorShard(const TensorShard&) = delete;
  TensorShard& operator=(const TensorShard&) = delete;
  const TensorView& view() const { return view_; }

 private:
  std::vector<int64_t> shape_;
  std::vector<std::byte> owned_;
  TensorView view_;
};

// The even split a rank holds of a dimension of `extent` (which divides by ranks): [begin, count).
struct ShardRange {
  int64_t begin = 0;
  int64_t count = 0;
};
ShardRange even_shard(int64_t extent, TensorParallelRank rank);

}  // namespace deft::models
