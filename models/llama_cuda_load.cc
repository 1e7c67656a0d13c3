// LlamaCudaRunner's construction (models/llama_cuda.h): checks the options, puts the weights on the
// GPU (from a checkpoint, rounded to the config's 16-bit dtype, q/k/v and gate/up fused; or seeded
// random ones), plans GPU memory from what is free (weights, activations for max_batch_rows query
// rows, the cuBLAS workspace, then the KV pool from what is left, one slot more for padded rows'
// K/V), and tunes the decode GEMMs before the KV pool takes the memory.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda_check.h"
#include "kernels/device_scope.h"
#include "kernels/llama_ops.h"
#include "kernels/tree_attention_generic.h"
#include "models/gemm_tuner.h"
#include "models/llama_checkpoint.h"
#include "models/llama_cuda.h"
#include "models/llama_cuda_state.h"
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
  if (absl::Status status = check_tensor_parallel(config, options.tp.ranks); !status.ok()) {
    return status;
  }
  const kernels::DeviceScope on_device(options.device);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, checkpoint);
  if (!weights.ok()) return weights.status();

  std::unique_ptr<LlamaCudaRunner> runner(new LlamaCudaRunner());
  const TensorParallelRank tp = options.tp;
  runner->config_ = shard_config(config, tp.ranks);
  runner->info_.name = std::move(name);
  runner->state_ = std::make_unique<State>();
  State& s = *runner->state_;
  s.device = options.device;
  s.tp = tp;
  s.comm = options.nccl_comm;
  if (options.peer_all_reduce && options.peer_table != nullptr) s.peer_table = *options.peer_table;
  s.vocab_part = vocab_shard(config.vocab_size, tp);
  s.dtype = model_dtype(config);
  // This rank's part of each tensor (models/tensor_parallel.h), read from the checkpoint's
  // mapping and uploaded to this rank's GPU; at one rank every part is the whole tensor.
  const ShardRange q_rows = even_shard(config.q_size(), tp);
  const ShardRange kv_rows = even_shard(config.kv_size(), tp);
  const ShardRange mlp_rows = even_shard(config.intermediate_size, tp);
  const auto part = [&](const TensorView& tensor, ShardAxis axis, ShardRange range) {
    return std::make_unique<TensorShard>(tensor, axis, range.begin, range.count, range.count);
  };
  // Embedding and LM head rows; several ranks: padded to vocab_part.rows, plus the embedding's
  // zero row for the tokens other ranks hold.
  const VocabShard& v = s.vocab_part;
  const int64_t embed_rows = tp.ranks == 1 ? v.rows : v.rows + 1;
  s.embed = upload_16bit(
      {&TensorShard(weights->embed_tokens, ShardAxis::kRows, v.begin, v.count, embed_rows).view()},
      s.dtype);
  s.norm = upload_fp32(weights->norm);
  if (!config.tie_word_embeddings) {
    s.lm_head = upload_16bit(
        {&TensorShard(weights->lm_head, ShardAxis::kRows, v.begin, v.count, v.rows).view()},
        s.dtype);
  }
  s.layers.resize(weights->layers.size());
  for (size_t l = 0; l < weights->layers.size(); ++l) {
    const LlamaLayerWeights& from = weights->layers[l];
    State::Layer& to = s.layers[l];
    to.input_norm = upload_fp32(from.input_layernorm);
    to.post_norm = upload_fp32(from.post_attention_layernorm);
    to.qkv = upload_16bit({&part(from.q_proj, ShardAxis::kRows, q_rows)->view(),
                           &part(from.k_proj, ShardAxis::kRows, kv_rows)->view(),
                           &part(from.v_proj, ShardAxis::kRows, kv_rows)->view()},
                          s.dtype);
    if (from.q_bias) {
      std::vector<float> bias;
      for (auto [tensor, range] :
           {std::pair{&*from.q_bias, q_rows}, std::pair{&*from.k_bias, kv_rows},
            std::pair{&*from.v_bias, kv_rows}}) {
        const std::vector<float> values =
            tensor_to_floats(part(*tensor, ShardAxis::kRows, range)->view());
        bias.insert(bias.end(), values.begin(), values.end());
      }
      to.qkv_bias = upload_floats(bias);
    }
    to.o_proj = upload_16bit({&part(from.o_proj, ShardAxis::kColumns, q_rows)->view()}, s.dtype);
    // The O bias is added once, to the reduced residual (in the RMSNorm after the all-reduce).
    if (from.o_bias) to.o_bias = upload_fp32(*from.o_bias);
    to.gate_up = upload_16bit({&part(from.gate_proj, ShardAxis::kRows, mlp_rows)->view(),
                               &part(from.up_proj, ShardAxis::kRows, mlp_rows)->view()},
                              s.dtype);
    to.down = upload_16bit({&part(from.down_proj, ShardAxis::kColumns, mlp_rows)->view()}, s.dtype);
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
  if (absl::Status status = check_tensor_parallel(config, options.tp.ranks); !status.ok()) {
    return status;
  }
  std::unique_ptr<LlamaCudaRunner> runner(new LlamaCudaRunner());
  runner->config_ = shard_config(config, options.tp.ranks);
  runner->config_.attention_bias = false;
  runner->config_.o_proj_bias = false;
  runner->info_.name = std::move(name);
  runner->state_ = std::make_unique<State>();
  State& s = *runner->state_;
  s.device = options.device;
  s.tp = options.tp;
  s.comm = options.nccl_comm;
  if (options.peer_all_reduce && options.peer_table != nullptr) s.peer_table = *options.peer_table;
  s.vocab_part = vocab_shard(config.vocab_size, options.tp);
  s.dtype = model_dtype(config);
  const ModelConfig& shard = runner->config_;
  seed += static_cast<uint64_t>(options.tp.rank) * 7919u;
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
  // Several ranks: the embedding's extra row (tokens of other ranks) is random too; the sum over
  // ranks is then not a lookup, which random-weight benchmarks do not mind.
  s.embed = matrix(s.vocab_part.rows + (s.tp.ranks > 1 ? 1 : 0), hidden, 1.0f);
  s.norm = upload_floats(ones);
  if (!config.tie_word_embeddings) s.lm_head = matrix(s.vocab_part.rows, hidden, fan_hidden);
  s.layers.resize(static_cast<size_t>(config.num_hidden_layers));
  for (State::Layer& layer : s.layers) {
    layer.input_norm = upload_floats(ones);
    layer.post_norm = upload_floats(ones);
    layer.qkv = matrix(shard.q_size() + 2 * shard.kv_size(), hidden, fan_hidden);
    layer.o_proj = matrix(hidden, shard.q_size(), 1.0f / std::sqrt(float(config.q_size())));
    layer.gate_up = matrix(2 * int64_t{shard.intermediate_size}, hidden, fan_hidden);
    layer.down = matrix(hidden, shard.intermediate_size,
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
  if (options.deterministic) {
    // Every GEMM on the skinny GEMM and stage 1 on warpgroup MMAs: both sm_90a code.
    if (!s.deft_kernels || !kernels::skinny_gemm_available() ||
        !kernels::deft_attention_batch_invariant_available()) {
      // Not FAILED_PRECONDITION: the server's backend "auto" would fall back to the CPU.
      return absl::UnimplementedError(absl::StrCat(
          "llama_cuda: deterministic mode needs the DeFT kernels (head_dim 64 or 128, this model: ",
          c.head_dim, ") and a compute 9.0 GPU with this binary's sm_90a code (skinny GEMM: ",
          kernels::skinny_gemm_available() ? "yes" : "no", ")"));
    }
    if (s.tp.ranks > 2 && s.peer_table.ranks <= 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "llama_cuda: deterministic mode at tensor parallel ", s.tp.ranks,
          " needs peer access between the GPUs (NCCL's summation order over more than two ranks "
          "depends on the step's size)"));
    }
    for (const int64_t in :
         {int64_t{c.hidden_size}, int64_t{c.q_size()}, int64_t{c.intermediate_size}}) {
      if (in % 8 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "llama_cuda: deterministic mode needs GEMM inputs of a multiple of 8 elements, not ",
            in));
      }
    }
    s.batch_invariant = true;
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
  if (s.tp.ranks > 1) {
    const size_t shard_bytes =
        static_cast<size_t>(kLogitRowsPerChunk) * s.vocab_part.rows * sizeof(float);
    s.logits_shard.reset(shard_bytes);
    s.logits_gathered.reset(shard_bytes * s.tp.ranks);
  }
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
  // Deterministic mode runs no cuBLAS GEMM: nothing to tune.
  if (options.tune_gemms && !s.batch_invariant) s.tune_gemms(c);
  s.use_graphs = options.cuda_graphs;
  s.prefetch_bytes = options.weight_prefetch_bytes;
  s.graphs.set_max_graphs(options.max_cuda_graphs);
  if (s.batch_invariant) kernels::skinny_gemm_reserve(s.stream);  // before any graph capture
  if (options.skinny_lm_head && kernels::skinny_gemm_available()) {
    s.skinny_gemm = SkinnyGemmUse::kLmHeadAndWide;
    kernels::skinny_gemm_reserve(s.stream);  // before any graph capture
  }
  s.activation_bytes = s.residual.bytes() + s.normed.bytes() + s.qkv.bytes() + s.q.bytes() +
                       s.attn.bytes() + s.gate_up.bytes() + s.act.bytes() + s.logits.bytes() +
                       s.logits_shard.bytes() + s.logits_gathered.bytes() + s.sampled.bytes() +
                       s.sampled_top.bytes() + s.cublas_workspace.bytes() +
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
    if (s.tp.ranks > 1) {
      // Every rank must hold the same slots: the fewest any rank has room for.
      DeviceBuffer agreed(sizeof(int64_t));
      DEFT_CUDA_CHECK(cudaMemcpy(agreed.data(), &slots, sizeof(slots), cudaMemcpyHostToDevice));
      DEFT_NCCL_CHECK(
          ncclAllReduce(agreed.data(), agreed.data(), 1, ncclInt64, ncclMin, s.comm, s.stream));
      DEFT_CUDA_CHECK(
          cudaMemcpyAsync(&slots, agreed.data(), sizeof(slots), cudaMemcpyDeviceToHost, s.stream));
      DEFT_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    }
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
      "llama_cuda: loaded {} ({}, {} layers, hidden {}, vocab {}, {}, rank {} of {} on device "
      "{}{}) "
      "on a GPU with {:.0f} MiB: "
      "{:.1f} MiB weights, {:.1f} MiB activations for {} rows, {:.1f} MiB KV for {} slots "
      "({:.1f} KiB per token), attention: {}, decode GEMMs on the skinny GEMM: {}, weight "
      "prefetch before decode GEMMs: {:.1f} MiB{}",
      info_.name, info_.family, info_.num_layers, c.hidden_size, info_.vocab_size,
      kernels::dtype_name(s.dtype), s.tp.rank, s.tp.ranks, s.device,
      s.tp.ranks == 1          ? ""
      : s.peer_table.ranks > 1 ? ", residual all-reduce: peer kernel up to 256 rows, NCCL above"
                               : ", residual all-reduce: NCCL",
      total_bytes / kMiB, s.weight_bytes / kMiB, s.activation_bytes / kMiB, s.max_rows,
      s.kv_bytes / kMiB, slots, slot_bytes / 1024.0,
      s.deft_kernels ? "DeFT kernels" : "generic kernel (head_dim not built for DeFT)",
      s.skinny_gemm == SkinnyGemmUse::kLmHeadAndWide
          ? absl::StrCat("LM head, and gate/up above ", kSkinnyWideAboveRows, " rows")
          : std::string("none"),
      static_cast<double>(s.prefetch_bytes) / kMiB,
      s.batch_invariant ? "; deterministic: every GEMM on the skinny GEMM, stage 1 on wgmma" : "");
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
    std::vector<Job> jobs = {{"qkv", shape(hidden, qkv_width, false, false), &qkv_w, normed.data(),
                              qkv.data(), num_layers},
                             {"o", shape(q_size, hidden, true, accumulates_residual()), &o_w,
                              attn.data(), residual.data(), num_layers},
                             {"gate_up", shape(hidden, 2 * intermediate, false, false), &gate_up_w,
                              normed.data(), gate_up.data(), num_layers},
                             {"down", shape(intermediate, hidden, true, accumulates_residual()),
                              &down_w, act.data(), residual.data(), num_layers}};
    if (rows <= kLogitRowsPerChunk) {
      jobs.push_back(
          {"lm_head", shape(hidden, tp.ranks == 1 ? c.vocab_size : vocab_part.rows, true, false),
           &head_w, normed.data(), tp.ranks == 1 ? logits.data() : logits_shard.data(), 1.0});
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

}  // namespace deft::models
