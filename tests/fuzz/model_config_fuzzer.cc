// libFuzzer harness: config.json parsing (models/model_config.h), the input being the file's
// text; half of the mutations JSON-aware (tests/fuzz/json_mutator.h).
// Contracts checked:
//   - parse_model_config refuses with INVALID_ARGUMENT and never throws or crashes;
//   - an accepted config is one the runners can size themselves from: positive sizes, KV heads
//     dividing the query heads, an even head_dim, query and KV widths that fit the int32 shapes
//     of the runners, special token ids inside the vocabulary, RoPE scaling parameters in range,
//     and finite positive RoPE frequencies;
//   - the checkpoint layout it implies (expected_llama_tensors) has non-negative shapes. The
//     layer count is cut to 2 for that call: layers repeat, and a huge count is the
//     checkpoint binder's to refuse, not this parser's.
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/llama_checkpoint.h"
#include "models/model_config.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/json_mutator.h"

namespace {

using deft::models::ModelConfig;
using deft::models::RopeScalingType;

// Past this head_dim the RoPE table is not built here (an allocation of head_dim / 2 floats).
constexpr int32_t kMaxHeadDimForRope = 1 << 16;

void check_config(const ModelConfig& config) {
  FUZZ_CHECK(config.hidden_size > 0 && config.intermediate_size > 0 &&
                 config.num_hidden_layers > 0 && config.num_attention_heads > 0 &&
                 config.num_key_value_heads > 0 && config.head_dim > 0 && config.vocab_size > 0 &&
                 config.max_position_embeddings > 0,
             "a size is not positive");
  FUZZ_CHECK(config.num_attention_heads % config.num_key_value_heads == 0,
             absl::StrCat(config.num_key_value_heads, " KV heads for ", config.num_attention_heads,
                          " query heads"));
  FUZZ_CHECK(config.head_dim % 2 == 0, absl::StrCat("head_dim ", config.head_dim));
  const int64_t q_width = int64_t{config.num_attention_heads} * config.head_dim;
  FUZZ_CHECK(q_width <= INT32_MAX,
             absl::StrCat("num_attention_heads x head_dim = ", q_width, " overflows q_size()"));
  FUZZ_CHECK(config.q_size() == q_width && config.kv_size() > 0, "q_size / kv_size");
  FUZZ_CHECK(config.rms_norm_eps > 0.0, absl::StrCat("rms_norm_eps ", config.rms_norm_eps));
  if (config.bos_token_id.has_value()) {
    FUZZ_CHECK(*config.bos_token_id >= 0 && *config.bos_token_id < config.vocab_size,
               absl::StrCat("bos_token_id ", *config.bos_token_id));
  }
  for (int32_t eos : config.eos_token_ids) {
    FUZZ_CHECK(eos >= 0 && eos < config.vocab_size, absl::StrCat("eos_token_id ", eos));
  }
  const deft::models::RopeScaling& scaling = config.rope_scaling;
  if (scaling.type != RopeScalingType::kNone) {
    FUZZ_CHECK(scaling.factor >= 1.0, absl::StrCat("rope factor ", scaling.factor));
  }
  if (scaling.type == RopeScalingType::kLlama3) {
    FUZZ_CHECK(scaling.low_freq_factor > 0.0 && scaling.high_freq_factor > scaling.low_freq_factor,
               "llama3 frequency factors");
    FUZZ_CHECK(scaling.original_max_position_embeddings > 0 &&
                   scaling.original_max_position_embeddings <= config.max_position_embeddings,
               "llama3 original_max_position_embeddings");
  }
  if (config.head_dim <= kMaxHeadDimForRope) {
    const std::vector<float> inv_freq = deft::models::rope_inverse_frequencies(config);
    FUZZ_CHECK(static_cast<int32_t>(inv_freq.size()) == config.head_dim / 2, "RoPE table size");
    for (float value : inv_freq) {
      FUZZ_CHECK(std::isfinite(value) && value > 0.0f,
                 absl::StrCat("RoPE inverse frequency ", value, " (rope_theta ", config.rope_theta,
                              ", factor ", scaling.factor, ")"));
    }
  }
  ModelConfig two_layers = config;
  two_layers.num_hidden_layers = 2;
  for (const deft::models::ExpectedTensor& tensor :
       deft::models::expected_llama_tensors(two_layers)) {
    for (int64_t dim : tensor.shape) {
      FUZZ_CHECK(dim > 0, absl::StrCat(tensor.name, " has dimension ", dim));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<ModelConfig> config = deft::models::parse_model_config(text);
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument,
               config.status().ToString());
    return 0;
  }
  check_config(*config);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return deft::fuzz::mutate_json(data, size, max_size, seed, /*prefix_bytes=*/0);
}
