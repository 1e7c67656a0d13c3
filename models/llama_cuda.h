// CUDA backend of the Llama-family runner (same interface and model families as
// models/llama_cpu.h). Weights live on the GPU in bf16 (fp16 when the config says float16;
// fp32 checkpoints are rounded to bf16), with q/k/v fused into one [q+2kv, hidden] matrix and
// gate/up into one [2*intermediate, hidden] matrix. One step:
//   embedding gather -> fp32 residual stream
//   per layer: RMSNorm -> QKV GEMM -> bias + RoPE + KV write (one kernel) -> DeFT attention (+ the
//              prefill kernel for the plan's prefill runs) on
//              the step's plan (uploaded once, reused by every layer) -> O GEMM accumulated
//              into the residual (beta = 1) -> RMSNorm -> gate/up GEMM -> SiLU·mul -> down GEMM
//              accumulated into the residual
//   final RMSNorm of the logit rows only (gathered) -> LM head GEMM (fp32 out) -> host
//   (forward) or GPU sampling and only the tokens to the host (forward_sampled).
// GEMMs are cuBLAS (bf16/fp16 in, fp32 accumulate): at load, each decode GEMM shape of every
// graph row bucket is timed on the cuBLASLt algorithms the heuristic offers and cuBLAS's default,
// and the fastest is kept (models/gemm_tuner.h). GPU memory is planned at load from the free
// memory: weights, activations for `max_batch_rows` query rows, then the KV pool.
// Decode-sized steps (up to 256 query rows and 256 logit rows, no prefill runs) replay CUDA
// graphs: one per bucket of the step's shape (rows and logit rows rounded up to powers of two,
// the plan's task count to a bucket), the step's inputs and plan padded to the bucket in
// preallocated buffers so the captured kernel parameters hold for every step of the bucket
// (models/step_graphs.h). Larger steps and StepTiming::kPhases launch one by one.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tensor_parallel.h"

struct ncclComm;  // NCCL's communicator (ncclComm_t); nccl.h stays out of this header
namespace deft::kernels {
struct PeerAllReduceTable;  // kernels/peer_all_reduce.h
}

