#include "models/llama_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/device_buffer.h"
#include "kernels/llama_ops.h"
#include "kernels/prefill_attention.h"
#include "kernels/sampling.h"
#include "kernels/skinny_gemm.h"
#include "kernels/tree_attention_generic.h"
#include "models/llama_checkpoint.h"
#include "spdlog/spdlog.h"

// Aborts on a failing cuBLAS call (a bug or a broken device: inputs are validated before).
#define DEFT_CUBLAS_CHECK(call)                                                                 \
  do {                                                                                          \
    const cublasStatus_t deft_cublas_status_ = (call);                                          \
    if (deft_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "cuBLAS error at %s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, \
                   cublasGetStatusString(deft_cublas_status_));                                 \
      std::fflush(stderr);                                                                      \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)

namespace deft::models {

using kernels::DeviceBuffer;
using kernels::PinnedHostBuffer;

namespace {

constexpr double kMiB = 1048576.0;
// Logit rows per LM-head GEMM: bounds the fp32 logits buffer (rows x vocab) whatever the step.
constexpr int32_t kLogitRowsPerChunk = 256;

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

cudaDataType cuda_type(kernels::DType dtype) {
  return dtype == kernels::DType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
}

}  // namespace

struct LlamaCudaRunner::State {
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

  kernels::DType dtype = kernels::DType::kBf16;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;

  DeviceBuffer embed;     // [vocab][hidden]
  DeviceBuffer norm;      // fp32 [hidden]
  DeviceBuffer lm_head;   // [vocab][hidden]; empty when tied to embed
  DeviceBuffer inv_freq;  // fp32 [head_dim / 2]
  std::vector<Layer> layers;

  int32_t max_rows = 0;
  DeviceBuffer residual;   // fp32 [rows][hidden]
  DeviceBuffer normed;     // [rows][hidden]
  DeviceBuffer qkv;        // [rows][q + 2 kv]
  DeviceBuffer q;          // [rows][q]
  DeviceBuffer attn;       // [rows][q]
  DeviceBuffer gate_up;    // [rows][2 intermediate]
  DeviceBuffer act;        // [rows][intermediate]
  DeviceBuffer logits;     // fp32 [kLogitRowsPerChunk][vocab]
  DeviceBuffer step_ints;  // tokens | positions | slots | logit rows
  PinnedHostBuffer step_ints_host;
  // forward_sampled: per logit row params in, SampledRow (+ top lists) out; the weights
  // workspace is allocated on the first step that samples (kLogitRowsPerChunk rows).
  DeviceBuffer sampling_params, sampled, sampled_top, sampling_workspace;
  PinnedHostBuffer sampling_params_host, sampled_host, sampled_top_host;
  kernels::DevicePlan plan;
  kernels::DeftAttentionBuffers partials;
  kernels::PrefillAttentionBuffers prefill_scratch;  // split-KV partials of long prefixes
  kernels::AttentionDims dims;
  bool deft_kernels = false;
  bool skinny_gemm = false;  // set_skinny_gemm

  size_t weight_bytes = 0, activation_bytes = 0, kv_bytes = 0;

  // Step timing (set_step_timing): events[i] ends interval i, which belongs to phase[i].
  enum Phase { kAttention, kGemm, kOther, kCopy, kSampling };
  StepTiming timing = StepTiming::kOff;
  std::vector<cudaEvent_t> events;
  std::vector<Phase> phase;
  int32_t marks = 0;
  StepTimes times;

  void mark_start() {
    marks = 0;
    if (timing != StepTiming::kOff) record(kCopy);
  }
  // The work launched since the previous mark was of `p` (kPhases only).
  void mark(Phase p) {
    if (timing == StepTiming::kPhases) record(p);
  }
  void mark_end(Phase p) {
    if (timing != StepTiming::kOff) record(p);
  }
  void record(Phase p) {
    if (marks == static_cast<int32_t>(events.size())) {
      cudaEvent_t event;
      DEFT_CUDA_CHECK(cudaEventCreate(&event));
      events.push_back(event);
      phase.push_back(p);
    }
    phase[marks] = p;
    DEFT_CUDA_CHECK(cudaEventRecord(events[marks], stream));
    ++marks;
  }
  // After the stream synchronised.
  void collect_times() {
    times = StepTimes{};
    if (timing == StepTiming::kOff || marks < 2) return;
    float ms = 0;
    DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events[0], events[marks - 1]));
    times.total_ms = ms;
    if (timing == StepTiming::kPhases) {
      for (int32_t i = 1; i < marks; ++i) {
        DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
        double* sum = phase[i] == kAttention ? &times.attention_ms
                      : phase[i] == kGemm    ? &times.gemm_ms
                      : phase[i] == kOther   ? &times.other_ms
                      : phase[i] == kSampling ? &times.sampling_ms
                                             : &times.copy_ms;
        *sum += ms;
      }
    }
    times.valid = true;
  }

  State() {
    DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DEFT_CUBLAS_CHECK(cublasCreate(&cublas));
    DEFT_CUBLAS_CHECK(cublasSetStream(cublas, stream));
  }
  ~State() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (cudaEvent_t event : events) cudaEventDestroy(event);
    if (cublas != nullptr) cublasDestroy(cublas);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // y[rows][out] (= or +=) x[rows][in] * w[out][in]^T, fp32 accumulation; y is `dtype` or fp32.
  // With skinny_gemm on, steps of up to kSkinnyGemmMaxRows rows (decode) stream the weights
  // through kernels/skinny_gemm.h, larger ones use cuBLAS. Off by default: on the H100 cuBLAS
  // was as fast or faster on every Llama-3-8B shape (bench/results/skinny_gemm-h100-*.json).
  void gemm(const void* x, const void* w, int32_t rows, int32_t in, int32_t out, void* y,
            bool y_fp32, bool accumulate) const {
    const kernels::SkinnyGemmDims dims{.rows = rows, .in = in, .out = out};
    if (skinny_gemm && rows <= kernels::kSkinnyGemmMaxRows &&
        kernels::skinny_gemm_supported(dims, x, w)) {
      kernels::launch_skinny_gemm(dims, dtype, x, w, y, y_fp32, accumulate, stream);
      return;
    }
    const float alpha = 1.0f;
    const float beta = accumulate ? 1.0f : 0.0f;
    // Column-major view: y^T [out x rows] = w^T' [out x in] * x^T [in x rows].
    DEFT_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, w,
                                   cuda_type(dtype), in, x, cuda_type(dtype), in, &beta, y,
                                   y_fp32 ? CUDA_R_32F : cuda_type(dtype), out, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
  }
};

LlamaCudaRunner::LlamaCudaRunner() = default;
LlamaCudaRunner::~LlamaCudaRunner() = default;

namespace {

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
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("llama_cuda: no CUDA device visible");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: device ", options.device, " outside [0, ", count, ")"));
  }
  DEFT_CUDA_CHECK(cudaSetDevice(options.device));
  return absl::OkStatus();
}

