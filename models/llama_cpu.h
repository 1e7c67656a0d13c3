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
#include "models/model_config.h"
#include "models/safetensors.h"

namespace deft::models {

class LlamaCpuRunner final : public engine::ModelRunner {
 public:
  // Loads `model_dir` (config.json + *.safetensors, any of f32/f16/bf16) and sizes the KV cache
  // for `num_kv_slots` slots (the KvCacheManager's num_slots()). Errors name the file, tensor
  // or field at fault.
  static absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> load(
      const std::filesystem::path& model_dir, int64_t num_kv_slots);
  // The same from a parsed config and an open checkpoint (tests build these in memory).
  static absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> create(
      const ModelConfig& config, const SafetensorsSet& checkpoint, int64_t num_kv_slots,
      std::string name = "");

  ~LlamaCpuRunner() override;

  const engine::ModelInfo& info() const override { return info_; }
  const ModelConfig& config() const { return config_; }
  absl::Status forward(const engine::StepBatch& batch, std::span<float> logits) override;
  // Always timed (a clock read per layer).
  double last_attention_seconds() const override { return attention_seconds_; }

  // Bytes of fp32 weights and of the KV cache held.
  size_t weight_bytes() const;
  size_t kv_cache_bytes() const;

 private:
  double attention_seconds_ = -1.0;
  struct Layer;
  LlamaCpuRunner() = default;

  ModelConfig config_;
  engine::ModelInfo info_;
  std::vector<float> inv_freq_;  // RoPE inverse frequencies, head_dim / 2
  std::vector<float> embed_tokens_;
  std::vector<Layer> layers_;
  std::vector<float> norm_;
  std::vector<float> lm_head_;  // empty when tied to embed_tokens_
  // Per layer: [num_kv_slots][kv_heads][head_dim].
  std::vector<std::vector<float>> k_cache_, v_cache_;

  // Scratch reused across steps.
  std::vector<float> hidden_, normed_, q_, k_, v_, attn_, proj_, gate_, up_, logit_hidden_;
};

}  // namespace deft::models