namespace deft::models {

struct LlamaCudaOptions {
  // KV slots to hold; 0 = as many as kv_memory_fraction of the memory left after weights and
  // activations allows (rounded down to whole pages of page_tokens).
  int64_t num_kv_slots = 0;
  double kv_memory_fraction = 0.9;
  int32_t page_tokens = 16;
  // Query rows one step may carry (activations are sized for it; prefill runs longer than
  // this must be split by the caller).
  int32_t max_batch_rows = 4096;
  // The GPU. Every call of the runner makes it current for its duration and gives the calling
  // thread's current device back, so runners on several GPUs can be driven from one thread.
  int device = 0;
  // Decode steps replay CUDA graphs (false: every step launches its ~130 kernels one by one).
  bool cuda_graphs = true;
  // Graphs kept at most (one per shape bucket); the least recently used is dropped first.
  int32_t max_cuda_graphs = 32;
  // At load, time the GEMMs of decode steps (every graph row bucket: 1, 2, 4, ..., 256 rows)
  // on cuBLASLt's candidate algorithms and keep the fastest per shape (models/gemm_tuner.h;
  // ~2 s for Llama-3-8B on the H100); false: cuBLAS's default algorithm everywhere.
  bool tune_gemms = true;
  // Tuning also tries every other cuBLASLt algorithm id (GemmTuner::set_wide_search; ~3x the
  // tuning time).
  bool wide_gemm_search = false;
  // Decode steps' LM head (<= 64 logit rows) on the skinny GEMM (kernels/skinny_gemm.h) where
  // the GPU runs it (sm_90a), cuBLAS otherwise: few-shot steps 20-60 µs faster than with
  // cuBLASLt on the H100, speculative ones 11 µs slower to 53 µs faster; and gate/up too in steps
  // of more than 32 rows (LlamaCudaRunner::SkinnyGemmUse::kLmHeadAndWide;
  // bench/results/skinny_gemm-h100-notes.md, "Where the runner uses it"). false: cuBLAS(Lt)
  // for every GEMM.
  bool skinny_lm_head = true;
  // Decode steps (<= kernels::kSkinnyGemmMaxRows rows): the RMSNorms and SiLU·mul before the
  // QKV, gate/up and down GEMMs, and DeFT attention's stage 2 before the O projection, pull
  // about this many bytes of that GEMM's weights into L2 while they run, the first bytes of
  // every weight row (kernels::WeightPrefetch), so the GEMM's weight stream starts before it
  // does (a cuBLAS GEMM cannot start early itself); 0: none. 4 MiB: on the H100, 2-6 MiB are
  // within ~20 µs a step of each other, 8-16 MiB lose in the small kernels what the GEMMs gain,
  // 32 MiB is slower (bench/results/e2e_step-h100-notes.md).
  int64_t weight_prefetch_bytes = int64_t{4} << 20;
  // Deterministic mode (the server's --deterministic): a row's logits (and sampled token) are the
  // same bits whatever other rows share its step, given a deterministic plan
  // (engine::PlannerOptions::deterministic). Every weight GEMM runs on the skinny GEMM in passes
  // of 64 rows (kernels/skinny_gemm.h: its grid and reduction order depend only on the weight's
  // shape) instead of cuBLAS, whose algorithm, tiles and split-K change with the row count; the
  // attention's stage 1 runs every pass on warpgroup MMAs (kernels::PlanShape::batch_invariant).
  // The sampler keeps its widest split of a row at any row count (kernels/sampling.h,
  // batch_invariant); the other kernels (RMSNorm, RoPE, SiLU·mul) already compute each row
  // alone. With tensor parallelism every step's residual all-reduce stays on the peer kernel
  // (see peer_all_reduce). Needs a compute 9.0 GPU and the DeFT kernels (load fails otherwise).
  // tune_gemms, skinny_lm_head and set_skinny_gemm / set_gemm_tuning then change nothing. Cost:
  // bench/results/deterministic_step-h200-notes.md (the sampler alone: bench/sampling_bench.cu).
  bool deterministic = false;
  // Tensor parallelism (models/tensor_parallel.h): this runner is rank `tp.rank` of `tp.ranks` on
  // `device`, holding that rank's shard of the weights and KV heads, and meets the other ranks
  // through `nccl_comm` (that rank's communicator) inside every step. Set by
  // load_tensor_parallel() / create_random_tensor_parallel(), which make the communicators and
  // drive all ranks; a rank alone is not a model. With num_kv_slots = 0 the ranks agree on the
  // fewest slots any of them has room for.
  TensorParallelRank tp;
  ncclComm* nccl_comm = nullptr;
  // Decode-sized steps (<= 256 rows) sum the residual with kernels/peer_all_reduce.h (one kernel
  // writing into the peers' memory over NVLink) instead of NCCL, where every pair of GPUs has
  // peer access; larger steps (but in deterministic mode, which stays on the peer kernel in
  // pieces), and false, use NCCL. load_tensor_parallel() sets `peer_table`.
  bool peer_all_reduce = true;
  const kernels::PeerAllReduceTable* peer_table = nullptr;
};

struct CudaGraphStats {
  int64_t graph_steps = 0;  // steps replayed from a graph (the capturing step included)
  int64_t captures = 0;     // graphs captured: a new bucket, or a bucket's plan outgrew its buffers
  double capture_us = 0;    // host time of those captures and instantiations, summed
  int64_t eager_steps = 0;  // steps launched one by one (graphs off, kPhases, too large, or the
                            // first step of a bucket, which runs the padded launches uncaptured)
  int32_t cached_graphs = 0;
};

// Optional GPU timing of forward() (benchmarks): kOff costs no host time; kTotal records two CUDA
// events around the step's GPU work (input upload to logits download; in a graph step the first
// is the graph's first node, recorded whatever the timing, so the total starts when the GPU does
// and a graph step makes no CUDA call before its launch); kPhases also records an event after
// every launch and sums the intervals per phase. Event records add a little host time per
// launch, so a benchmark takes the total from kTotal steps and the split from kPhases.
enum class StepTiming { kOff, kTotal, kPhases };

struct StepTimes {
  double total_ms = 0;      // first event to last event of the step
  double attention_ms = 0;  // DeFT / generic attention launches (both stages)
  double gemm_ms = 0;       // GEMMs (QKV, O, gate/up, down, LM head)
  double other_ms = 0;      // embedding, RMSNorms, RoPE + KV write, SiLU·mul
  double copy_ms = 0;       // step inputs and plan upload, logits (or sampled tokens) download
  double sampling_ms = 0;   // GPU sampling (forward_sampled)
  bool valid = false;       // false when the last step ran with kOff (or had no rows)
};

class LlamaCudaRunner final : public engine::ModelRunner {
 public:
  // Loads `model_dir` (config.json + *.safetensors). Errors name the file, tensor or field.
  static absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> load(
      const std::filesystem::path& model_dir, const LlamaCudaOptions& options);
  static absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> create(const ModelConfig& config,
                                                                 const SafetensorsSet& checkpoint,
                                                                 const LlamaCudaOptions& options,
                                                                 std::string name = "");
  // Seeded random weights of `config`'s shape, generated on the GPU (benchmarks without a
  // checkpoint, e.g. a Llama-3-8B-shaped config): matrices uniform with std 1/sqrt(fan_in),
  // norms 1, no biases.
  static absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> create_random(
      const ModelConfig& config, const LlamaCudaOptions& options, uint64_t seed = 0,
      std::string name = "random");

