#include "models/llama_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/device_buffer.h"
#include "kernels/device_scope.h"
#include "kernels/llama_ops.h"
#include "kernels/prefill_attention.h"
#include "kernels/sampling.h"
#include "kernels/skinny_gemm.h"
#include "kernels/tree_attention_generic.h"
#include "models/gemm_tuner.h"
#include "models/llama_checkpoint.h"
#include "models/step_graphs.h"
#include "models/step_staging.h"
#include "models/step_timer.h"
#include "spdlog/spdlog.h"

namespace deft::models {

using kernels::DeviceBuffer;

namespace {

constexpr double kMiB = 1048576.0;
// cuBLAS / cuBLASLt workspace set explicitly: captured GEMMs must not allocate.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

DeviceBuffer upload(const void* data, size_t bytes) {
  DeviceBuffer buffer(std::max<size_t>(bytes, 16));
  if (bytes > 0) DEFT_CUDA_CHECK(cudaMemcpy(buffer.data(), data, bytes, cudaMemcpyHostToDevice));
  return buffer;
}

DeviceBuffer upload_floats(const std::vector<float>& values) {
  return upload(values.data(), values.size() * sizeof(float));
}

// Appends `tensor` as 16-bit `target` elements (a straight copy when it already is one).
void append_16bit(const TensorView& tensor, kernels::DType target, std::vector<uint16_t>& out) {
  const size_t count = static_cast<size_t>(tensor.numel());
  const size_t base = out.size();
  out.resize(base + count);
  const DType same = target == kernels::DType::kBf16 ? DType::kBF16 : DType::kF16;
  if (tensor.dtype == same) {
    std::memcpy(out.data() + base, tensor.data, count * 2);
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    const float value = tensor.at(i);
    out[base + i] = target == kernels::DType::kBf16 ? float_to_bf16(value) : float_to_fp16(value);
  }
}

DeviceBuffer upload_16bit(std::initializer_list<const TensorView*> tensors, kernels::DType target) {
  std::vector<uint16_t> host;
  for (const TensorView* tensor : tensors) append_16bit(*tensor, target, host);
  return upload(host.data(), host.size() * 2);
}

DeviceBuffer upload_fp32(const TensorView& tensor) {
  return upload_floats(tensor_to_floats(tensor));
}

absl::Status check_options(const LlamaCudaOptions& options) {
  if (options.max_batch_rows <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: max_batch_rows must be positive, got ", options.max_batch_rows));
  }
  if (options.page_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: page_tokens must be positive, got ", options.page_tokens));
  }
  if (options.num_kv_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: num_kv_slots must be >= 0, got ", options.num_kv_slots));
  }
  if (!(options.kv_memory_fraction > 0.0 && options.kv_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: kv_memory_fraction must be in (0, 1], got ", options.kv_memory_fraction));
  }
  if (options.weight_prefetch_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: weight_prefetch_bytes must be >= 0, got ", options.weight_prefetch_bytes));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("llama_cuda: no CUDA device visible");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: device ", options.device, " outside [0, ", count, ")"));
  }
  return absl::OkStatus();
}

kernels::DType model_dtype(const ModelConfig& config) {
  return config.torch_dtype == DType::kF16 ? kernels::DType::kFp16 : kernels::DType::kBf16;
}

}  // namespace

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
  kernels::DType dtype = kernels::DType::kBf16;
  cudaStream_t stream = nullptr;
  std::unique_ptr<GemmTuner> gemms;  // every weight GEMM (made once the workspace exists)

  DeviceBuffer embed;     // [vocab][hidden]
  DeviceBuffer norm;      // fp32 [hidden]
  DeviceBuffer lm_head;   // [vocab][hidden]; empty when tied to embed
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
  DeviceBuffer logits;    // fp32 [kLogitRowsPerChunk][vocab]
  // A step's inputs, uploaded with its plan (models/step_staging.h).
  StepInputs inputs;
  // forward_sampled: per logit row params in, SampledRow (+ top lists) out; the weights
  // workspace is allocated on the first step that samples (kLogitRowsPerChunk rows).
  DeviceBuffer sampled, sampled_top, sampling_workspace;
  PinnedHostBuffer sampled_host, sampled_top_host;
  kernels::DevicePlan plan;  // an eager step's plan (a graph step's is its graph's)
  kernels::DeftAttentionBuffers partials;
  kernels::PrefillAttentionBuffers prefill_scratch;  // split-KV partials of long prefixes
  kernels::AttentionDims dims;
  bool deft_kernels = false;
  SkinnyGemmUse skinny_gemm = SkinnyGemmUse::kOff;  // set_skinny_gemm
  int64_t prefetch_bytes = 0;                       // set_weight_prefetch: per GEMM
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

