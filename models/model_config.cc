#include "models/model_config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <numbers>
#include <sstream>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/string_compat.h"
#include "nlohmann/json.hpp"

namespace deft::models {
namespace {

using nlohmann::json;

using engine::str_cat;

absl::Status refuse(std::string_view field, const json& value, std::string_view why) {
  return absl::InvalidArgumentError(
      str_cat("config.json: field '", field, "' = ", value.dump(), ": ", why));
}

absl::Status missing(std::string_view field) {
  return absl::InvalidArgumentError(str_cat("config.json: required field '", field, "' is missing"));
}

// Treats an explicit null like an absent field, as transformers does for optional fields.
const json* find_field(const json& object, std::string_view field) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer field; integral floats (4096.0) are accepted, anything else is refused.
absl::StatusOr<int64_t> as_int(const json& value, std::string_view field) {
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double number = value.get<double>();
    if (std::isfinite(number) && number == std::floor(number) && std::fabs(number) < 9.0e15) {
      return static_cast<int64_t>(number);
    }
  }
  return refuse(field, value, "expected an integer");
}

absl::StatusOr<double> as_number(const json& value, std::string_view field) {
  if (value.is_number()) {
    const double number = value.get<double>();
    if (std::isfinite(number)) return number;
  }
  return refuse(field, value, "expected a finite number");
}

// A positive integer that fits int32 (a size of the model).
absl::Status read_size(const json& config, std::string_view field, int32_t* out, bool required,
                       int32_t fallback = 0) {
  const json* value = find_field(config, field);
  if (value == nullptr) {
    if (required) return missing(field);
    *out = fallback;
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> number = as_int(*value, field);
  if (!number.ok()) return number.status();
  if (*number <= 0 || *number > INT32_MAX) return refuse(field, *value, "expected a positive size");
  *out = static_cast<int32_t>(*number);
  return absl::OkStatus();
}

absl::Status read_bool(const json& config, std::string_view field, bool* out, bool fallback) {
  const json* value = find_field(config, field);
  if (value == nullptr) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!value->is_boolean()) return refuse(field, *value, "expected true or false");
  *out = value->get<bool>();
  return absl::OkStatus();
}

absl::Status read_token_id(const json& value, std::string_view field, int32_t vocab_size,
                           int32_t* out) {
  absl::StatusOr<int64_t> id = as_int(value, field);
  if (!id.ok()) return id.status();
  if (*id < 0 || *id >= vocab_size) {
    return refuse(field, value, str_cat("token id outside the vocabulary [0, ", vocab_size, ")"));
  }
  *out = static_cast<int32_t>(*id);
  return absl::OkStatus();
}

absl::StatusOr<ModelFamily> family_of_architecture(const json& value) {
  if (!value.is_string()) return refuse("architectures", value, "expected a list of strings");
  const std::string name = value.get<std::string>();
  // "LLaMAForCausalLM": the spelling of the earliest Llama 1 conversions.
  if (name == "LlamaForCausalLM" || name == "LLaMAForCausalLM") return ModelFamily::kLlama;
  if (name == "MistralForCausalLM") return ModelFamily::kMistral;
  if (name == "Qwen2ForCausalLM") return ModelFamily::kQwen2;
  return refuse("architectures", value,
                "unsupported architecture (supported: LlamaForCausalLM, MistralForCausalLM, "
                "Qwen2ForCausalLM)");
}

absl::Status read_architecture(const json& config, ModelConfig* out) {
  if (const json* type = find_field(config, "model_type"); type != nullptr) {
    if (!type->is_string()) return refuse("model_type", *type, "expected a string");
    out->model_type = type->get<std::string>();
  }
  if (const json* list = find_field(config, "architectures"); list != nullptr) {
    if (!list->is_array() || list->empty()) {
      return refuse("architectures", *list, "expected a non-empty list of strings");
    }
    if (list->size() > 1) {
      return refuse("architectures", *list, "expected exactly one architecture");
    }
    absl::StatusOr<ModelFamily> family = family_of_architecture((*list)[0]);
    if (!family.ok()) return family.status();
    out->family = *family;
    out->architecture = (*list)[0].get<std::string>();
    return absl::OkStatus();
  }
  // No architectures list: fall back to model_type.
  if (out->model_type == "llama") {
    out->family = ModelFamily::kLlama;
    out->architecture = "LlamaForCausalLM";
  } else if (out->model_type == "mistral") {
    out->family = ModelFamily::kMistral;
    out->architecture = "MistralForCausalLM";
  } else if (out->model_type == "qwen2") {
    out->family = ModelFamily::kQwen2;
    out->architecture = "Qwen2ForCausalLM";
  } else if (out->model_type.empty()) {
    return missing("architectures");
  } else {
    return refuse("model_type", config["model_type"],
                  "unsupported model type (supported: llama, mistral, qwen2)");
  }
  return absl::OkStatus();
}

absl::Status read_dtype(const json& config, ModelConfig* out) {
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  std::string_view field = "torch_dtype";
  const json* value = find_field(config, field);
  if (value == nullptr) {
    field = "dtype";
    value = find_field(config, field);
  }
  if (value == nullptr) {
    out->torch_dtype = DType::kF32;
    return absl::OkStatus();
  }
  const std::string name = value->is_string() ? value->get<std::string>() : "";
  if (name == "bfloat16") {
    out->torch_dtype = DType::kBF16;
  } else if (name == "float16") {
    out->torch_dtype = DType::kF16;
  } else if (name == "float32") {
    out->torch_dtype = DType::kF32;
  } else {
    return refuse(field, *value, "unsupported dtype (supported: bfloat16, float16, float32)");
  }
  return absl::OkStatus();
}

// `rope_scaling` (transformers < 5) or `rope_parameters` (transformers 5, which also moves
// rope_theta inside it).
absl::Status read_rope(const json& config, ModelConfig* out) {
  std::string prefix = "rope_scaling";
  const json* rope = find_field(config, "rope_scaling");
  if (const json* parameters = find_field(config, "rope_parameters"); parameters != nullptr) {
    if (rope != nullptr) {
      return refuse("rope_parameters", *parameters, "both rope_scaling and rope_parameters given");
    }
    rope = parameters;
    prefix = "rope_parameters";
  }
  if (const json* theta = find_field(config, "rope_theta"); theta != nullptr) {
    absl::StatusOr<double> value = as_number(*theta, "rope_theta");
    if (!value.ok()) return value.status();
    out->rope_theta = *value;
  }
  if (rope == nullptr) return absl::OkStatus();
  if (!rope->is_object()) return refuse(prefix, *rope, "expected an object or null");

  if (const json* theta = find_field(*rope, "rope_theta"); theta != nullptr) {
    absl::StatusOr<double> value = as_number(*theta, prefix + ".rope_theta");
    if (!value.ok()) return value.status();
    out->rope_theta = *value;
  }
  std::string type_field = prefix + ".rope_type";
  const json* type = find_field(*rope, "rope_type");
  if (type == nullptr) {
    type_field = prefix + ".type";  // the older key
    type = find_field(*rope, "type");
  }
  if (type == nullptr) return refuse(prefix, *rope, "no rope_type given");
  const std::string type_name = type->is_string() ? type->get<std::string>() : "";
  RopeScaling& scaling = out->rope_scaling;
  if (type_name == "default") {
    scaling.type = RopeScalingType::kNone;
    return absl::OkStatus();
  }
  if (type_name == "linear") {
    scaling.type = RopeScalingType::kLinear;
  } else if (type_name == "llama3") {
    scaling.type = RopeScalingType::kLlama3;
  } else {
    return refuse(type_field, *type,
                  "unsupported RoPE scaling type (supported: default, linear, llama3)");
  }

  auto read_number = [&](std::string_view key, double* value) -> absl::Status {
    const json* field = find_field(*rope, key);
    if (field == nullptr) return missing(str_cat(prefix, ".", key));
    absl::StatusOr<double> number = as_number(*field, str_cat(prefix, ".", key));
    if (!number.ok()) return number.status();
    *value = *number;
    return absl::OkStatus();
  };
  if (absl::Status status = read_number("factor", &scaling.factor); !status.ok()) return status;
  // Published models stretch their context up to 64x; past kMaxRopeScalingFactor the fp32 RoPE
  // frequencies divided by the factor underflow to 0 (a factor of 1e300 is inf in fp32).
  if (!(scaling.factor >= 1.0 && scaling.factor <= kMaxRopeScalingFactor)) {
    return refuse(prefix + ".factor", (*rope)["factor"],
                  str_cat("expected a factor in [1, ", kMaxRopeScalingFactor, "]"));
  }
  if (scaling.type != RopeScalingType::kLlama3) return absl::OkStatus();

  if (absl::Status status = read_number("low_freq_factor", &scaling.low_freq_factor);
      !status.ok()) {
    return status;
  }
  if (absl::Status status = read_number("high_freq_factor", &scaling.high_freq_factor);
      !status.ok()) {
    return status;
  }
  if (!(scaling.low_freq_factor > 0.0 && scaling.high_freq_factor > scaling.low_freq_factor)) {
    return refuse(
        prefix + ".high_freq_factor", (*rope)["high_freq_factor"],
        str_cat("expected 0 < low_freq_factor (", scaling.low_freq_factor, ") < high_freq_factor"));
  }
  const json* original = find_field(*rope, "original_max_position_embeddings");
  if (original == nullptr) return missing(prefix + ".original_max_position_embeddings");
  absl::StatusOr<int64_t> original_length =
      as_int(*original, prefix + ".original_max_position_embeddings");
  if (!original_length.ok()) return original_length.status();
  if (*original_length <= 0) {
    return refuse(prefix + ".original_max_position_embeddings", *original,
                  "expected a positive length");
  }
  scaling.original_max_position_embeddings = *original_length;
  return absl::OkStatus();
}

// transformers 5 lists each layer's attention; a sliding layer is only acceptable when its
// window covers the whole context (checked below), anything else is refused.
absl::Status check_layer_types(const json& config) {
  const json* types = find_field(config, "layer_types");
  if (types == nullptr) return absl::OkStatus();
  if (!types->is_array()) return refuse("layer_types", *types, "expected a list of strings");
  for (const json& type : *types) {
    if (!type.is_string() || (type.get<std::string>() != "full_attention" &&
                              type.get<std::string>() != "sliding_attention")) {
      return refuse("layer_types", type,
                    "unsupported layer type (supported: full_attention, and sliding_attention "
                    "with a window covering max_position_embeddings)");
    }
  }
  return absl::OkStatus();
}

absl::Status read_sliding_window(const json& config, ModelConfig* out) {
  if (absl::Status status = check_layer_types(config); !status.ok()) return status;
  const json* window = find_field(config, "sliding_window");
  if (window == nullptr) return absl::OkStatus();
  if (out->family == ModelFamily::kQwen2) {
    // Qwen2 applies its window only when use_sliding_window is true.
    bool use_window = false;
    if (absl::Status status = read_bool(config, "use_sliding_window", &use_window, false);
        !status.ok()) {
      return status;
    }
    if (!use_window) return absl::OkStatus();
  } else if (out->family == ModelFamily::kLlama) {
    return absl::OkStatus();  // LlamaForCausalLM has no sliding window
  }
  absl::StatusOr<int64_t> length = as_int(*window, "sliding_window");
  if (!length.ok()) return length.status();
  if (*length < out->max_position_embeddings) {
    return refuse("sliding_window", *window,
                  str_cat("sliding-window attention is not supported, and this window is "
                      "shorter than max_position_embeddings (",
                      out->max_position_embeddings, ")"));
  }
  out->sliding_window = *length;
  return absl::OkStatus();
}

absl::Status check_unsupported_extras(const json& config, const ModelConfig& out) {
  if (const json* act = find_field(config, "hidden_act"); act != nullptr) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return refuse("hidden_act", *act, "unsupported activation (supported: silu)");
    }
  }
  if (const json* act = find_field(config, "hidden_activation"); act != nullptr) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return refuse("hidden_activation", *act, "unsupported activation (supported: silu)");
    }
  }
  bool mlp_bias = false;
  if (absl::Status status = read_bool(config, "mlp_bias", &mlp_bias, false); !status.ok()) {
    return status;
  }
  if (mlp_bias && out.family == ModelFamily::kLlama) {
    return refuse("mlp_bias", config["mlp_bias"], "MLP biases are not supported");
  }
  if (const json* partial = find_field(config, "partial_rotary_factor"); partial != nullptr) {
    absl::StatusOr<double> factor = as_number(*partial, "partial_rotary_factor");
    if (!factor.ok()) return factor.status();
    if (*factor != 1.0) {
      return refuse("partial_rotary_factor", *partial, "partial RoPE is not supported");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> parse_object(const json& config) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError("config.json: the top level is not a JSON object");
  }
  ModelConfig out;
  if (absl::Status status = read_architecture(config, &out); !status.ok()) return status;

  if (absl::Status status = read_size(config, "hidden_size", &out.hidden_size, true); !status.ok())
    return status;
  if (absl::Status status = read_size(config, "intermediate_size", &out.intermediate_size, true);
      !status.ok())
    return status;
  if (absl::Status status = read_size(config, "num_hidden_layers", &out.num_hidden_layers, true);
      !status.ok())
    return status;
  if (absl::Status status =
          read_size(config, "num_attention_heads", &out.num_attention_heads, true);
      !status.ok())
    return status;
  if (absl::Status status = read_size(config, "num_key_value_heads", &out.num_key_value_heads,
                                      false, out.num_attention_heads);
      !status.ok())
    return status;
  if (out.num_attention_heads % out.num_key_value_heads != 0) {
    return refuse("num_key_value_heads", config["num_key_value_heads"],
                  str_cat("must divide num_attention_heads (", out.num_attention_heads, ")"));
  }
  if (find_field(config, "head_dim") == nullptr && out.hidden_size % out.num_attention_heads != 0) {
    return refuse(
        "num_attention_heads", config["num_attention_heads"],
        str_cat("must divide hidden_size (", out.hidden_size, ") when head_dim is not given"));
  }
  if (absl::Status status = read_size(config, "head_dim", &out.head_dim, false,
                                      out.hidden_size / out.num_attention_heads);
      !status.ok())
    return status;
  if (out.head_dim % 2 != 0) {
    return refuse("head_dim", json(out.head_dim), "RoPE needs an even head_dim");
  }
  // q_size() and the runners' projection shapes are int32 (KV heads never outnumber them).
  if (const int64_t q_width = int64_t{out.num_attention_heads} * out.head_dim;
      q_width > std::numeric_limits<int32_t>::max()) {
    return refuse("head_dim", json(out.head_dim),
                  str_cat("num_attention_heads (", out.num_attention_heads,
                          ") x head_dim = ", q_width, " exceeds 2^31 - 1"));
  }
  if (absl::Status status = read_size(config, "vocab_size", &out.vocab_size, true); !status.ok())
    return status;
  // transformers' defaults when the field is absent.
  const int32_t default_max_positions = out.family == ModelFamily::kLlama     ? 2048
                                        : out.family == ModelFamily::kMistral ? 4096 * 32
                                                                              : 32768;
  int32_t max_positions = 0;
  if (absl::Status status = read_size(config, "max_position_embeddings", &max_positions, false,
                                      default_max_positions);
      !status.ok())
    return status;
  out.max_position_embeddings = max_positions;

  if (const json* eps = find_field(config, "rms_norm_eps"); eps != nullptr) {
    absl::StatusOr<double> value = as_number(*eps, "rms_norm_eps");
    if (!value.ok()) return value.status();
    if (*value <= 0.0) return refuse("rms_norm_eps", *eps, "expected a positive epsilon");
    out.rms_norm_eps = *value;
  }
  if (absl::Status status = read_rope(config, &out); !status.ok()) return status;
  // The RoPE frequencies are float32 (as in transformers): a base float32 cannot hold as a
  // positive normal number gives infinite or zero frequencies.
  if (const float base = static_cast<float>(out.rope_theta);
      !(out.rope_theta > 0.0) || !std::isfinite(base) || base < std::numeric_limits<float>::min()) {
    return refuse("rope_theta", json(out.rope_theta),
                  "expected a positive base in float32's normal range");
  }
  if (out.rope_scaling.type == RopeScalingType::kLlama3 &&
      out.rope_scaling.original_max_position_embeddings > out.max_position_embeddings) {
    return refuse("rope_scaling.original_max_position_embeddings",
                  json(out.rope_scaling.original_max_position_embeddings),
                  str_cat("exceeds max_position_embeddings (", out.max_position_embeddings, ")"));
  }
  if (absl::Status status =
          read_bool(config, "tie_word_embeddings", &out.tie_word_embeddings, false);
      !status.ok())
    return status;
  if (absl::Status status = read_dtype(config, &out); !status.ok()) return status;

  switch (out.family) {
    case ModelFamily::kLlama: {
      if (absl::Status status = read_bool(config, "attention_bias", &out.attention_bias, false);
          !status.ok())
        return status;
      out.o_proj_bias = out.attention_bias;
      break;
    }
    case ModelFamily::kMistral:
      break;  // MistralForCausalLM has no attention biases
    case ModelFamily::kQwen2:
      out.attention_bias = true;
      out.o_proj_bias = false;
      break;
  }

  if (const json* bos = find_field(config, "bos_token_id"); bos != nullptr) {
    int32_t id = 0;
    if (absl::Status status = read_token_id(*bos, "bos_token_id", out.vocab_size, &id);
        !status.ok())
      return status;
    out.bos_token_id = id;
  }
  if (const json* eos = find_field(config, "eos_token_id"); eos != nullptr) {
    if (eos->is_array()) {
      for (const json& item : *eos) {
        int32_t id = 0;
        if (absl::Status status = read_token_id(item, "eos_token_id", out.vocab_size, &id);
            !status.ok())
          return status;
        out.eos_token_ids.push_back(id);
      }
    } else {
      int32_t id = 0;
      if (absl::Status status = read_token_id(*eos, "eos_token_id", out.vocab_size, &id);
          !status.ok())
        return status;
      out.eos_token_ids.push_back(id);
    }
  }
  if (absl::Status status = read_sliding_window(config, &out); !status.ok()) return status;
  if (absl::Status status = check_unsupported_extras(config, out); !status.ok()) return status;
  return out;
}

}  // namespace