  // Tensor parallelism over `devices` (one rank per GPU, rank r on devices[r]; options.device
  // and options.tp are ignored): NCCL communicators over those GPUs, each rank's shard of the
  // weights loaded straight from the checkpoint onto its GPU (ranks load in parallel), and one
  // runner that drives the ranks' steps (models/tensor_parallel_runner.h). INVALID_ARGUMENT when
  // the model's heads or MLP do not split over devices.size() ranks, or a device is repeated.
  static absl::StatusOr<std::unique_ptr<engine::ModelRunner>> load_tensor_parallel(
      const std::filesystem::path& model_dir, const LlamaCudaOptions& options,
      std::span<const int> devices);
  // False when the build has no NCCL: the *_tensor_parallel functions then fail with
  // FAILED_PRECONDITION saying so.
  static bool tensor_parallel_available();
  // The same from a parsed config and an open checkpoint (tests build these in memory).
  static absl::StatusOr<std::unique_ptr<engine::ModelRunner>> create_tensor_parallel(
      const ModelConfig& config, const SafetensorsSet& checkpoint, const LlamaCudaOptions& options,
      std::span<const int> devices, std::string name = "");
  // The same with seeded random weights (benchmarks); rank r's shard is what create_random
  // would draw for a model of the shard's shape with seed + r, not a slice of TP 1's weights.
  static absl::StatusOr<std::unique_ptr<engine::ModelRunner>> create_random_tensor_parallel(
      const ModelConfig& config, const LlamaCudaOptions& options, std::span<const int> devices,
      uint64_t seed = 0);

  ~LlamaCudaRunner() override;

  const engine::ModelInfo& info() const override { return info_; }
  // This rank's shape (shard_config: heads, KV heads and MLP divided by the ranks).
  const ModelConfig& config() const { return config_; }
  // Rank 0 writes the logits (or samples); a rank after it takes an empty `logits`.
  absl::Status forward(const engine::StepBatch& batch, std::span<float> logits) override;
  // Samples on the GPU (kernels/sampling.h) right after the LM head: tokens, logprobs and
  // asked-for top logprobs come back, and only the logits of the rows without params.
  bool samples_on_device() const override { return true; }
  absl::Status forward_sampled(const engine::StepBatch& batch,
                               std::span<const engine::RowSampling> rows,
                               std::span<engine::SampledToken> out,
                               std::span<float> logits = {}) override;
  // Pinned host memory, grown to the largest step's logits so far (kept for the runner's life).
  std::span<float> logits_buffer(size_t floats) override;