void LlamaCudaRunner::State::launch_step(const ModelConfig& c, const StepLaunch& launch) {
  const int32_t rows = launch.rows;
  const int32_t logit_rows = launch.logit_rows;
  const int32_t hidden = c.hidden_size;
  const int32_t q_size = c.q_size();
  const int32_t qkv_width = q_size + 2 * c.kv_size();
  const int32_t intermediate = c.intermediate_size;
  const int32_t vocab = c.vocab_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int32_t* d_tokens = launch.inputs.tokens;
  const int32_t* d_positions = launch.inputs.positions;
  const int32_t* d_slots = launch.inputs.slots;
  const int32_t* d_logit_rows = launch.inputs.logit_rows;
  const kernels::DevicePlan& device_plan = *launch.plan;

  float* x = residual.as<float>();
  kernels::launch_embedding(rows, hidden, dtype, d_tokens, embed.data(), x, stream);
  const kernels::QkvRopeDims qkv_dims{.num_tokens = rows,
                                      .num_q_heads = c.num_attention_heads,
                                      .num_kv_heads = c.num_key_value_heads,
                                      .head_dim = c.head_dim};
  const kernels::RmsNormDims norm_dims{.num_rows = rows, .width = hidden, .eps = eps};
  const size_t e = kernels::dtype_bytes(dtype);
  // The next GEMM's weights (out rows of in elements) for the small kernel before it to warm
  // L2: the first prefetch_bytes / out bytes of every row (whole 128-byte lines, at least one),
  // where each of the GEMM's CTAs starts reading.
  const auto prefetch = [&](const DeviceBuffer& weights, int64_t out, int64_t in) {
    if (prefetch_bytes == 0 || rows > kernels::kSkinnyGemmMaxRows) {
      return kernels::WeightPrefetch{};
    }
    const int64_t row_bytes = in * static_cast<int64_t>(e);
    const int64_t per_row = std::clamp<int64_t>(prefetch_bytes / out / 128 * 128, 128, row_bytes);
    return kernels::WeightPrefetch{.base = weights.data(),
                                   .rows = out,
                                   .row_bytes = row_bytes,
                                   .bytes_per_row = static_cast<int32_t>(per_row)};
  };
  // Activations read for the last time by a cuBLAS GEMM (the down projection's input, the
  // attention's output) or earlier (the QKV GEMM's output, Q): the RMSNorm after that GEMM drops
  // them from L2, so their write-back does not take DRAM time from the next GEMMs' weight
  // streams. Each is rewritten whole before it is read again.
  const kernels::L2Discard dead_after_mlp =
      kernels::L2Discard{}.add(act.data(), int64_t{rows} * intermediate * e);
  const kernels::L2Discard dead_after_attention =
      kernels::L2Discard{}
          .add(attn.data(), int64_t{rows} * q_size * e)
          .add(q.data(), int64_t{rows} * q_size * e)
          .add(qkv.data(), int64_t{rows} * qkv_width * e);
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& layer = layers[l];
    kernels::launch_rms_norm(norm_dims, dtype, nullptr, x, nullptr, layer.input_norm.as<float>(),
                             normed.data(), stream, prefetch(layer.qkv, qkv_width, hidden),
                             l > 0 ? dead_after_mlp : kernels::L2Discard{});
    timer.mark(StepPhase::kOther);
    gemm(normed.data(), layer.qkv.data(), rows, hidden, qkv_width, qkv.data(), false, false);
    timer.mark(StepPhase::kGemm);
    kernels::launch_qkv_rope_write(qkv_dims, dtype, d_positions, d_slots, inv_freq.as<float>(),
                                   qkv.data(), layer.qkv_bias.as<float>(), q.data(),
                                   layer.k_cache.data(), layer.v_cache.data(), stream);
    timer.mark(StepPhase::kOther);
    if (deft_kernels) {
      kernels::launch_deft_attention(
          device_plan.view(), device_plan.shape(), dims, dtype, q.data(), layer.k_cache.data(),
          layer.v_cache.data(), partials.partial_out(), partials.partial_lse(), attn.data(), stream,
          launch.stage2, launch.stage2_batch, prefetch(layer.o_proj, hidden, q_size));
      // Rows of the plan's prefill runs (no DeFT entries): the tiled causal kernel (never in a
      // graph step: those have no prefill runs).
      kernels::launch_prefill_attention(device_plan.view(), device_plan.prefill_runs(), dims, dtype,
                                        q.data(), layer.k_cache.data(), layer.v_cache.data(),
                                        prefill_scratch, attn.data(), stream);
    } else {  // the generic kernel runs the plan's tasks and prefill runs
      kernels::launch_tree_attention_generic(device_plan.view(), dims, dtype, q.data(),
                                             layer.k_cache.data(), layer.v_cache.data(),
                                             attn.data(), stream);
    }
    timer.mark(StepPhase::kAttention);
    gemm(attn.data(), layer.o_proj.data(), rows, q_size, hidden, x, true, true);
    timer.mark(StepPhase::kGemm);
    // The O projection's bias (Llama with attention_bias) is folded into the residual here.
    kernels::launch_rms_norm(norm_dims, dtype, nullptr, x, layer.o_bias.as<float>(),
                             layer.post_norm.as<float>(), normed.data(), stream,
                             prefetch(layer.gate_up, 2 * int64_t{intermediate}, hidden),
                             dead_after_attention);
    timer.mark(StepPhase::kOther);
    if (on_skinny({.rows = rows, .in = hidden, .out = 2 * intermediate}, normed.data(),
                  layer.gate_up.data(), false)) {
      // gate/up on the skinny GEMM: SiLU·mul in its epilogue, no gate/up round trip.
      kernels::launch_skinny_gemm_swiglu(rows, hidden, intermediate, dtype, normed.data(),
                                         layer.gate_up.data(), act.data(), stream);
      timer.mark(StepPhase::kGemm);
    } else {
      gemm(normed.data(), layer.gate_up.data(), rows, hidden, 2 * intermediate, gate_up.data(),
           false, false);
      timer.mark(StepPhase::kGemm);
      kernels::launch_silu_mul(rows, intermediate, dtype, gate_up.data(), act.data(), stream,
                               prefetch(layer.down, hidden, intermediate));
      timer.mark(StepPhase::kOther);
    }
    gemm(act.data(), layer.down.data(), rows, intermediate, hidden, x, true, true);
    timer.mark(StepPhase::kGemm);
  }
  if (logit_rows == 0) return;

  // Final norm of the logit rows only (gathered), then the LM head in chunks of rows.
  kernels::launch_rms_norm({.num_rows = logit_rows, .width = hidden, .eps = eps}, dtype,
                           d_logit_rows, x, nullptr, norm.as<float>(), normed.data(), stream, {},
                           layers.empty() ? kernels::L2Discard{} : dead_after_mlp);
  timer.mark(StepPhase::kOther);
  const void* head = c.tie_word_embeddings ? embed.data() : lm_head.data();
  const size_t row_bytes = kernels::dtype_bytes(dtype) * hidden;
  DEFT_CHECK(!launch.logits_out.empty() || launch.sample || logit_rows <= kLogitRowsPerChunk,
             "llama_cuda: %d logit rows need a destination per chunk", logit_rows);
  for (int32_t begin = 0; begin < logit_rows; begin += kLogitRowsPerChunk) {
    const int32_t count = std::min(kLogitRowsPerChunk, logit_rows - begin);
    gemm(static_cast<const char*>(normed.data()) + row_bytes * begin, head, count, hidden, vocab,
         logits.data(), true, false, /*lm_head=*/true);
    timer.mark(StepPhase::kGemm);
    if (launch.sample) {
      kernels::launch_sample_rows({.num_rows = count, .vocab_size = vocab, .row_stride = vocab},
                                  logits.as<float>(), launch.inputs.sampling_params + begin,
                                  sampling_workspace.as<float>(),
                                  sampled.as<kernels::SampledRow>() + begin,
                                  sampled_top.as<kernels::SampledTop>() +
                                      static_cast<size_t>(begin) * kernels::kSamplingMaxTopLogprobs,
                                  stream, /*drop_logits=*/true);
      timer.mark(StepPhase::kSampling);
    } else if (!launch.logits_out.empty()) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(launch.logits_out.data() + static_cast<size_t>(begin) * vocab,
                                      logits.data(), sizeof(float) * count * vocab,
                                      cudaMemcpyDeviceToHost, stream));
      timer.mark(StepPhase::kCopy);
    }
  }
}

