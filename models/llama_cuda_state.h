// LlamaCudaRunner's private state (models/llama_cuda.h keeps CUDA types out of the public header):
// the weights on the GPU, activations for max_batch_rows query rows, the step's staged inputs and
// plan, the graph cache, step timing, and the dispatch every weight GEMM goes through. Included
// only by the runner's own sources: llama_cuda.cc (the forward pass and the step) and
// llama_cuda_load.cc (loading, the memory plan, GEMM tuning).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/device_buffer.h"
#include "kernels/peer_all_reduce.h"
#include "kernels/prefill_attention.h"
#include "kernels/sampling.h"
#include "kernels/skinny_gemm.h"
#include "models/gemm_tuner.h"
#include "models/llama_cuda.h"
#include "models/nccl_or_stub.h"
#include "models/step_graphs.h"
#include "models/step_staging.h"
#include "models/step_timer.h"
#include "models/tensor_parallel.h"

// An NCCL call that must succeed: aborts naming the call, file and line otherwise.
#define DEFT_NCCL_CHECK(call)                                                                    \
  do {                                                                                           \
    const ncclResult_t deft_nccl_result = (call);                                                \
    DEFT_CHECK(deft_nccl_result == ncclSuccess, "NCCL error %d (%s) in %s",                      \
               static_cast<int>(deft_nccl_result), ncclGetErrorString(deft_nccl_result), #call); \
  } while (0)

namespace deft::models {

// Logit rows per LM-head GEMM: bounds the fp32 logits buffer (rows x vocab) whatever the step.
inline constexpr int32_t kLogitRowsPerChunk = 256;
static_assert(kMaxGraphRows <= kLogitRowsPerChunk, "a graph step runs one LM-head chunk");

struct LlamaCudaRunner::State {
  using DeviceBuffer = kernels::DeviceBuffer;
  using PinnedHostBuffer = kernels::PinnedHostBuffer;

  struct Layer {
    DeviceBuffer input_norm, post_norm;  // fp32 [hidden]
    DeviceBuffer qkv;                    // [q + 2 kv][hidden]: q_proj, k_proj, v_proj rows
    DeviceBuffer qkv_bias;               // fp32 [q + 2 kv]; empty without bias
    DeviceBuffer o_proj;                 // [hidden][q]
    DeviceBuffer o_bias;                 // fp32 [hidden]; empty without bias
    DeviceBuffer gate_up;                // [2 intermediate][hidden]: gate_proj, up_proj rows
    DeviceBuffer down;                   // [hidden][intermediate]
    DeviceBuffer k_cache, v_cache;       // [num_kv_slots][kv_heads][head_dim]
  };

  int device = 0;  // LlamaCudaOptions::device: made current by every entry point (DeviceScope)
  // Tensor parallelism (models/tensor_parallel.h): this rank, its communicator (null at one
  // rank) and its vocabulary rows (embedding and LM head).
  TensorParallelRank tp;
  ncclComm_t comm = nullptr;
  VocabShard vocab_part;
  // The peer all-reduce's buffers (ranks 0: NCCL only; LlamaCudaOptions::peer_all_reduce).
  kernels::PeerAllReduceTable peer_table;
  kernels::DType dtype = kernels::DType::kBf16;
  cudaStream_t stream = nullptr;
  std::unique_ptr<GemmTuner> gemms;  // every weight GEMM (made once the workspace exists)

  DeviceBuffer embed;     // [vocab_part.rows + 1][hidden]: this rank's rows, then a zero row (the
                          // row of every token another rank holds, models/step_staging.h)
  DeviceBuffer norm;      // fp32 [hidden]
  DeviceBuffer lm_head;   // [vocab_part.rows][hidden]; empty when tied to embed
  DeviceBuffer inv_freq;  // fp32 [head_dim / 2]
  std::vector<Layer> layers;

  int32_t max_rows = 0;
  DeviceBuffer residual;  // fp32 [rows][hidden]
  DeviceBuffer normed;    // [rows][hidden]
  DeviceBuffer qkv;       // [rows][q + 2 kv]
  DeviceBuffer q;         // [rows][q]
  DeviceBuffer attn;      // [rows][q]
  DeviceBuffer gate_up;   // [rows][2 intermediate]
  DeviceBuffer act;       // [rows][intermediate]
  DeviceBuffer logits;    // fp32 [kLogitRowsPerChunk][vocab] (rank 0)
  // Tensor parallel: the LM head's rows of this rank [kLogitRowsPerChunk][vocab_part.rows] and
  // every rank's, all-gathered [ranks][chunk rows][vocab_part.rows] (fp32); empty at one rank.
  DeviceBuffer logits_shard, logits_gathered;
  // A step's inputs, uploaded with its plan (models/step_staging.h).
  StepInputs inputs;
  // forward_sampled: per logit row params in, SampledRow (+ top lists) out; the weights
  // workspace is allocated on the first step that samples (kLogitRowsPerChunk rows).
  DeviceBuffer sampled, sampled_top, sampling_workspace;
  std::vector<int32_t> kept_rows;  // the step's logit rows that want their logits (host)
  PinnedHostBuffer sampled_host, sampled_top_host;
  PinnedHostBuffer logits_host;  // logits_buffer(): where the engine has logits copied
  kernels::DevicePlan plan;  // an eager step's plan (a graph step's is its graph's)
  kernels::DeftAttentionBuffers partials;
  kernels::PrefillAttentionBuffers prefill_scratch;  // split-KV partials of long prefixes
  kernels::AttentionDims dims;
  bool deft_kernels = false;
  SkinnyGemmUse skinny_gemm = SkinnyGemmUse::kOff;  // set_skinny_gemm
  // LlamaCudaOptions::deterministic: every weight GEMM on the skinny GEMM in passes of
  // kSkinnyGemmMaxRows rows at N = 64 (gemm(), gemm_swiglu()), the attention's stage 1 on
  // warpgroup MMAs only (kernels::PlanShape::batch_invariant); set_skinny_gemm and
  // set_gemm_tuning then change nothing.
  bool batch_invariant = false;
  int64_t prefetch_bytes = 0;                       // set_weight_prefetch: per GEMM
  bool skip_attention = false;                      // set_attention_skipped (benchmarks)
  DeviceBuffer cublas_workspace;
  int32_t sink_slot = 0;  // K/V of padded rows (one slot past the pool)

  bool use_graphs = true;
  StepGraphCache graphs;  // models/step_graphs.h
  StepTimer timer;        // set_step_timing

  size_t weight_bytes = 0, activation_bytes = 0, kv_bytes = 0;

  // One step's launches, embedding through the LM head (and sampling): eager, or captured.
  struct StepLaunch {
    int32_t rows = 0;  // launch sizes (a graph bucket's, or the step's own)
    int32_t logit_rows = 0;
    StepInputsView inputs;  // device: the step's inputs
    const kernels::DevicePlan* plan = nullptr;
    kernels::DeftStage2 stage2 = kernels::DeftStage2::kIfMerging;
    int32_t stage2_batch = 0;  // 0: launch_deft_attention picks for the plan
    bool sample = false;
    // Eager forward(): each LM-head chunk's logits are copied here (more than one chunk of
    // rows); empty: they stay in `logits` (at most one chunk).
    std::span<float> logits_out;
    // Eager forward_sampled(): the logit rows (ascending) whose logits are copied to the host,
    // row kept_rows[k] to kept_out + k * vocab, from each chunk before the next overwrites it.
    std::span<const int32_t> kept_rows;
    float* kept_out = nullptr;
  };
  // The forward pass (llama_cuda.cc).
  void launch_step(const ModelConfig& c, const StepLaunch& launch);

  State() : stream(new_stream()), timer(stream) {}
  ~State() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    graphs.clear();
    gemms.reset();
    if (stream != nullptr) {
      kernels::skinny_gemm_release(stream);
      cudaStreamDestroy(stream);
    }
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Drops the captured graphs (they hold kernels and arguments a setting change replaces).
  void drop_graphs() {
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    graphs.clear();
  }

  // y[rows][out] (= or +=) x[rows][in] * w[out][in]^T, fp32 accumulation; y is `dtype` or fp32.
  // On the cuBLASLt algorithm tuned for the shape's row bucket (tune_gemms), else cuBLAS's
  // default. With skinny_gemm set, steps of up to kSkinnyGemmMaxRows rows (decode) stream the
  // weights (all, the wide shapes', the LM head's, or the LM head's and in steps of more than
  // kSkinnyWideAboveRows rows the wide shapes': the default, LlamaCudaOptions::skinny_lm_head)
  // through kernels/skinny_gemm.h. For the other layer GEMMs it is off: on the H100 the e2e
  // step was slower with it (bench/results/skinny_gemm-h100-notes.md).
  bool on_skinny(const kernels::SkinnyGemmDims& dims, const void* x, const void* w,
                 bool lm_head) const {
    const bool with_head =
        skinny_gemm == SkinnyGemmUse::kLmHead || skinny_gemm == SkinnyGemmUse::kLmHeadAndWide;
    const bool skinny_shape =
        skinny_gemm == SkinnyGemmUse::kAll ||
        (skinny_gemm == SkinnyGemmUse::kWide && kernels::skinny_gemm_wide(dims)) ||
        (with_head && lm_head) ||
        (skinny_gemm == SkinnyGemmUse::kLmHeadAndWide && dims.rows > kSkinnyWideAboveRows &&
         kernels::skinny_gemm_wide(dims));
    return skinny_shape && dims.rows <= kernels::kSkinnyGemmMaxRows &&
           kernels::skinny_gemm_supported(dims, x, w) && kernels::skinny_gemm_available();
  }
  void gemm(const void* x, const void* w, int32_t rows, int32_t in, int32_t out, void* y,
            bool y_fp32, bool accumulate, bool lm_head = false) const {
    const kernels::SkinnyGemmDims dims{.rows = rows, .in = in, .out = out};
    if (batch_invariant) {
      // The skinny GEMM's grid depends on w's shape alone and each x row is an MMA column of
      // its own, so a row's outputs do not depend on the step's other rows (a cuBLAS algorithm,
      // its tiles and split-K change with M).
      const size_t x_row = kernels::dtype_bytes(dtype) * static_cast<size_t>(in);
      const size_t y_row = (y_fp32 ? sizeof(float) : kernels::dtype_bytes(dtype)) * out;
      for (int32_t begin = 0; begin < rows; begin += kernels::kSkinnyGemmMaxRows) {
        kernels::launch_skinny_gemm(
            {.rows = std::min(kernels::kSkinnyGemmMaxRows, rows - begin), .in = in, .out = out},
            dtype, static_cast<const char*>(x) + x_row * begin, w,
            static_cast<char*>(y) + y_row * begin, y_fp32, accumulate, stream, /*split_k=*/0,
            /*batch_invariant=*/true);
      }
      return;
    }
    if (on_skinny(dims, x, w, lm_head)) {
      kernels::launch_skinny_gemm(dims, dtype, x, w, y, y_fp32, accumulate, stream);
      return;
    }
    gemms->gemm({.rows = rows,
                 .in = in,
                 .out = out,
                 .dtype = dtype,
                 .y_fp32 = y_fp32,
                 .accumulate = accumulate},
                x, w, y);
  }
  // out[rows][width] = silu(gate) * up of x[rows][in] * gate_up[2 width][in]^T on the skinny
  // GEMM (SwiGLU in its epilogue), in passes of kSkinnyGemmMaxRows rows (batch_invariant: every
  // step, N = 64 whatever the rows).
  void gemm_swiglu(const void* x, const void* gate_up, int32_t rows, int32_t in, int32_t width,
                   void* out) const {
    if (!batch_invariant) {
      kernels::launch_skinny_gemm_swiglu(rows, in, width, dtype, x, gate_up, out, stream);
      return;
    }
    const size_t e = kernels::dtype_bytes(dtype);
    for (int32_t begin = 0; begin < rows; begin += kernels::kSkinnyGemmMaxRows) {
      kernels::launch_skinny_gemm_swiglu(std::min(kernels::kSkinnyGemmMaxRows, rows - begin), in,
                                         width, dtype, static_cast<const char*>(x) + e * in * begin,
                                         gate_up, static_cast<char*>(out) + e * width * begin,
                                         stream,
                                         /*batch_invariant=*/true);
    }
  }
  // Tensor parallel: the residual `x` [rows][hidden] (fp32) summed over the ranks in place, on the
  // stream (captured into a step's graph like any launch); nothing at one rank. Batch-invariant
  // steps of any size stay on the peer kernel (in pieces of its capacity): it sums each element
  // in rank order, where NCCL's order over more than two ranks depends on the size (over two, a
  // sum is one addition either way; llama_cuda_load.cc refuses more without peer access).
  void all_reduce_residual(float* x, int32_t rows, int32_t hidden) const {
    if (tp.ranks == 1) return;
    const int64_t count = int64_t{rows} * hidden;
    if (peer_table.ranks > 1 && (count <= peer_table.capacity || batch_invariant)) {
      for (int64_t begin = 0; begin < count; begin += peer_table.capacity) {
        kernels::launch_peer_all_reduce(peer_table, tp.rank, x + begin,
                                        std::min(peer_table.capacity, count - begin), stream);
      }
      return;
    }
    DEFT_NCCL_CHECK(
        ncclAllReduce(x, x, static_cast<size_t>(count), ncclFloat32, ncclSum, comm, stream));
  }
  // The O and down GEMMs add their product to the residual on rank 0 and replace it on the
  // others, so the all-reduce after them sums residual + every rank's partial.
  bool accumulates_residual() const { return tp.rank == 0; }

  // Measures the decode GEMMs of every graph row bucket (see GemmTuner) on the layers'
  // weights, with the activation buffers as scratch (call before any step; llama_cuda_load.cc).
  void tune_gemms(const ModelConfig& c);

 private:
  static cudaStream_t new_stream() {
    cudaStream_t created = nullptr;
    DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }
};

}  // namespace deft::models
