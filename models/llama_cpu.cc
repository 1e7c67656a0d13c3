#include "models/llama_cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/deft_attention_cpu.h"
#include "models/llama_checkpoint.h"
#include "models/tensor_parallel_runner.h"
#include "spdlog/spdlog.h"

namespace deft::models {

struct LlamaCpuRunner::Layer {
  std::vector<float> input_layernorm, post_attention_layernorm;
  std::vector<float> q_proj, k_proj, v_proj, o_proj;  // [out][in], as in the checkpoint
  std::vector<float> q_bias, k_bias, v_bias, o_bias;  // empty when the model has none
  std::vector<float> gate_proj, up_proj, down_proj;
};

namespace {

// Dot product with eight independent partial sums: the compiler can keep them in one vector
// register, and the rounding stays close to a BLAS's blocked sum (parity tests ask 1e-4).
inline float dot(const float* a, const float* b, int32_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int32_t j = 0; j < 8; ++j) partial[j] += a[i + j] * b[i + j];
  }
  float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
              ((partial[4] + partial[5]) + (partial[6] + partial[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[rows][out] = x[rows][in] * w[out][in]^T (+ bias[out]), nn.Linear's layout. Blocks of rows
// share each weight row while it is in L1; blocks of weight rows stay in L2 across row blocks.
void linear(const float* x, int32_t rows, int32_t in, const std::vector<float>& w,
            const std::vector<float>& bias, int32_t out, float* y) {
  constexpr int32_t kRowBlock = 4;
  constexpr int32_t kOutBlock = 64;
  for (int32_t o0 = 0; o0 < out; o0 += kOutBlock) {
    const int32_t o1 = std::min(out, o0 + kOutBlock);
    for (int32_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int32_t r1 = std::min(rows, r0 + kRowBlock);
      for (int32_t o = o0; o < o1; ++o) {
        const float* w_row = w.data() + static_cast<size_t>(o) * in;
        const float b = bias.empty() ? 0.0f : bias[o];
        for (int32_t r = r0; r < r1; ++r) {
          y[static_cast<size_t>(r) * out + o] = dot(x + static_cast<size_t>(r) * in, w_row, in) + b;
        }
      }
    }
  }
}

// transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, in fp32.
void rms_norm(const float* x, int32_t rows, int32_t width, const std::vector<float>& weight,
              float eps, float* y) {
  for (int32_t r = 0; r < rows; ++r) {
    const float* in = x + static_cast<size_t>(r) * width;
    float* out = y + static_cast<size_t>(r) * width;
    double sum_squares = 0.0;
    for (int32_t i = 0; i < width; ++i) sum_squares += double{in[i]} * in[i];
    const float variance = static_cast<float>(sum_squares / width);
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int32_t i = 0; i < width; ++i) out[i] = weight[i] * (in[i] * inv_rms);
  }
}

// RoPE in the Hugging Face layout (rotate_half): dimension i pairs with i + head_dim / 2, both
// rotated by the angle position * inv_freq[i] (the angle in fp32, as transformers computes it).
void apply_rope(float* x, int32_t rows, int32_t heads, int32_t head_dim,
                std::span<const int32_t> positions, const std::vector<float>& inv_freq) {
  const int32_t half = head_dim / 2;
  std::vector<float> cos_table(half), sin_table(half);
  for (int32_t r = 0; r < rows; ++r) {
    const float position = static_cast<float>(positions[r]);
    for (int32_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];
      cos_table[i] = std::cos(angle);
      sin_table[i] = std::sin(angle);
    }
    for (int32_t h = 0; h < heads; ++h) {
      float* v = x + (static_cast<size_t>(r) * heads + h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float x1 = v[i];
        const float x2 = v[i + half];
        v[i] = x1 * cos_table[i] - x2 * sin_table[i];
        v[i + half] = x2 * cos_table[i] + x1 * sin_table[i];
      }
    }
  }
}

absl::Status to_floats(const TensorView& tensor, std::vector<float>& out) {
  out.resize(static_cast<size_t>(tensor.numel()));
  return tensor_to_floats(tensor, out);
}

absl::Status to_floats(const std::optional<TensorView>& tensor, std::vector<float>& out) {
  if (!tensor) {
    out.clear();
    return absl::OkStatus();
  }
  return to_floats(*tensor, out);
}

}  // namespace

LlamaCpuRunner::~LlamaCpuRunner() = default;

absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> LlamaCpuRunner::load(
    const std::filesystem::path& model_dir, int64_t num_kv_slots) {
  absl::StatusOr<ModelConfig> config = load_model_config(model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return create(*config, *checkpoint, num_kv_slots, model_dir.string());
}

absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> LlamaCpuRunner::create(
    const ModelConfig& config, const SafetensorsSet& checkpoint, int64_t num_kv_slots,
    std::string name, TensorParallelRank tp, HostCollectives* collectives) {
  if (num_kv_slots <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cpu: num_kv_slots must be positive, got ", num_kv_slots));
  }
  if (absl::Status status = check_tensor_parallel(config, tp.ranks); !status.ok()) return status;
  DEFT_CHECK(tp.ranks == 1 || (collectives != nullptr && collectives->ranks() == tp.ranks),
             "llama_cpu: rank %d of %d without collectives of that many ranks", tp.rank, tp.ranks);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, checkpoint);
  if (!weights.ok()) return weights.status();

  std::unique_ptr<LlamaCpuRunner> runner(new LlamaCpuRunner());
  runner->config_ = shard_config(config, tp.ranks);
  runner->tp_ = tp;
  runner->collectives_ = collectives;
  runner->vocab_ = vocab_shard(config.vocab_size, tp);
  runner->inv_freq_ = rope_inverse_frequencies(config);
  // This rank's part of each tensor (models/tensor_parallel.h), as floats.
  const ShardRange q_rows = even_shard(config.q_size(), tp);
  const ShardRange kv_rows = even_shard(config.kv_size(), tp);
  const ShardRange mlp_rows = even_shard(config.intermediate_size, tp);
  const VocabShard& vocab = runner->vocab_;
  absl::Status status = absl::OkStatus();
  const auto take = [&](const TensorView& tensor, ShardAxis axis, int64_t begin, int64_t count,
                        int64_t padded, std::vector<float>& out) {
    if (status.ok())
      status = to_floats(TensorShard(tensor, axis, begin, count, padded).view(), out);
  };
  const auto take_even = [&](const TensorView& tensor, ShardAxis axis, ShardRange range,
                             std::vector<float>& out) {
    take(tensor, axis, range.begin, range.count, range.count, out);
  };
  const auto take_optional = [&](const std::optional<TensorView>& tensor, ShardRange range,
                                 std::vector<float>& out) {
    if (tensor) {
      take_even(*tensor, ShardAxis::kRows, range, out);
    } else {
      out.clear();
    }
  };
  take(weights->embed_tokens, ShardAxis::kRows, vocab.begin, vocab.count, vocab.rows,
       runner->embed_tokens_);
  if (status.ok()) status = to_floats(weights->norm, runner->norm_);
  if (!config.tie_word_embeddings) {
    take(weights->lm_head, ShardAxis::kRows, vocab.begin, vocab.count, vocab.rows,
         runner->lm_head_);
  }
  runner->layers_.resize(weights->layers.size());
  for (size_t i = 0; i < weights->layers.size() && status.ok(); ++i) {
    const LlamaLayerWeights& from = weights->layers[i];
    Layer& to = runner->layers_[i];
    if (status.ok()) status = to_floats(from.input_layernorm, to.input_layernorm);
    if (status.ok()) status = to_floats(from.post_attention_layernorm, to.post_attention_layernorm);
    take_even(from.q_proj, ShardAxis::kRows, q_rows, to.q_proj);
    take_even(from.k_proj, ShardAxis::kRows, kv_rows, to.k_proj);
    take_even(from.v_proj, ShardAxis::kRows, kv_rows, to.v_proj);
    take_even(from.o_proj, ShardAxis::kColumns, q_rows, to.o_proj);
    take_even(from.gate_proj, ShardAxis::kRows, mlp_rows, to.gate_proj);
    take_even(from.up_proj, ShardAxis::kRows, mlp_rows, to.up_proj);
    take_even(from.down_proj, ShardAxis::kColumns, mlp_rows, to.down_proj);
    take_optional(from.q_bias, q_rows, to.q_bias);
    take_optional(from.k_bias, kv_rows, to.k_bias);
    take_optional(from.v_bias, kv_rows, to.v_bias);
    // The O bias is added once, to the reduced residual: whole on every rank.
    if (status.ok()) status = to_floats(from.o_bias, to.o_bias);
  }
  if (!status.ok()) return status;
  const ModelConfig& shard = runner->config_;

  const size_t cache_floats = static_cast<size_t>(num_kv_slots) * shard.kv_size();
  runner->k_cache_.assign(config.num_hidden_layers, std::vector<float>(cache_floats, 0.0f));
  runner->v_cache_.assign(config.num_hidden_layers, std::vector<float>(cache_floats, 0.0f));

  engine::ModelInfo& info = runner->info_;
  info.name = std::move(name);
  info.family = std::string(model_family_name(config.family));
  info.vocab_size = config.vocab_size;
  info.num_layers = config.num_hidden_layers;
  info.max_position = config.max_position_embeddings;
  info.num_kv_slots = num_kv_slots;
  spdlog::info(
      "llama_cpu: loaded {} ({}, {} layers, hidden {}, vocab {}, rank {} of {}): "
      "{:.1f} MiB weights, {:.1f} MiB KV for {} slots",
      info.name, info.family, info.num_layers, config.hidden_size, info.vocab_size, tp.rank,
      tp.ranks, runner->weight_bytes() / 1048576.0, runner->kv_cache_bytes() / 1048576.0,
      num_kv_slots);
  return runner;
}

size_t LlamaCpuRunner::weight_bytes() const {
  size_t floats = embed_tokens_.size() + norm_.size() + lm_head_.size();
  for (const Layer& layer : layers_) {
    for (const std::vector<float>* tensor :
         {&layer.input_layernorm, &layer.post_attention_layernorm, &layer.q_proj, &layer.k_proj,
          &layer.v_proj, &layer.o_proj, &layer.q_bias, &layer.k_bias, &layer.v_bias,
          &layer.o_bias, &layer.gate_proj, &layer.up_proj, &layer.down_proj}) {
      floats += tensor->size();
    }
  }
  return floats * sizeof(float);
}

size_t LlamaCpuRunner::kv_cache_bytes() const {
  size_t floats = 0;
  for (const std::vector<float>& cache : k_cache_) floats += cache.size();
  for (const std::vector<float>& cache : v_cache_) floats += cache.size();
  return floats * sizeof(float);
}

absl::Status LlamaCpuRunner::forward(const engine::StepBatch& batch, std::span<float> logits) {
  if (batch.plan == nullptr) return absl::InvalidArgumentError("llama_cpu: step without a plan");
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  const int32_t vocab = config_.vocab_size;
  if (static_cast<int64_t>(batch.tokens.size()) != rows ||
      static_cast<int64_t>(plan.query_position.size()) != rows ||
      static_cast<int64_t>(plan.query_slot.size()) != rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama_cpu: the plan has ", rows, " query rows but the step carries ",
        batch.tokens.size(), " tokens, ", plan.query_position.size(), " positions and ",
        plan.query_slot.size(), " slots"));
  }
  for (int32_t r = 0; r < rows; ++r) {
    if (batch.tokens[r] < 0 || batch.tokens[r] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cpu: row ", r, " has token ",
                                                     batch.tokens[r], ", outside the vocabulary [0, ",
                                                     vocab, ")"));
    }
    if (plan.query_slot[r] < 0 || plan.query_slot[r] >= info_.num_kv_slots) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cpu: row ", r, " writes KV slot ",
                                                     plan.query_slot[r], ", outside [0, ",
                                                     info_.num_kv_slots, ")"));
    }
    if (plan.query_position[r] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cpu: row ", r, " has position ",
                                                     plan.query_position[r]));
    }
  }
  for (size_t i = 0; i < batch.logit_rows.size(); ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= rows) {
      return absl::InvalidArgumentError(absl::StrCat("llama_cpu: logit row ", i, " is ",
                                                     batch.logit_rows[i], ", outside the ", rows,
                                                     " query rows"));
    }
  }
  // Ranks after the first write no logits (rank 0 assembles them).
  const size_t logits_expected = tp_.rank == 0 ? batch.logit_rows.size() * size_t(vocab) : 0;
  if (logits.size() != logits_expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama_cpu: logits hold ", logits.size(), " floats, expected ",
                     logits_expected / std::max(vocab, 1), " rows x ", vocab));
  }
  if (rows == 0) return absl::OkStatus();

  const int32_t hidden = config_.hidden_size;
  double attention_seconds = 0.0;
  const int32_t heads = config_.num_attention_heads;
  const int32_t kv_heads = config_.num_key_value_heads;
  const int32_t head_dim = config_.head_dim;
  const int32_t q_size = config_.q_size();
  const int32_t kv_size = config_.kv_size();
  const int32_t intermediate = config_.intermediate_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const size_t n = static_cast<size_t>(rows);
  hidden_.resize(n * hidden);
  normed_.resize(n * hidden);
  q_.resize(n * q_size);
  k_.resize(n * kv_size);
  v_.resize(n * kv_size);
  attn_.resize(n * q_size);
  proj_.resize(n * hidden);
  gate_.resize(n * intermediate);
  up_.resize(n * intermediate);

  // Embedding rows of the tokens this rank holds, zeros for the others; their sum is the lookup.
  for (int32_t r = 0; r < rows; ++r) {
    float* row = hidden_.data() + static_cast<size_t>(r) * hidden;
    const int32_t local = batch.tokens[r] - vocab_.begin;
    if (local >= 0 && local < vocab_.count) {
      std::memcpy(row, embed_tokens_.data() + static_cast<size_t>(local) * hidden,
                  sizeof(float) * hidden);
    } else {
      std::fill(row, row + hidden, 0.0f);
    }
  }
  // The residual plus this rank's partial: rank 0 adds it, the others hand in the partial alone,
  // and the all-reduce sums them (models/tensor_parallel.h).
  const auto reduce_into_residual = [&](const std::vector<float>& partial, bool add) {
    if (add) {
      for (size_t i = 0; i < n * hidden; ++i) hidden_[i] += partial[i];
    } else {
      std::copy(partial.begin(), partial.begin() + static_cast<ptrdiff_t>(n * hidden),
                hidden_.begin());
    }
    if (tp_.ranks > 1) collectives_->all_reduce_sum(tp_.rank, {hidden_.data(), n * hidden});
  };
  if (tp_.ranks > 1) collectives_->all_reduce_sum(tp_.rank, {hidden_.data(), n * hidden});
  const std::vector<float> no_bias;
  const kernels::AttentionPlanView view = plan.view();
  kernels::AttentionDims dims;
  dims.num_q_heads = heads;
  dims.num_kv_heads = kv_heads;
  dims.head_dim = head_dim;
  dims.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));

  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    // Attention block.
    rms_norm(hidden_.data(), rows, hidden, layer.input_layernorm, eps, normed_.data());
    linear(normed_.data(), rows, hidden, layer.q_proj, layer.q_bias, q_size, q_.data());
    linear(normed_.data(), rows, hidden, layer.k_proj, layer.k_bias, kv_size, k_.data());
    linear(normed_.data(), rows, hidden, layer.v_proj, layer.v_bias, kv_size, v_.data());
    apply_rope(q_.data(), rows, heads, head_dim, plan.query_position, inv_freq_);
    apply_rope(k_.data(), rows, kv_heads, head_dim, plan.query_position, inv_freq_);
    float* k_cache = k_cache_[l].data();
    float* v_cache = v_cache_[l].data();
    for (int32_t r = 0; r < rows; ++r) {
      const size_t slot = static_cast<size_t>(plan.query_slot[r]);
      std::memcpy(k_cache + slot * kv_size, k_.data() + static_cast<size_t>(r) * kv_size,
                  sizeof(float) * kv_size);
      std::memcpy(v_cache + slot * kv_size, v_.data() + static_cast<size_t>(r) * kv_size,
                  sizeof(float) * kv_size);
    }
    const auto attention_start = std::chrono::steady_clock::now();
    kernels::deft_attention_cpu(view, dims, q_.data(), k_cache, v_cache, attn_.data());
    attention_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                       attention_start).count();
    // One rank: the bias inside the product, as before; several: added once, after the sum.
    linear(attn_.data(), rows, q_size, layer.o_proj, tp_.ranks == 1 ? layer.o_bias : no_bias,
           hidden, proj_.data());
    reduce_into_residual(proj_, tp_.rank == 0);
    if (tp_.ranks > 1 && !layer.o_bias.empty()) {
      for (size_t i = 0; i < n * hidden; ++i) hidden_[i] += layer.o_bias[i % hidden];
    }

    // MLP block: down(silu(gate(x)) * up(x)).
    rms_norm(hidden_.data(), rows, hidden, layer.post_attention_layernorm, eps, normed_.data());
    linear(normed_.data(), rows, hidden, layer.gate_proj, {}, intermediate, gate_.data());
    linear(normed_.data(), rows, hidden, layer.up_proj, {}, intermediate, up_.data());
    for (size_t i = 0; i < n * intermediate; ++i) {
      const float g = gate_[i];
      gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];
    }
    linear(gate_.data(), rows, intermediate, layer.down_proj, {}, hidden, proj_.data());
    reduce_into_residual(proj_, tp_.rank == 0);
  }
  attention_seconds_ = attention_seconds;

  // Final norm and LM head, only for the rows whose logits are wanted.
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  if (logit_rows == 0) return absl::OkStatus();
  logit_hidden_.resize(static_cast<size_t>(logit_rows) * hidden);
  for (int32_t i = 0; i < logit_rows; ++i) {
    rms_norm(hidden_.data() + static_cast<size_t>(batch.logit_rows[i]) * hidden, 1, hidden, norm_,
             eps, logit_hidden_.data() + static_cast<size_t>(i) * hidden);
  }
  const std::vector<float>& head = config_.tie_word_embeddings ? embed_tokens_ : lm_head_;
  if (tp_.ranks == 1) {
    linear(logit_hidden_.data(), logit_rows, hidden, head, {}, vocab, logits.data());
    return absl::OkStatus();
  }
  // Each rank's vocabulary rows, gathered: [ranks][logit_rows][vocab_.rows]; rank 0 lays them
  // out as [logit_rows][vocab] (the last shard's padding dropped).
  const size_t shard_floats = static_cast<size_t>(logit_rows) * vocab_.rows;
  shard_logits_.resize(shard_floats);
  gathered_logits_.resize(shard_floats * tp_.ranks);
  linear(logit_hidden_.data(), logit_rows, hidden, head, {}, vocab_.rows, shard_logits_.data());
  collectives_->all_gather(tp_.rank, shard_logits_, gathered_logits_);
  if (tp_.rank != 0) return absl::OkStatus();
  for (int32_t r = 0; r < tp_.ranks; ++r) {
    const VocabShard part = vocab_shard(vocab, {.rank = r, .ranks = tp_.ranks});
    for (int32_t i = 0; i < logit_rows; ++i) {
      const float* from =
          gathered_logits_.data() + r * shard_floats + static_cast<size_t>(i) * vocab_.rows;
      std::copy(from, from + part.count,
                logits.data() + static_cast<size_t>(i) * vocab + part.begin);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> LlamaCpuRunner::load_tensor_parallel(
    const std::filesystem::path& model_dir, int64_t num_kv_slots, int32_t ranks) {
  absl::StatusOr<ModelConfig> config = load_model_config(model_dir);
  if (!config.ok()) return config.status();
  // The checkpoint's mapping must outlive the ranks only while they load (weights are copied).
  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return create_tensor_parallel(*config, *checkpoint, num_kv_slots, ranks, model_dir.string());
}

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> LlamaCpuRunner::create_tensor_parallel(
    const ModelConfig& config, const SafetensorsSet& checkpoint, int64_t num_kv_slots,
    int32_t ranks, std::string name) {
  if (absl::Status status = check_tensor_parallel(config, ranks); !status.ok()) return status;
  auto collectives = std::make_shared<HostCollectives>(ranks);
  std::vector<std::unique_ptr<engine::ModelRunner>> shards;
  for (int32_t r = 0; r < ranks; ++r) {
    absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> shard = create(
        config, checkpoint, num_kv_slots, name, {.rank = r, .ranks = ranks}, collectives.get());
    if (!shard.ok()) return shard.status();
    shards.push_back(std::move(*shard));
  }
  return std::make_unique<TensorParallelRunner>(std::move(shards), std::move(collectives));
}

}  // namespace deft::models