namespace {

// Index of the first slot outside [0, limit), or -1. Runs on every step before any launch (a
// speculative step's plan holds ~6000 slots), so the common case is one pass of unsigned
// compares in blocks of 8 (a negative slot compares as >= 2^31), which -O2 vectorises with
// baseline SSE2: 0.56 us for 6064 slots on the development machine, against 5.5 us for the
// min / max pass it replaces (SSE2 has no int32 min or max). Only a plan that fails it is
// searched again for the slot to name.
int64_t first_slot_outside(std::span<const int32_t> slots, int32_t limit) {
  const auto bound = static_cast<uint32_t>(std::max(limit, 0));
  constexpr size_t kBlock = 8;
  uint32_t outside[kBlock] = {};
  size_t i = 0;
  for (; i + kBlock <= slots.size(); i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) {
      outside[k] |= static_cast<uint32_t>(slots[i + k]) >= bound;
    }
  }
  uint32_t any = 0;
  for (; i < slots.size(); ++i) any |= static_cast<uint32_t>(slots[i]) >= bound;
  for (uint32_t o : outside) any |= o;
  if (any == 0) return -1;
  for (size_t j = 0; j < slots.size(); ++j) {
    if (static_cast<uint32_t>(slots[j]) >= bound) return static_cast<int64_t>(j);
  }
  return -1;
}

