// config.json parsing under random edits of real configs: field values swapped for extreme or
// ill-typed ones (0, negatives, 2^31, 2^63, 1e308, fractions, strings, null, arrays, objects),
// fields dropped, and text-level damage (truncation, flipped or inserted characters). Every
// outcome is either a refusal with INVALID_ARGUMENT and a message, or a config whose shapes the
// runners can use as they are: positive sizes, a GQA group that divides the heads, an even head
// dimension, q/kv widths that fit in 32 bits, finite positive constants, token ids inside the
// vocabulary. Seeds are fixed (the failing one is printed).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "models/model_config.h"
#include "nlohmann/json.hpp"
#include "tests/models/hf_configs.h"
#include "tests/testing/fuzz_outcomes.h"

namespace deft::models {
namespace {

using nlohmann::json;

constexpr int kIterations = 20000;

const char* const kConfigs[] = {
    testing_configs::kLlama1_7B,     testing_configs::kLlama2_7B,
    testing_configs::kLlama3_8B,     testing_configs::kLlama31_8B,
    testing_configs::kLlama32_1B,    testing_configs::kCodeLlama7B,
    testing_configs::kMistral7B_v03, testing_configs::kMistral7B_v01,
    testing_configs::kQwen25_7B,     testing_configs::kQwen2_05B,
};

// Values that break assumptions somewhere: bounds, types, the overflow of a product of two.
json extreme_value(std::mt19937_64& rng) {
  static const std::vector<json> kValues = {
      0,
      -1,
      1,
      2,
      3,
      7,
      64,
      int64_t{1} << 16,
      int64_t{1} << 20,
      int64_t{1} << 31,
      (int64_t{1} << 31) - 1,
      std::numeric_limits<int64_t>::max(),
      std::numeric_limits<int64_t>::min(),
      std::numeric_limits<uint64_t>::max(),
      0.5,
      -0.5,
      1e-300,
      1e308,
      -1e308,
      "32",
      "NaN",
      "",
      nullptr,
      true,
      json::array(),
      json::array({1, 2}),
      json::object(),
      json::object({{"rope_type", "llama3"}, {"factor", 8.0}}),
      json::object({{"rope_type", "llama3"}, {"factor", 0.0}}),
      json::object({{"type", "linear"}, {"factor", -2.0}}),
  };
  return kValues[rng() % kValues.size()];
}

void edit_json(json& config, std::mt19937_64& rng) {
  if (!config.is_object() || config.empty()) return;
  auto it = config.begin();
  std::advance(it, static_cast<std::ptrdiff_t>(rng() % config.size()));
  switch (rng() % 4) {
    case 0:
      config.erase(it);
      break;
    case 1:
    case 2:
      it.value() = extreme_value(rng);
      break;
    default:  // a nested value (rope_scaling's fields, an eos list's element)
      if (it.value().is_object() && !it.value().empty()) {
        auto inner = it.value().begin();
        std::advance(inner, static_cast<std::ptrdiff_t>(rng() % it.value().size()));
        inner.value() = extreme_value(rng);
      } else if (it.value().is_array() && !it.value().empty()) {
        it.value()[rng() % it.value().size()] = extreme_value(rng);
      } else {
        it.value() = extreme_value(rng);
      }
  }
}

void edit_text(std::string& text, std::mt19937_64& rng) {
  static constexpr char kJsonChars[] = "{}[],:\"0123456789-.eE \\ntfu";
  if (text.empty()) return;
  const size_t at = rng() % text.size();
  switch (rng() % 4) {
    case 0:
      text.resize(at);
      break;
    case 1:
      text[at] = static_cast<char>(text[at] ^ static_cast<char>(1u << (rng() % 7)));
      break;
    case 2:
      text.insert(text.begin() + static_cast<std::ptrdiff_t>(at),
                  kJsonChars[rng() % (sizeof(kJsonChars) - 1)]);
      break;
    default:
      text.erase(at, 1);
  }
}

// What the runners rely on in an accepted config.
void check_accepted(const ModelConfig& c, const std::string& text) {
  SCOPED_TRACE(text);
  ASSERT_GT(c.hidden_size, 0);
  ASSERT_GT(c.intermediate_size, 0);
  ASSERT_GT(c.num_hidden_layers, 0);
  ASSERT_GT(c.num_attention_heads, 0);
  ASSERT_GT(c.num_key_value_heads, 0);
  ASSERT_EQ(c.num_attention_heads % c.num_key_value_heads, 0);
  ASSERT_GT(c.head_dim, 0);
  ASSERT_EQ(c.head_dim % 2, 0);
  ASSERT_LE(int64_t{c.num_attention_heads} * c.head_dim, std::numeric_limits<int32_t>::max());
  ASSERT_GT(c.vocab_size, 0);
  ASSERT_GT(c.max_position_embeddings, 0);
  ASSERT_TRUE(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0) << c.rms_norm_eps;
  ASSERT_TRUE(std::isfinite(c.rope_theta) && c.rope_theta > 0) << c.rope_theta;
  if (c.rope_scaling.type != RopeScalingType::kNone) {
    ASSERT_TRUE(std::isfinite(c.rope_scaling.factor) && c.rope_scaling.factor > 0)
        << c.rope_scaling.factor;
  }
  if (c.bos_token_id) {
    ASSERT_GE(*c.bos_token_id, 0);
    ASSERT_LT(*c.bos_token_id, c.vocab_size);
  }
  for (int32_t eos : c.eos_token_ids) {
    ASSERT_GE(eos, 0);
    ASSERT_LT(eos, c.vocab_size);
  }
  // The RoPE table is computable: head_dim / 2 finite, positive frequencies.
  const std::vector<float> inv_freq = rope_inverse_frequencies(c);
  ASSERT_EQ(static_cast<int64_t>(inv_freq.size()), c.head_dim / 2);
  for (float f : inv_freq) ASSERT_TRUE(std::isfinite(f) && f >= 0) << f;
}

TEST(ModelConfigFuzzTest, RandomEditsAreRefusedClearlyOrUsable) {
  int accepted = 0;
  int refused = 0;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    const uint64_t seed = 0xc0f1'0000ull + static_cast<uint64_t>(iteration);
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    json config = json::parse(kConfigs[rng() % std::size(kConfigs)]);
    const int json_edits = 1 + static_cast<int>(rng() % 3);
    for (int edit = 0; edit < json_edits; ++edit) edit_json(config, rng);
    std::string text = config.dump();
    if (rng() % 4 == 0) edit_text(text, rng);

    const absl::StatusOr<ModelConfig> parsed = parse_model_config(text);
    if (parsed.ok()) {
      ++accepted;
      check_accepted(*parsed, text);
      if (::testing::Test::HasFatalFailure()) return;
    } else {
      ++refused;
      ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
      ASSERT_FALSE(parsed.status().message().empty());
    }
  }
  // Both outcomes are exercised (edits of fields the parser ignores or defaults, and edits that
  // break a config).
  deft::testing::expect_both_outcomes(accepted, refused, kIterations / 20, kIterations / 4);
}

}  // namespace
}  // namespace deft::models