  // The DeFT stage-1 launch (CTAs resident at once, KV heads, GQA group); none on the generic
  // attention fallback.
  engine::AttentionWave attention_wave() const override;

  size_t weight_bytes() const;
  size_t activation_bytes() const;
  size_t kv_cache_bytes() const;
  // True when attention runs the DeFT kernels; false for the generic fallback (head dims the
  // DeFT kernels are not built for).
  bool uses_deft_kernels() const;

  void set_step_timing(StepTiming timing);
  // On (the default): GEMMs run the algorithms tuned at load (LlamaCudaOptions::tune_gemms);
  // off: cuBLAS's default algorithm. Benchmarks compare.
  void set_gemm_tuning(bool on);
  // Which GEMMs of decode steps (<= kernels::kSkinnyGemmMaxRows rows) run on the skinny GEMM
  // (kernels/skinny_gemm.h, sm_90a) instead of cuBLAS: none, the wide ones
  // (kernels::skinny_gemm_wide), the LM head only, the LM head and the wide ones in steps of
  // more than kSkinnyWideAboveRows rows (the default, LlamaCudaOptions::skinny_lm_head), or all.
  // Benchmarks compare.
  enum class SkinnyGemmUse { kOff, kWide, kLmHead, kLmHeadAndWide, kAll };
  // kLmHeadAndWide's threshold: on the H100 gate/up on the skinny GEMM makes the 64-row
  // speculative step ~20 µs faster and the few-shot step (20 rows, run as 32) ~90 µs slower
  // (bench/results/skinny_gemm-h100-notes.md, bench/results/e2e_step-h100-notes.md).
  static constexpr int32_t kSkinnyWideAboveRows = 32;
  void set_skinny_gemm(SkinnyGemmUse use);
  // LlamaCudaOptions::weight_prefetch_bytes for the next steps. Benchmarks compare.
  void set_weight_prefetch(int64_t bytes_per_gemm);
  int64_t weight_prefetch() const;
  // time_attention(true): the next steps run with StepTiming::kPhases (a few µs of host time
  // per launch), so last_attention_seconds() reports their attention time.
  void time_attention(bool on) override;
  double last_attention_seconds() const override;
  // Times of the last forward() under the timing mode set then.
  const StepTimes& last_step_times() const;
  // Turns CUDA graph replay on or off for the next steps (off drops the cached graphs).
  void set_cuda_graphs(bool on);
  // Benchmarks only (bench/workload_replay's "no_attention" rows, the DeFT paper's upper bound:
  // the same steps without attention): on, the next steps launch no attention kernel (DeFT,
  // prefill or generic) and the O projection reads the attention output buffer as it stands
  // (zeroed when switched on; finite), so the logits are meaningless. Off (the default): the
  // full forward pass.
  void set_attention_skipped(bool skip);
  const CudaGraphStats& cuda_graph_stats() const;

 private:
  struct State;  // device buffers, cuBLAS handle, stream (CUDA types stay out of this header)
  LlamaCudaRunner();
  absl::Status finish_setup(const LlamaCudaOptions& options);
  // forward() when `sampling` is empty, forward_sampled() otherwise (then `logits` holds the
  // rows without params).
  absl::Status run_step(const engine::StepBatch& batch, std::span<float> logits,
                        std::span<const engine::RowSampling> sampling,
                        std::span<engine::SampledToken> sampled);

  ModelConfig config_;
  engine::ModelInfo info_;
  std::unique_ptr<State> state_;
};

}  // namespace deft::models