// A step the kernels can trust: the plan's rows match the batch's, tokens are in the vocabulary,
// written slots and read KV slots in the pool, logit rows among the query rows, prefill runs
// inside the plan, and (forward()) `logits_size` fits the logit rows.
absl::Status check_step(const engine::StepBatch& batch, size_t logits_size, bool sample,
                        int32_t vocab, int32_t max_rows, int64_t num_kv_slots) {
  if (batch.plan == nullptr) return absl::InvalidArgumentError("llama_cuda: step without a plan");
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  if (static_cast<int64_t>(batch.tokens.size()) != rows ||
      static_cast<int64_t>(plan.query_position.size()) != rows ||
      static_cast<int64_t>(plan.query_slot.size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: the plan has ", rows, " query rows but the step carries ",
                     batch.tokens.size(), " tokens, ", plan.query_position.size(),
                     " positions and ", plan.query_slot.size(), " slots"));
  }
  if (rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: the step has ", rows, " query rows, more than max_batch_rows ", max_rows));
  }
  for (int32_t r = 0; r < rows; ++r) {
    if (batch.tokens[r] < 0 || batch.tokens[r] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " has token ",
                                                     batch.tokens[r],
                                                     ", outside the vocabulary [0, ", vocab, ")"));
    }
    if (plan.query_slot[r] < 0 || plan.query_slot[r] >= num_kv_slots) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " writes KV slot ",
                                                     plan.query_slot[r], ", outside [0, ",
                                                     num_kv_slots, ")"));
    }
    if (plan.query_position[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("llama_cuda: row ", r, " has position ", plan.query_position[r]));
    }
  }
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  if (logit_rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: ", logit_rows, " logit rows, more than max_batch_rows ", max_rows));
  }
  for (int32_t i = 0; i < logit_rows; ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= rows) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: logit row ", i, " is ",
                                                     batch.logit_rows[i], ", outside the ", rows,
                                                     " query rows"));
    }
  }
  if (!sample && logits_size != static_cast<size_t>(logit_rows) * vocab) {
    return absl::InvalidArgumentError(absl::StrCat("llama_cuda: logits hold ", logits_size,
                                                   " floats, expected ", logit_rows, " rows x ",
                                                   vocab));
  }
  // The kernels trust the plan; a slot outside the pool would read out of bounds.
  if (const int64_t at = first_slot_outside(plan.kv_slots, num_kv_slots); at >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("llama_cuda: the plan reads KV slot ",
                                                   plan.kv_slots[at], " (index ", at,
                                                   "), outside [0, ", num_kv_slots, ")"));
  }
  for (const kernels::PrefillRun& run : plan.prefill_runs) {
    if (run.num_rows <= 0 || run.row_begin < 0 || run.row_begin + run.num_rows > rows ||
        run.prefix_tokens < 0 || run.kv_begin < 0 ||
        int64_t{run.kv_begin} + run.prefix_tokens + run.num_rows >
            static_cast<int64_t>(plan.kv_slots.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "llama_cuda: prefill run (rows ", run.row_begin, " + ", run.num_rows, ", keys ",
          run.kv_begin, " + ", run.prefix_tokens, " + ", run.num_rows, ") outside the plan's ",
          rows, " rows and ", plan.kv_slots.size(), " KV indices"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

LlamaCudaRunner::LlamaCudaRunner() = default;
LlamaCudaRunner::~LlamaCudaRunner() {
  if (state_ == nullptr) return;
  const kernels::DeviceScope on_device(state_->device);
  state_.reset();
}

absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> LlamaCudaRunner::load(
    const std::filesystem::path& model_dir, const LlamaCudaOptions& options) {
  absl::StatusOr<ModelConfig> config = load_model_config(model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return create(*config, *checkpoint, options, model_dir.string());
}

absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> LlamaCudaRunner::create(
    const ModelConfig& config, const SafetensorsSet& checkpoint, const LlamaCudaOptions& options,
    std::string name) {
  if (absl::Status status = check_options(options); !status.ok()) return status;
  const kernels::DeviceScope on_device(options.device);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, checkpoint);
  if (!weights.ok()) return weights.status();

  std::unique_ptr<LlamaCudaRunner> runner(new LlamaCudaRunner());
  runner->config_ = config;
  runner->info_.name = std::move(name);
  runner->state_ = std::make_unique<State>();
  State& s = *runner->state_;
  s.device = options.device;
  s.dtype = model_dtype(config);
  s.embed = upload_16bit({&weights->embed_tokens}, s.dtype);
  s.norm = upload_fp32(weights->norm);
  if (!config.tie_word_embeddings) s.lm_head = upload_16bit({&weights->lm_head}, s.dtype);
  s.layers.resize(weights->layers.size());
  for (size_t l = 0; l < weights->layers.size(); ++l) {
    const LlamaLayerWeights& from = weights->layers[l];
    State::Layer& to = s.layers[l];
    to.input_norm = upload_fp32(from.input_layernorm);
    to.post_norm = upload_fp32(from.post_attention_layernorm);
    to.qkv = upload_16bit({&from.q_proj, &from.k_proj, &from.v_proj}, s.dtype);
    if (from.q_bias) {
      std::vector<float> bias;
      for (const TensorView* part : {&*from.q_bias, &*from.k_bias, &*from.v_bias}) {
        const std::vector<float> values = tensor_to_floats(*part);
        bias.insert(bias.end(), values.begin(), values.end());
      }
      to.qkv_bias = upload_floats(bias);
    }
    to.o_proj = upload_16bit({&from.o_proj}, s.dtype);
    if (from.o_bias) to.o_bias = upload_fp32(*from.o_bias);
    to.gate_up = upload_16bit({&from.gate_proj, &from.up_proj}, s.dtype);
    to.down = upload_16bit({&from.down_proj}, s.dtype);
  }
  if (absl::Status status = runner->finish_setup(options); !status.ok()) return status;
  return runner;
}

absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> LlamaCudaRunner::create_random(
    const ModelConfig& config, const LlamaCudaOptions& options, uint64_t seed, std::string name) {
  if (absl::Status status = check_options(options); !status.ok()) return status;
  const kernels::DeviceScope on_device(options.device);
  if (config.hidden_size <= 0 || config.intermediate_size <= 0 || config.num_hidden_layers <= 0 ||
      config.num_attention_heads <= 0 || config.num_key_value_heads <= 0 || config.head_dim <= 0 ||
      config.vocab_size <= 0) {
    return absl::InvalidArgumentError("llama_cuda: random weights need a complete config");
  }
  std::unique_ptr<LlamaCudaRunner> runner(new LlamaCudaRunner());
  runner->config_ = config;
  runner->config_.attention_bias = false;
  runner->config_.o_proj_bias = false;
  runner->info_.name = std::move(name);
  runner->state_ = std::make_unique<State>();
  State& s = *runner->state_;
  s.device = options.device;
  s.dtype = model_dtype(config);
  uint64_t tensor_index = 0;
  // A matrix [rows][cols] with std 1/sqrt(cols) (uniform: half-width sqrt(3/cols)).
  const auto matrix = [&](int64_t rows, int64_t cols, float std_dev) {
    DeviceBuffer buffer(static_cast<size_t>(rows * cols) * 2);
    kernels::launch_random_uniform(rows * cols, seed * 1000003u + tensor_index++,
                                   std_dev * std::sqrt(3.0f), 0.0f, s.dtype, buffer.data(),
                                   s.stream);
    return buffer;
  };
  const int64_t hidden = config.hidden_size;
  const float fan_hidden = 1.0f / std::sqrt(static_cast<float>(hidden));
  const std::vector<float> ones(static_cast<size_t>(hidden), 1.0f);
  s.embed = matrix(config.vocab_size, hidden, 1.0f);
  s.norm = upload_floats(ones);
  if (!config.tie_word_embeddings) s.lm_head = matrix(config.vocab_size, hidden, fan_hidden);
  s.layers.resize(static_cast<size_t>(config.num_hidden_layers));
  for (State::Layer& layer : s.layers) {
    layer.input_norm = upload_floats(ones);
    layer.post_norm = upload_floats(ones);
    layer.qkv = matrix(config.q_size() + 2 * config.kv_size(), hidden, fan_hidden);
    layer.o_proj = matrix(hidden, config.q_size(), 1.0f / std::sqrt(float(config.q_size())));
    layer.gate_up = matrix(2 * int64_t{config.intermediate_size}, hidden, fan_hidden);
    layer.down = matrix(hidden, config.intermediate_size,
                        1.0f / std::sqrt(static_cast<float>(config.intermediate_size)));
  }
  DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  if (absl::Status status = runner->finish_setup(options); !status.ok()) return status;
  return runner;
}

absl::Status LlamaCudaRunner::finish_setup(const LlamaCudaOptions& options) {
  State& s = *state_;
  const ModelConfig& c = config_;
  s.inv_freq = upload_floats(rope_inverse_frequencies(c));

  // Weights.
  s.weight_bytes = s.embed.bytes() + s.norm.bytes() + s.lm_head.bytes();
  for (const State::Layer& layer : s.layers) {
    for (const DeviceBuffer* buffer :
         {&layer.input_norm, &layer.post_norm, &layer.qkv, &layer.qkv_bias, &layer.o_proj,
          &layer.o_bias, &layer.gate_up, &layer.down}) {
      s.weight_bytes += buffer->bytes();
    }
  }

  // Attention kernels.
  s.dims.num_q_heads = c.num_attention_heads;
  s.dims.num_kv_heads = c.num_key_value_heads;
  s.dims.head_dim = c.head_dim;
  s.dims.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  s.deft_kernels = kernels::deft_attention_supported(s.dims);
  if (!s.deft_kernels && !kernels::tree_attention_generic_supported(s.dims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: head_dim ", c.head_dim, " with ", c.num_attention_heads,
                     " query heads and ", c.num_key_value_heads, " KV heads is not supported"));
  }

  // Activations for max_batch_rows query rows.
  const size_t rows = static_cast<size_t>(options.max_batch_rows);
  const size_t e = kernels::dtype_bytes(s.dtype);
  s.max_rows = options.max_batch_rows;
  s.residual.reset(rows * c.hidden_size * sizeof(float));
  s.normed.reset(rows * c.hidden_size * e);
  s.qkv.reset(rows * (c.q_size() + 2 * c.kv_size()) * e);
  s.q.reset(rows * c.q_size() * e);
  s.attn.reset(rows * c.q_size() * e);
  s.gate_up.reset(rows * 2 * c.intermediate_size * e);
  s.act.reset(rows * c.intermediate_size * e);
  s.logits.reset(static_cast<size_t>(kLogitRowsPerChunk) * c.vocab_size * sizeof(float));
  s.inputs.reserve(s.max_rows);
  s.sampled.reset(rows * sizeof(kernels::SampledRow));
  s.sampled_host.reset(rows * sizeof(kernels::SampledRow));
  s.sampled_top.reset(rows * kernels::kSamplingMaxTopLogprobs * sizeof(kernels::SampledTop));
  s.sampled_top_host.reset(rows * kernels::kSamplingMaxTopLogprobs * sizeof(kernels::SampledTop));
  // DeFT partials for up to two entries per query row to start with; they grow on demand.
  if (s.deft_kernels) s.partials.reserve(static_cast<int32_t>(2 * rows), s.dims);
  // Padded rows of a graph step leave their attention rows as they were: start them finite.
  DEFT_CUDA_CHECK(cudaMemsetAsync(s.attn.data(), 0, s.attn.bytes(), s.stream));
  s.cublas_workspace.reset(kCublasWorkspaceBytes);
  s.gemms =
      std::make_unique<GemmTuner>(s.stream, s.cublas_workspace.data(), s.cublas_workspace.bytes());
  // Before the KV pool takes the memory and any step runs: the activations are scratch now.
  s.gemms->set_wide_search(options.wide_gemm_search);
  if (options.tune_gemms) s.tune_gemms(c);
  s.use_graphs = options.cuda_graphs;
  s.prefetch_bytes = options.weight_prefetch_bytes;
  s.graphs.set_max_graphs(options.max_cuda_graphs);
  if (options.skinny_lm_head && kernels::skinny_gemm_available()) {
    s.skinny_gemm = SkinnyGemmUse::kLmHeadAndWide;
    kernels::skinny_gemm_reserve(s.stream);  // before any graph capture
  }
  s.activation_bytes = s.residual.bytes() + s.normed.bytes() + s.qkv.bytes() + s.q.bytes() +
                       s.attn.bytes() + s.gate_up.bytes() + s.act.bytes() + s.logits.bytes() +
                       s.sampled.bytes() + s.sampled_top.bytes() + s.cublas_workspace.bytes() +
                       (s.deft_kernels ? 2 * rows * (c.q_size() + c.num_attention_heads) * 4 : 0);

  // The KV pool from what is left.
  size_t free_bytes = 0, total_bytes = 0;
  DEFT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t slot_bytes = static_cast<size_t>(c.num_hidden_layers) * 2 * c.kv_size() * e;
  // One slot more than the pool holds: the sink of padded rows in graph steps.
  int64_t slots = options.num_kv_slots;
  if (slots == 0) {
    slots = static_cast<int64_t>(static_cast<double>(free_bytes) * options.kv_memory_fraction /
                                 static_cast<double>(slot_bytes)) -
            1;
    slots -= slots % options.page_tokens;
    if (slots <= 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("llama_cuda: ", free_bytes / kMiB,
                       " MiB free after weights and activations: no room "
                       "for one KV page"));
    }
  } else if (static_cast<size_t>(slots + 1) * slot_bytes > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("llama_cuda: ", slots, " KV slots need ",
                                                     slots * slot_bytes / kMiB, " MiB but only ",
                                                     free_bytes / kMiB, " MiB are free"));
  }
  const size_t cache_bytes = static_cast<size_t>(slots + 1) * c.kv_size() * e;
  s.sink_slot = static_cast<int32_t>(slots);
  for (State::Layer& layer : s.layers) {
    layer.k_cache.reset(cache_bytes);
    layer.v_cache.reset(cache_bytes);
    DEFT_CUDA_CHECK(cudaMemsetAsync(layer.k_cache.data(), 0, cache_bytes, s.stream));
    DEFT_CUDA_CHECK(cudaMemsetAsync(layer.v_cache.data(), 0, cache_bytes, s.stream));
  }
  s.kv_bytes = 2 * cache_bytes * s.layers.size();
  DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));

  info_.family = std::string(model_family_name(c.family));
  info_.vocab_size = c.vocab_size;
  info_.num_layers = c.num_hidden_layers;
  info_.max_position = c.max_position_embeddings;
  info_.num_kv_slots = slots;
  spdlog::info(
      "llama_cuda: loaded {} ({}, {} layers, hidden {}, vocab {}, {}) on a GPU with {:.0f} MiB: "
      "{:.1f} MiB weights, {:.1f} MiB activations for {} rows, {:.1f} MiB KV for {} slots "
      "({:.1f} KiB per token), attention: {}, decode GEMMs on the skinny GEMM: {}, weight "
      "prefetch before decode GEMMs: {:.1f} MiB",
      info_.name, info_.family, info_.num_layers, c.hidden_size, info_.vocab_size,
      kernels::dtype_name(s.dtype), total_bytes / kMiB, s.weight_bytes / kMiB,
      s.activation_bytes / kMiB, s.max_rows, s.kv_bytes / kMiB, slots, slot_bytes / 1024.0,
      s.deft_kernels ? "DeFT kernels" : "generic kernel (head_dim not built for DeFT)",
      s.skinny_gemm == SkinnyGemmUse::kLmHeadAndWide
          ? absl::StrCat("LM head, and gate/up above ", kSkinnyWideAboveRows, " rows")
          : std::string("none"),
      static_cast<double>(s.prefetch_bytes) / kMiB);
  return absl::OkStatus();
}

