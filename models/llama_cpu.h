// CPU backend of the Llama-family runner (Llama 1/2/3, CodeLlama, Mistral, Qwen2): fp32
// weights and KV cache in host memory, attention through the CPU reference of the DeFT kernels
// (kernels/deft_attention_cpu.h) on the engine's plan. It serves CI, the tests (parity with
// transformers) and machines without a GPU; it is written to be obviously right first and
// reasonably fast second (row-blocked matrix products, no threads).
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "models/host_collectives.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tensor_parallel.h"

namespace deft::models {

class LlamaCpuRunner final : public engine::ModelRunner {
 public:
  // Loads `model_dir` (config.json + *.safetensors, any of f32/f16/bf16) and sizes the KV cache
  // for `num_kv_slots` slots (the KvCacheManager's num_slots()). Errors name the file, tensor
  // or field at fault.
  static absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> load(
      const std::filesystem::path& model_dir, int64_t num_kv_slots);
  // The same from a parsed config and an open checkpoint (tests build these in memory). With
  // `tp` of more than one rank: that rank's shard of the model (models/tensor_parallel.h), which
  // meets the other ranks through `collectives` (all ranks' runners share one) inside forward();
  // rank 0 writes the logits, the others take an empty `logits`.
  static absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> create(
      const ModelConfig& config, const SafetensorsSet& checkpoint, int64_t num_kv_slots,
      std::string name = "", TensorParallelRank tp = {}, HostCollectives* collectives = nullptr);
  // The CPU twin of tensor parallelism: `ranks` shards of the model, each on a thread of a
  // models/tensor_parallel_runner.h runner, summing their partial results through
  // HostCollectives. Its logits equal create()'s up to the order of float additions.
  static absl::StatusOr<std::unique_ptr<engine::ModelRunner>> create_tensor_parallel(
      const ModelConfig& config, const SafetensorsSet& checkpoint, int64_t num_kv_slots,
      int32_t ranks, std::string name = "");
  // The same from `model_dir` (the server's CPU backend with tensor_parallel > 1).
  static absl::StatusOr<std::unique_ptr<engine::ModelRunner>> load_tensor_parallel(
      const std::filesystem::path& model_dir, int64_t num_kv_slots, int32_t ranks);

  ~LlamaCpuRunner() override;

  const engine::ModelInfo& info() const override { return info_; }
  const ModelConfig& config() const { return config_; }
  absl::Status forward(const engine::StepBatch& batch, std::span<float> logits) override;
  // Always timed (a clock read per layer).
  double last_attention_seconds() const override { return attention_seconds_; }

  // Bytes of fp32 weights and of the KV cache held (this rank's shard).
  size_t weight_bytes() const;
  size_t kv_cache_bytes() const;

 private:
  double attention_seconds_ = -1.0;
  struct Layer;
  LlamaCpuRunner() = default;

  ModelConfig config_;  // this rank's shape (shard_config; the whole model at one rank)
  engine::ModelInfo info_;
  TensorParallelRank tp_;
  HostCollectives* collectives_ = nullptr;  // set when tp_.ranks > 1
  VocabShard vocab_;                        // the embedding and LM head rows held
  std::vector<float> inv_freq_;  // RoPE inverse frequencies, head_dim / 2
  std::vector<float> embed_tokens_;  // [vocab_.rows][hidden]
  std::vector<Layer> layers_;
  std::vector<float> norm_;
  std::vector<float> lm_head_;  // [vocab_.rows][hidden]; empty when tied to embed_tokens_
  // Per layer: [num_kv_slots][kv_heads][head_dim].
  std::vector<std::vector<float>> k_cache_, v_cache_;

  // Scratch reused across steps.
  std::vector<float> hidden_, normed_, q_, k_, v_, attn_, proj_, gate_, up_, logit_hidden_;
  std::vector<float> shard_logits_, gathered_logits_;  // tensor parallel: [rows][vocab_.rows]
};

}  // namespace deft::models