kernels::DType model_dtype(const ModelConfig& config) {
  return config.torch_dtype == DType::kF16 ? kernels::DType::kFp16 : kernels::DType::kBf16;
}

}  // namespace

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
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, checkpoint);
  if (!weights.ok()) return weights.status();

  std::unique_ptr<LlamaCudaRunner> runner(new LlamaCudaRunner());
  runner->config_ = config;
  runner->info_.name = std::move(name);
  runner->state_ = std::make_unique<State>();
  State& s = *runner->state_;
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
  s.step_ints.reset(rows * 4 * sizeof(int32_t));
  s.step_ints_host.reset(rows * 4 * sizeof(int32_t));
  s.sampling_params.reset(rows * sizeof(kernels::RowSamplingParams));
  s.sampling_params_host.reset(rows * sizeof(kernels::RowSamplingParams));
  s.sampled.reset(rows * sizeof(kernels::SampledRow));
  s.sampled_host.reset(rows * sizeof(kernels::SampledRow));
  s.sampled_top.reset(rows * kernels::kSamplingMaxTopLogprobs * sizeof(kernels::SampledTop));
  s.sampled_top_host.reset(rows * kernels::kSamplingMaxTopLogprobs * sizeof(kernels::SampledTop));
  // DeFT partials for up to two entries per query row to start with; they grow on demand.
  if (s.deft_kernels) s.partials.reserve(static_cast<int32_t>(2 * rows), s.dims);
  s.activation_bytes = s.residual.bytes() + s.normed.bytes() + s.qkv.bytes() + s.q.bytes() +
                       s.attn.bytes() + s.gate_up.bytes() + s.act.bytes() + s.logits.bytes() +
                       s.step_ints.bytes() + s.sampling_params.bytes() + s.sampled.bytes() +
                       s.sampled_top.bytes() +
                       (s.deft_kernels ? 2 * rows * (c.q_size() + c.num_attention_heads) * 4 : 0);

  // The KV pool from what is left.
  size_t free_bytes = 0, total_bytes = 0;
  DEFT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t slot_bytes = static_cast<size_t>(c.num_hidden_layers) * 2 * c.kv_size() * e;
  int64_t slots = options.num_kv_slots;
  if (slots == 0) {
    slots = static_cast<int64_t>(static_cast<double>(free_bytes) * options.kv_memory_fraction /
                                 static_cast<double>(slot_bytes));
    slots -= slots % options.page_tokens;
    if (slots <= 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("llama_cuda: ", free_bytes / kMiB,
                       " MiB free after weights and activations: no room "
                       "for one KV page"));
    }
  } else if (static_cast<size_t>(slots) * slot_bytes > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("llama_cuda: ", slots, " KV slots need ",
                                                     slots * slot_bytes / kMiB, " MiB but only ",
                                                     free_bytes / kMiB, " MiB are free"));
  }
  const size_t cache_bytes = static_cast<size_t>(slots) * c.kv_size() * e;
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
      "({:.1f} KiB per token), attention: {}",
      info_.name, info_.family, info_.num_layers, c.hidden_size, info_.vocab_size,
      kernels::dtype_name(s.dtype), total_bytes / kMiB, s.weight_bytes / kMiB,
      s.activation_bytes / kMiB, s.max_rows, s.kv_bytes / kMiB, slots, slot_bytes / 1024.0,
      s.deft_kernels ? "DeFT kernels" : "generic kernel (head_dim not built for DeFT)");
  return absl::OkStatus();
}