void LlamaCudaRunner::State::tune_gemms(const ModelConfig& c) {
  const auto start = std::chrono::steady_clock::now();
  const int32_t hidden = c.hidden_size;
  const int32_t q_size = c.q_size();
  const int32_t qkv_width = q_size + 2 * c.kv_size();
  const int32_t intermediate = c.intermediate_size;
  // Random inputs (N(0, 1)-like: uniform with half-width sqrt(3)) for every row tuned.
  const int64_t rows_max = std::min(kMaxGraphRows, max_rows);
  kernels::launch_random_uniform(rows_max * hidden, 11, std::sqrt(3.0f), 0.0f, dtype, normed.data(),
                                 stream);
  kernels::launch_random_uniform(rows_max * q_size, 12, std::sqrt(3.0f), 0.0f, dtype, attn.data(),
                                 stream);
  kernels::launch_random_uniform(rows_max * intermediate, 13, std::sqrt(3.0f), 0.0f, dtype,
                                 act.data(), stream);
  DEFT_CUDA_CHECK(cudaMemsetAsync(residual.data(), 0, residual.bytes(), stream));
  std::vector<const void*> qkv_w, o_w, gate_up_w, down_w;
  for (const Layer& layer : layers) {
    qkv_w.push_back(layer.qkv.data());
    o_w.push_back(layer.o_proj.data());
    gate_up_w.push_back(layer.gate_up.data());
    down_w.push_back(layer.down.data());
  }
  const std::vector<const void*> head_w = {c.tie_word_embeddings ? embed.data() : lm_head.data()};
  const double num_layers = static_cast<double>(layers.size());
  int32_t buckets = 0, tuned_shapes = 0, lt_shapes = 0;
  for (int32_t rows = 1; rows <= rows_max; rows = gemm_row_bucket(rows + 1)) {
    struct Job {
      const char* name;
      GemmShape shape;
      const std::vector<const void*>* weights;
      const void* x;
      void* y;
      double per_step;  // launches per decode step
    };
    const auto shape = [&](int32_t in, int32_t out, bool y_fp32, bool accumulate) {
      return GemmShape{.rows = rows,
                       .in = in,
                       .out = out,
                       .dtype = dtype,
                       .y_fp32 = y_fp32,
                       .accumulate = accumulate};
    };
    std::vector<Job> jobs = {
        {"qkv", shape(hidden, qkv_width, false, false), &qkv_w, normed.data(), qkv.data(),
         num_layers},
        {"o", shape(q_size, hidden, true, true), &o_w, attn.data(), residual.data(), num_layers},
        {"gate_up", shape(hidden, 2 * intermediate, false, false), &gate_up_w, normed.data(),
         gate_up.data(), num_layers},
        {"down", shape(intermediate, hidden, true, true), &down_w, act.data(), residual.data(),
         num_layers}};
    if (rows <= kLogitRowsPerChunk) {
      jobs.push_back({"lm_head", shape(hidden, c.vocab_size, true, false), &head_w, normed.data(),
                      logits.data(), 1.0});
    }
    std::string line;
    double default_step_us = 0, tuned_step_us = 0, bucket_ms = 0;
    for (const Job& job : jobs) {
      const GemmTuneResult result = gemms->tune(job.shape, *job.weights, job.x, job.y);
      default_step_us += job.per_step * result.default_us;
      tuned_step_us += job.per_step * result.chosen_us();
      bucket_ms += result.tuning_ms;
      ++tuned_shapes;
      lt_shapes += result.chosen >= 0;
      absl::StrAppend(&line, line.empty() ? "" : "; ", job.name, " ",
                      absl::StrFormat("%.1f", result.chosen_us()), " (",
                      absl::StrFormat("%.1f", result.default_us), ") ",
                      result.chosen >= 0 ? result.chosen_algo() : "default", " of ",
                      result.candidates.size());
    }
    ++buckets;
    spdlog::info(
        "llama_cuda: GEMMs at {} rows, µs tuned (cuBLAS default): {}; a step's GEMMs "
        "{:.0f} -> {:.0f} µs; tuned in {:.0f} ms",
        rows, line, default_step_us, tuned_step_us, bucket_ms);
  }
  spdlog::info(
      "llama_cuda: GEMMs tuned for {} row buckets ({} shapes, {} on a cuBLASLt "
      "algorithm, the rest on cuBLAS's default) in {:.2f} s",
      buckets, tuned_shapes, lt_shapes,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

size_t LlamaCudaRunner::weight_bytes() const { return state_->weight_bytes; }
size_t LlamaCudaRunner::activation_bytes() const { return state_->activation_bytes; }
size_t LlamaCudaRunner::kv_cache_bytes() const { return state_->kv_bytes; }
bool LlamaCudaRunner::uses_deft_kernels() const { return state_->deft_kernels; }
void LlamaCudaRunner::set_step_timing(StepTiming timing) { state_->timer.set_mode(timing); }
void LlamaCudaRunner::set_gemm_tuning(bool on) {
  const kernels::DeviceScope on_device(state_->device);
  // Captured step graphs hold the other GEMM kernels.
  if (state_->gemms->enabled() != on) state_->drop_graphs();
  state_->gemms->set_enabled(on);
}
void LlamaCudaRunner::set_skinny_gemm(SkinnyGemmUse use) {
  const kernels::DeviceScope on_device(state_->device);
  // Captured step graphs hold the other GEMM kernels.
  if (state_->skinny_gemm != use) state_->drop_graphs();
  state_->skinny_gemm = use;
  // Before any graph capture on the runner's stream.
  if (use != SkinnyGemmUse::kOff) kernels::skinny_gemm_reserve(state_->stream);
}
int64_t LlamaCudaRunner::weight_prefetch() const { return state_->prefetch_bytes; }
void LlamaCudaRunner::set_weight_prefetch(int64_t bytes_per_gemm) {
  DEFT_CHECK(bytes_per_gemm >= 0, "set_weight_prefetch: %lld bytes",
             static_cast<long long>(bytes_per_gemm));
  // Captured step graphs hold the kernels' arguments.
  const kernels::DeviceScope on_device(state_->device);
  if (state_->prefetch_bytes != bytes_per_gemm) state_->drop_graphs();
  state_->prefetch_bytes = bytes_per_gemm;
}
void LlamaCudaRunner::time_attention(bool on) {
  state_->timer.set_mode(on ? StepTiming::kPhases : StepTiming::kOff);
}
double LlamaCudaRunner::last_attention_seconds() const {
  const StepTimer& timer = state_->timer;
  return timer.times().valid && timer.mode() == StepTiming::kPhases
             ? timer.times().attention_ms * 1e-3
             : -1.0;
}
const StepTimes& LlamaCudaRunner::last_step_times() const { return state_->timer.times(); }
void LlamaCudaRunner::set_cuda_graphs(bool on) {
  const kernels::DeviceScope on_device(state_->device);
  state_->use_graphs = on;
  if (!on) state_->drop_graphs();
}
const CudaGraphStats& LlamaCudaRunner::cuda_graph_stats() const { return state_->graphs.stats(); }

engine::AttentionWave LlamaCudaRunner::attention_wave() const {
  const State& s = *state_;
  if (!s.deft_kernels) return {};
  const kernels::DeviceScope on_device(s.device);
  return {.ctas = kernels::deft_attention_resident_ctas(s.dims, s.dtype),
          .kv_heads = s.dims.num_kv_heads,
          .group_size = s.dims.group_size()};
}

absl::Status LlamaCudaRunner::forward(const engine::StepBatch& batch, std::span<float> logits) {
  return run_step(batch, logits, {}, {});
}

absl::Status LlamaCudaRunner::forward_sampled(const engine::StepBatch& batch,
                                              std::span<const engine::RowSampling> rows,
                                              std::span<engine::SampledToken> out) {
  if (absl::Status status = engine::check_row_sampling(batch, rows, out, config_.vocab_size);
      !status.ok()) {
    return status;
  }
  return run_step(batch, {}, rows, out);
}

absl::Status LlamaCudaRunner::run_step(const engine::StepBatch& batch, std::span<float> logits,
                                       std::span<const engine::RowSampling> sampling,
                                       std::span<engine::SampledToken> sampled) {
  const kernels::DeviceScope on_device(state_->device);
  const bool sample = !sampling.empty();
  const int32_t vocab = config_.vocab_size;
  State& s = *state_;
  if (absl::Status status =
          check_step(batch, logits.size(), sample, vocab, s.max_rows, info_.num_kv_slots);
      !status.ok()) {
    return status;
  }
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  s.timer.clear_times();
  if (rows == 0) return absl::OkStatus();

  // Graph steps: decode-sized, no per-launch events (kPhases runs eagerly).
  const bool graph_step = s.use_graphs && s.timer.mode() != StepTiming::kPhases &&
                          fits_step_graph(rows, logit_rows, s.max_rows, !plan.prefill_runs.empty());
  StepGraph* graph = nullptr;
  int32_t launch_rows = rows, launch_logit_rows = logit_rows;
  if (graph_step) {
    graph = &s.graphs.entry(
        step_graph_key(plan.view(), logit_rows, sample, s.dims, s.dtype, s.deft_kernels), s.stream);
    launch_rows = graph->key.rows;
    launch_logit_rows = graph->key.logit_rows;
  }
  StepSamplingNeeds needs;
  if (sample) {
    needs = s.inputs.stage_sampling(sampling, launch_rows, launch_logit_rows);
    const size_t workspace_bytes =
        kernels::sampling_workspace_bytes(std::min(kLogitRowsPerChunk, logit_rows), vocab);
    if (needs.any_draw && s.sampling_workspace.bytes() < workspace_bytes) {
      s.sampling_workspace.reset(kernels::sampling_workspace_bytes(kLogitRowsPerChunk, vocab));
    }
  }

  // A bucket's steps after its first start their timing inside the graph.
  if (graph != nullptr && graph->seen) {
    s.timer.mark_started_in_graph();
  } else {
    s.timer.mark_start();
  }
  // The step's inputs, uploaded with the plan in one copy.
  const std::span<const unsigned char> inputs =
      s.inputs.stage_rows(batch, launch_rows, launch_logit_rows, s.sink_slot, sample);
  State::StepLaunch launch{.rows = launch_rows,
                           .logit_rows = launch_logit_rows,
                           .plan = &s.plan,
                           .stage2 = kernels::DeftStage2::kIfMerging,
                           .sample = sample};
  if (graph != nullptr) {
    const kernels::AttentionPlanView view = plan.view();
    graph->stage(view, s.dims, inputs);
    // Partials for a power-of-two entry count, so they are reallocated (and graphs recaptured)
    // rarely.
    if (s.deft_kernels) s.partials.reserve(pow2_bucket(view.num_entries), s.dims);
    graph->bind_buffers(s.partials.partial_out(), s.sampling_workspace.data());
    launch.plan = &graph->plan;
    launch.stage2 =
        graph->key.stage2_batch > 0 ? kernels::DeftStage2::kAlways : kernels::DeftStage2::kNever;
    launch.stage2_batch = graph->key.stage2_batch;
  } else {
    s.plan.upload(plan.view(), s.dims, s.stream, inputs);
    if (s.deft_kernels) s.partials.reserve(plan.num_entries(), s.dims);
    launch.logits_out = sample ? std::span<float>() : logits;
  }
  launch.inputs = step_inputs_view(launch.plan->extra(), launch_rows, launch_logit_rows);
  s.timer.mark(StepPhase::kCopy);

  if (graph == nullptr) {
    s.launch_step(config_, launch);
    s.graphs.count_eager_step();
  } else {
    s.graphs.run(*graph, s.stream, s.timer, [&] { s.launch_step(config_, launch); });
  }

  if (logit_rows > 0) {
    if (!sample && launch.logits_out.empty()) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(logits.data(), s.logits.data(),
                                      sizeof(float) * static_cast<size_t>(logit_rows) * vocab,
                                      cudaMemcpyDeviceToHost, s.stream));
      s.timer.mark(StepPhase::kCopy);
    }
    if (sample) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(s.sampled_host.data(), s.sampled.data(),
                                      sizeof(kernels::SampledRow) * logit_rows,
                                      cudaMemcpyDeviceToHost, s.stream));
      if (needs.any_top_logprobs) {
        DEFT_CUDA_CHECK(cudaMemcpyAsync(
            s.sampled_top_host.data(), s.sampled_top.data(),
            sizeof(kernels::SampledTop) * kernels::kSamplingMaxTopLogprobs * logit_rows,
            cudaMemcpyDeviceToHost, s.stream));
      }
      s.timer.mark(StepPhase::kCopy);
    }
  }
  s.timer.mark_end(StepPhase::kCopy);
  DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.timer.collect_times();
  if (sample) {
    const auto* rows_out = s.sampled_host.as<kernels::SampledRow>();
    const auto* tops = s.sampled_top_host.as<kernels::SampledTop>();
    for (int32_t i = 0; i < logit_rows; ++i) {
      const kernels::SampledRow& row = rows_out[i];
      if (row.status != kernels::kSampledOk) {
        return absl::InternalError(
            absl::StrCat("llama_cuda: logit row ", i, " (query row ", batch.logit_rows[i], "): ",
                         row.status == kernels::kSampledNonFiniteLogit
                             ? absl::StrCat("sampling: logit of token ", row.error_token, " is ",
                                            row.error_logit)
                             : std::string("sampling: every logit of the row is -inf")));
      }
      const engine::SamplingParams& p = *sampling[i].params;
      engine::SampledToken& token = sampled[i];
      token.token = row.token;
      token.logprob = row.logprob;
      token.stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), row.token) !=
                   p.stop_token_ids.end();
      token.top_logprobs.clear();
      const kernels::SampledTop* top =
          tops + static_cast<size_t>(i) * kernels::kSamplingMaxTopLogprobs;
      for (int32_t j = 0; j < row.num_top; ++j) {
        token.top_logprobs.push_back({top[j].token, top[j].logprob});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace deft::models
