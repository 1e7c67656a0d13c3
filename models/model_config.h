// A Hugging Face `config.json` of a Llama-family model, parsed and checked: Llama 1/2,
// Llama 3/3.1/3.2 (llama3 RoPE scaling), CodeLlama, Mistral and Qwen2. Anything this server
// cannot run exactly (another architecture, a RoPE scaling type, an activation, a sliding
// window shorter than the context) is refused with a message naming the field and its value,
// never silently approximated.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "models/dtype.h"

namespace deft::models {

enum class ModelFamily : uint8_t {
  kLlama,    // LlamaForCausalLM: Llama 1/2/3/3.1/3.2, CodeLlama
  kMistral,  // MistralForCausalLM
  kQwen2,    // Qwen2ForCausalLM: bias on q/k/v projections
};
std::string_view model_family_name(ModelFamily family);

enum class RopeScalingType : uint8_t {
  kNone,    // absent, null, or rope_type "default"
  kLinear,  // position interpolation: every frequency divided by `factor`
  kLlama3,  // Llama 3.1: low frequencies divided by `factor`, a smooth ramp in between
};

// The largest RoPE scaling factor parse_model_config accepts.
inline constexpr double kMaxRopeScalingFactor = 1024.0;

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;                  // llama3 only
  double high_freq_factor = 4.0;                 // llama3 only
  int64_t original_max_position_embeddings = 0;  // llama3 only
};

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  std::string model_type;    // e.g. "llama" (empty when the file has none)
  ModelFamily family = ModelFamily::kLlama;

  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_hidden_layers = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;  // defaults to num_attention_heads
  int32_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  int32_t vocab_size = 0;
  bool tie_word_embeddings = false;
  // `torch_dtype` (or `dtype`, its newer name); float32 when absent, as transformers assumes.
  DType torch_dtype = DType::kF32;
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;  // `eos_token_id` may be one id or a list
  bool attention_bias = false;         // bias on q_proj, k_proj, v_proj
  bool o_proj_bias = false;  // bias on o_proj (Llama's attention_bias sets both; Qwen2 only qkv)
  std::optional<int64_t> sliding_window;  // recorded when present; never below the context

  int32_t q_size() const { return num_attention_heads * head_dim; }
  int32_t kv_size() const { return num_key_value_heads * head_dim; }
  int32_t gqa_group_size() const { return num_attention_heads / num_key_value_heads; }
};

// Parses the text of a config.json. INVALID_ARGUMENT names the field and value refused.
absl::StatusOr<ModelConfig> parse_model_config(std::string_view json_text);

// Reads `path`: a config.json file, or a model directory holding one.
absl::StatusOr<ModelConfig> load_model_config(const std::filesystem::path& path);

// RoPE inverse frequencies, head_dim / 2 of them: theta^(-2i/head_dim), then the config's
// scaling. float32 in the order of transformers' rope initialisation
// (`_compute_default_rope_parameters`, `_compute_llama3_parameters`): within one ulp of
// transformers 5.17 for every family (tests/models/hf_interop_test.cc), so the CPU runner,
// the GPU runner and the tests share one definition.
std::vector<float> rope_inverse_frequencies(const ModelConfig& config);

}  // namespace deft::models