size_t LlamaCudaRunner::weight_bytes() const { return state_->weight_bytes; }
size_t LlamaCudaRunner::activation_bytes() const { return state_->activation_bytes; }
size_t LlamaCudaRunner::kv_cache_bytes() const { return state_->kv_bytes; }
bool LlamaCudaRunner::uses_deft_kernels() const { return state_->deft_kernels; }
void LlamaCudaRunner::set_step_timing(StepTiming timing) { state_->timing = timing; }
void LlamaCudaRunner::set_skinny_gemm(bool on) { state_->skinny_gemm = on; }
void LlamaCudaRunner::time_attention(bool on) {
  state_->timing = on ? StepTiming::kPhases : StepTiming::kOff;
}
double LlamaCudaRunner::last_attention_seconds() const {
  return state_->times.valid && state_->timing == StepTiming::kPhases
             ? state_->times.attention_ms * 1e-3
             : -1.0;
}
const StepTimes& LlamaCudaRunner::last_step_times() const { return state_->times; }

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
  const bool sample = !sampling.empty();
  if (batch.plan == nullptr) return absl::InvalidArgumentError("llama_cuda: step without a plan");
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  const int32_t vocab = config_.vocab_size;
  State& s = *state_;
  if (static_cast<int64_t>(batch.tokens.size()) != rows ||
      static_cast<int64_t>(plan.query_position.size()) != rows ||
      static_cast<int64_t>(plan.query_slot.size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cuda: the plan has ", rows, " query rows but the step carries ",
                     batch.tokens.size(), " tokens, ", plan.query_position.size(),
                     " positions and ", plan.query_slot.size(), " slots"));
  }
  if (rows > s.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: the step has ", rows, " query rows, more than max_batch_rows ", s.max_rows));
  }
  for (int32_t r = 0; r < rows; ++r) {
    if (batch.tokens[r] < 0 || batch.tokens[r] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " has token ",
                                                     batch.tokens[r],
                                                     ", outside the vocabulary [0, ", vocab, ")"));
    }
    if (plan.query_slot[r] < 0 || plan.query_slot[r] >= info_.num_kv_slots) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: row ", r, " writes KV slot ",
                                                     plan.query_slot[r], ", outside [0, ",
                                                     info_.num_kv_slots, ")"));
    }
    if (plan.query_position[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("llama_cuda: row ", r, " has position ", plan.query_position[r]));
    }
  }
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  if (logit_rows > s.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cuda: ", logit_rows, " logit rows, more than max_batch_rows ", s.max_rows));
  }
  for (int32_t i = 0; i < logit_rows; ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= rows) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: logit row ", i, " is ",
                                                     batch.logit_rows[i], ", outside the ", rows,
                                                     " query rows"));
    }
  }
  if (!sample && logits.size() != static_cast<size_t>(logit_rows) * vocab) {
    return absl::InvalidArgumentError(absl::StrCat("llama_cuda: logits hold ", logits.size(),
                                                   " floats, expected ", logit_rows, " rows x ",
                                                   vocab));
  }
  // The kernels trust the plan; a slot outside the pool would read out of bounds.
  for (int32_t slot : plan.kv_slots) {
    if (slot < 0 || slot >= info_.num_kv_slots) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cuda: the plan reads KV slot ", slot,
                                                     ", outside [0, ", info_.num_kv_slots, ")"));
    }
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
  s.times = StepTimes{};
  if (rows == 0) return absl::OkStatus();
  bool any_top_logprobs = false;
  if (sample) {
    bool any_draw = false;
    auto* params = s.sampling_params_host.as<kernels::RowSamplingParams>();
    for (int32_t i = 0; i < logit_rows; ++i) {
      const engine::SamplingParams& p = *sampling[i].params;
      params[i] = {.temperature = p.temperature,
                   .top_k = p.top_k,
                   .top_p = p.top_p,
                   .top_logprobs = p.top_logprobs,
                   .seed = p.seed,
                   .step = sampling[i].step};
      any_draw |= p.temperature != 0.0f && p.top_k != 1;
      any_top_logprobs |= p.top_logprobs > 0;
    }
    const size_t workspace_bytes = kernels::sampling_workspace_bytes(
        std::min(kLogitRowsPerChunk, logit_rows), vocab);
    if (any_draw && s.sampling_workspace.bytes() < workspace_bytes) {
      s.sampling_workspace.reset(
          kernels::sampling_workspace_bytes(kLogitRowsPerChunk, vocab));
    }
  }

  const ModelConfig& c = config_;
  const int32_t hidden = c.hidden_size;
  const int32_t q_size = c.q_size();
  const int32_t qkv_width = q_size + 2 * c.kv_size();
  const int32_t intermediate = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Step inputs: one pinned staging buffer, one copy. The previous step synchronised at its
  // end, so the staging buffer is free.
  s.mark_start();
  int32_t* host = s.step_ints_host.as<int32_t>();
  std::copy(batch.tokens.begin(), batch.tokens.end(), host);
  std::copy(plan.query_position.begin(), plan.query_position.end(), host + rows);
  std::copy(plan.query_slot.begin(), plan.query_slot.end(), host + 2 * rows);
  std::copy(batch.logit_rows.begin(), batch.logit_rows.end(), host + 3 * rows);
  DEFT_CUDA_CHECK(cudaMemcpyAsync(s.step_ints.data(), host,
                                  sizeof(int32_t) * (3 * static_cast<size_t>(rows) + logit_rows),
                                  cudaMemcpyHostToDevice, s.stream));
  const int32_t* d_tokens = s.step_ints.as<int32_t>();
  const int32_t* d_positions = d_tokens + rows;
  const int32_t* d_slots = d_tokens + 2 * rows;
  const int32_t* d_logit_rows = d_tokens + 3 * rows;
  if (sample && logit_rows > 0) {
    DEFT_CUDA_CHECK(cudaMemcpyAsync(s.sampling_params.data(), s.sampling_params_host.data(),
                                    sizeof(kernels::RowSamplingParams) * logit_rows,
                                    cudaMemcpyHostToDevice, s.stream));
  }
  s.plan.upload(plan.view(), s.stream);
  if (s.deft_kernels) s.partials.reserve(plan.num_entries(), s.dims);
  s.mark(State::kCopy);

  float* residual = s.residual.as<float>();
  kernels::launch_embedding(rows, hidden, s.dtype, d_tokens, s.embed.data(), residual, s.stream);
  const kernels::QkvRopeDims qkv_dims{.num_tokens = rows,
                                      .num_q_heads = c.num_attention_heads,
                                      .num_kv_heads = c.num_key_value_heads,
                                      .head_dim = c.head_dim};
  const kernels::RmsNormDims norm_dims{.num_rows = rows, .width = hidden, .eps = eps};
  for (State::Layer& layer : s.layers) {
    kernels::launch_rms_norm(norm_dims, s.dtype, nullptr, residual, nullptr,
                             layer.input_norm.as<float>(), s.normed.data(), s.stream);
    s.mark(State::kOther);
    s.gemm(s.normed.data(), layer.qkv.data(), rows, hidden, qkv_width, s.qkv.data(), false, false);
    s.mark(State::kGemm);
    kernels::launch_qkv_rope_write(qkv_dims, s.dtype, d_positions, d_slots, s.inv_freq.as<float>(),
                                   s.qkv.data(), layer.qkv_bias.as<float>(), s.q.data(),
                                   layer.k_cache.data(), layer.v_cache.data(), s.stream);
    s.mark(State::kOther);
    if (s.deft_kernels) {
      kernels::launch_deft_attention(s.plan, s.dims, s.dtype, s.q.data(), layer.k_cache.data(),
                                     layer.v_cache.data(), s.partials, s.attn.data(), s.stream);
      // Rows of the plan's prefill runs (no DeFT entries): the tiled causal kernel.
      kernels::launch_prefill_attention(s.plan.view(), s.plan.prefill_runs(), s.dims, s.dtype,
                                        s.q.data(), layer.k_cache.data(), layer.v_cache.data(),
                                        s.prefill_scratch, s.attn.data(), s.stream);
    } else {  // the generic kernel runs the plan's tasks and prefill runs
      kernels::launch_tree_attention_generic(s.plan.view(), s.dims, s.dtype, s.q.data(),
                                             layer.k_cache.data(), layer.v_cache.data(),
                                             s.attn.data(), s.stream);
    }
    s.mark(State::kAttention);
    s.gemm(s.attn.data(), layer.o_proj.data(), rows, q_size, hidden, residual, true, true);
    s.mark(State::kGemm);
    // The O projection's bias (Llama with attention_bias) is folded into the residual here.
    kernels::launch_rms_norm(norm_dims, s.dtype, nullptr, residual, layer.o_bias.as<float>(),
                             layer.post_norm.as<float>(), s.normed.data(), s.stream);
    s.mark(State::kOther);
    s.gemm(s.normed.data(), layer.gate_up.data(), rows, hidden, 2 * intermediate, s.gate_up.data(),
           false, false);
    s.mark(State::kGemm);
    kernels::launch_silu_mul(rows, intermediate, s.dtype, s.gate_up.data(), s.act.data(), s.stream);
    s.mark(State::kOther);
    s.gemm(s.act.data(), layer.down.data(), rows, intermediate, hidden, residual, true, true);
    s.mark(State::kGemm);
  }

  if (logit_rows > 0) {
    // Final norm of the logit rows only (gathered), then the LM head in chunks of rows.
    kernels::launch_rms_norm({.num_rows = logit_rows, .width = hidden, .eps = eps}, s.dtype,
                             d_logit_rows, residual, nullptr, s.norm.as<float>(), s.normed.data(),
                             s.stream);
    s.mark(State::kOther);
    const void* lm_head = c.tie_word_embeddings ? s.embed.data() : s.lm_head.data();
    const size_t row_bytes = kernels::dtype_bytes(s.dtype) * hidden;
    for (int32_t begin = 0; begin < logit_rows; begin += kLogitRowsPerChunk) {
      const int32_t count = std::min(kLogitRowsPerChunk, logit_rows - begin);
      s.gemm(static_cast<const char*>(s.normed.data()) + row_bytes * begin, lm_head, count, hidden,
             vocab, s.logits.data(), true, false);
      s.mark(State::kGemm);
      if (sample) {
        kernels::launch_sample_rows(
            {.num_rows = count, .vocab_size = vocab, .row_stride = vocab}, s.logits.as<float>(),
            s.sampling_params.as<kernels::RowSamplingParams>() + begin,
            s.sampling_workspace.as<float>(), s.sampled.as<kernels::SampledRow>() + begin,
            s.sampled_top.as<kernels::SampledTop>() +
                static_cast<size_t>(begin) * kernels::kSamplingMaxTopLogprobs,
            s.stream);
        s.mark(State::kSampling);
        continue;
      }
      DEFT_CUDA_CHECK(cudaMemcpyAsync(logits.data() + static_cast<size_t>(begin) * vocab,
                                      s.logits.data(), sizeof(float) * count * vocab,
                                      cudaMemcpyDeviceToHost, s.stream));
      s.mark(State::kCopy);
    }
    if (sample) {
      DEFT_CUDA_CHECK(cudaMemcpyAsync(s.sampled_host.data(), s.sampled.data(),
                                      sizeof(kernels::SampledRow) * logit_rows,
                                      cudaMemcpyDeviceToHost, s.stream));
      if (any_top_logprobs) {
        DEFT_CUDA_CHECK(cudaMemcpyAsync(
            s.sampled_top_host.data(), s.sampled_top.data(),
            sizeof(kernels::SampledTop) * kernels::kSamplingMaxTopLogprobs * logit_rows,
            cudaMemcpyDeviceToHost, s.stream));
      }
      s.mark(State::kCopy);
    }
  }
  s.mark_end(State::kCopy);
  DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.collect_times();
  if (sample) {
    const auto* rows_out = s.sampled_host.as<kernels::SampledRow>();
    const auto* tops = s.sampled_top_host.as<kernels::SampledTop>();
    for (int32_t i = 0; i < logit_rows; ++i) {
      const kernels::SampledRow& row = rows_out[i];
      if (row.status != kernels::kSampledOk) {
        return absl::InternalError(absl::StrCat(
            "llama_cuda: logit row ", i, " (query row ", batch.logit_rows[i], "): ",
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