std::string_view model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kMistral:
      return "mistral";
    case ModelFamily::kQwen2:
      return "qwen2";
  }
  return "?";
}

absl::StatusOr<ModelConfig> parse_model_config(std::string_view json_text) {
  const json config = json::parse(json_text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) {
    return absl::InvalidArgumentError("config.json: not well-formed JSON");
  }
  try {
    return parse_object(config);
  } catch (const json::exception& error) {
    // Every access above checks the type first; this is the backstop that keeps a JSON
    // surprise an error rather than a crash.
    return absl::InvalidArgumentError(str_cat("config.json: ", error.what()));
  }
}

absl::StatusOr<ModelConfig> load_model_config(const std::filesystem::path& path) {
  std::error_code error;
  const std::filesystem::path file =
      std::filesystem::is_directory(path, error) ? path / "config.json" : path;
  std::ifstream stream(file, std::ios::binary);
  if (!stream) {
    return absl::NotFoundError(str_cat("cannot open model config '", file.string(), "'"));
  }
  std::ostringstream text;
  text << stream.rdbuf();
  absl::StatusOr<ModelConfig> config = parse_model_config(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        str_cat(file.string(), ": ", config.status().message()));
  }
  return config;
}

std::vector<float> rope_inverse_frequencies(const ModelConfig& config) {
  const int32_t half = config.head_dim / 2;
  const float base = static_cast<float>(config.rope_theta);
  const float dim = static_cast<float>(config.head_dim);
  std::vector<float> inv_freq(half);
  for (int32_t i = 0; i < half; ++i) {
    // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all float32.
    const float exponent = static_cast<float>(2 * i) / dim;
    // The power in double, rounded once: torch's vectorised float pow is itself within one
    // ulp, so the two agree to one ulp (tests/models/hf_interop_test.cc).
    inv_freq[i] = 1.0f / static_cast<float>(
                             std::pow(static_cast<double>(base), static_cast<double>(exponent)));
  }
  const RopeScaling& scaling = config.rope_scaling;
  if (scaling.type == RopeScalingType::kLinear) {
    for (float& value : inv_freq) value /= static_cast<float>(scaling.factor);
  } else if (scaling.type == RopeScalingType::kLlama3) {
    // transformers' _compute_llama3_parameters: wavelengths longer than the original context
    // / low_freq_factor are divided by `factor`, shorter than / high_freq_factor kept, and the
    // band between interpolated smoothly.
    const float factor = static_cast<float>(scaling.factor);
    const float low_freq_factor = static_cast<float>(scaling.low_freq_factor);
    const float high_freq_factor = static_cast<float>(scaling.high_freq_factor);
    const float old_context = static_cast<float>(scaling.original_max_position_embeddings);
    const float low_freq_wavelen = old_context / low_freq_factor;
    const float high_freq_wavelen = old_context / high_freq_factor;
    for (float& value : inv_freq) {
      const float wavelen = 2.0f * std::numbers::pi_v<float> / value;
      if (wavelen > low_freq_wavelen) {
        value = value / factor;
      } else if (!(wavelen < high_freq_wavelen)) {
        const float smooth =
            (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        value = (1.0f - smooth) * value / factor + smooth * value;
      }
    }
  }
  return inv_freq;
}

}  // namespace deft::models
