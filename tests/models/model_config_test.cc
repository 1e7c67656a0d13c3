#include "models/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/models/hf_configs.h"

namespace deft::models {
namespace {

using nlohmann::json;
using namespace testing_configs;  // NOLINT(google-build-using-namespace)
using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig parse_ok(const std::string& text) {
  absl::StatusOr<ModelConfig> config = parse_model_config(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

// Parses `text` after `edit`, expecting a refusal whose message contains every `needles`.
void expect_refused(const char* text, const std::function<void(json&)>& edit,
                    std::initializer_list<std::string_view> needles) {
  json config = json::parse(text);
  edit(config);
  absl::StatusOr<ModelConfig> parsed = parse_model_config(config.dump());
  ASSERT_FALSE(parsed.ok()) << config.dump();
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  for (std::string_view needle : needles) {
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(std::string(needle)));
  }
}

TEST(ModelConfigTest, Llama1DefaultsKvHeadsAndContext) {
  const ModelConfig config = parse_ok(kLlama1_7B);
  EXPECT_EQ(config.family, ModelFamily::kLlama);
  EXPECT_EQ(config.architecture, "LlamaForCausalLM");
  EXPECT_EQ(config.num_key_value_heads, 32);  // absent: one KV head per query head
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.max_position_embeddings, 2048);  // transformers' LlamaConfig default
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(config.rope_theta, 10000.0);
  EXPECT_EQ(config.torch_dtype, DType::kF16);
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(2));
  EXPECT_FALSE(config.attention_bias);
}

TEST(ModelConfigTest, Llama2) {
  const ModelConfig config = parse_ok(kLlama2_7B);
  EXPECT_EQ(config.hidden_size, 4096);
  EXPECT_EQ(config.intermediate_size, 11008);
  EXPECT_EQ(config.num_hidden_layers, 32);
  EXPECT_EQ(config.num_attention_heads, 32);
  EXPECT_EQ(config.num_key_value_heads, 32);
  EXPECT_EQ(config.max_position_embeddings, 4096);
  EXPECT_EQ(config.vocab_size, 32000);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.rope_scaling.type, RopeScalingType::kNone);
  EXPECT_FALSE(config.tie_word_embeddings);
}

TEST(ModelConfigTest, Llama3Gqa) {
  const ModelConfig config = parse_ok(kLlama3_8B);
  EXPECT_EQ(config.num_key_value_heads, 8);
  EXPECT_EQ(config.gqa_group_size(), 4);
  EXPECT_EQ(config.q_size(), 4096);
  EXPECT_EQ(config.kv_size(), 1024);
  EXPECT_DOUBLE_EQ(config.rope_theta, 500000.0);
  EXPECT_EQ(config.torch_dtype, DType::kBF16);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(128001));
}

TEST(ModelConfigTest, Llama31RopeScalingAndEosList) {
  const ModelConfig config = parse_ok(kLlama31_8B);
  EXPECT_EQ(config.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(config.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(config.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(config.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(config.max_position_embeddings, 131072);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ModelConfigTest, Llama32TiedWithExplicitHeadDim) {
  const ModelConfig config = parse_ok(kLlama32_1B);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.head_dim, 64);
  EXPECT_EQ(config.num_hidden_layers, 16);
  EXPECT_DOUBLE_EQ(config.rope_scaling.factor, 32.0);
}

TEST(ModelConfigTest, HeadDimMayDifferFromHiddenOverHeads) {
  json config = json::parse(kMistral7B_v03);
  config["hidden_size"] = 5120;  // Mistral NeMo: 32 heads of 128, hidden 5120
  config["head_dim"] = 128;
  const ModelConfig parsed = parse_ok(config.dump());
  EXPECT_EQ(parsed.head_dim, 128);
  EXPECT_EQ(parsed.q_size(), 4096);
}

TEST(ModelConfigTest, CodeLlamaRopeTheta) {
  const ModelConfig config = parse_ok(kCodeLlama7B);
  EXPECT_DOUBLE_EQ(config.rope_theta, 1000000.0);  // written as an integer
  EXPECT_EQ(config.max_position_embeddings, 16384);
  EXPECT_EQ(config.vocab_size, 32016);
}

TEST(ModelConfigTest, MistralWithoutSlidingWindow) {
  const ModelConfig config = parse_ok(kMistral7B_v03);
  EXPECT_EQ(config.family, ModelFamily::kMistral);
  EXPECT_FALSE(config.sliding_window.has_value());
  EXPECT_FALSE(config.attention_bias);
  EXPECT_EQ(config.vocab_size, 32768);
}

TEST(ModelConfigTest, MistralWindowCoveringTheContextIsAccepted) {
  json config = json::parse(kMistral7B_v01);
  config["sliding_window"] = 32768;
  const ModelConfig parsed = parse_ok(config.dump());
  EXPECT_EQ(parsed.sliding_window, 32768);
}

TEST(ModelConfigTest, MistralShortSlidingWindowIsRefused) {
  expect_refused(kMistral7B_v01, [](json&) {}, {"sliding_window", "4096", "32768"});
}

TEST(ModelConfigTest, Qwen2HasQkvBiasAndIgnoresUnusedWindow) {
  const ModelConfig config = parse_ok(kQwen25_7B);
  EXPECT_EQ(config.family, ModelFamily::kQwen2);
  EXPECT_TRUE(config.attention_bias);
  EXPECT_FALSE(config.o_proj_bias);
  EXPECT_EQ(config.num_key_value_heads, 4);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_FALSE(config.sliding_window.has_value());
  EXPECT_THAT(config.eos_token_ids, ElementsAre(151645));

  const ModelConfig small = parse_ok(kQwen2_05B);
  EXPECT_TRUE(small.tie_word_embeddings);
  EXPECT_EQ(small.head_dim, 64);
  EXPECT_EQ(small.gqa_group_size(), 7);
}

TEST(ModelConfigTest, Qwen2ActiveShortWindowIsRefused) {
  expect_refused(kQwen25_7B,
                 [](json& c) {
                   c["use_sliding_window"] = true;
                   c["sliding_window"] = 4096;
                 },
                 {"sliding_window", "4096"});
}

TEST(ModelConfigTest, LayerTypesOfTransformers5) {
  json config = json::parse(kQwen2_05B);
  config["layer_types"] = json::array({"full_attention", "full_attention"});
  EXPECT_TRUE(parse_model_config(config.dump()).ok());
  expect_refused(kQwen2_05B,
                 [](json& c) {
                   c["layer_types"] = {"full_attention", "chunked"};
                 },
                 {"layer_types", "chunked"});
}

TEST(ModelConfigTest, LlamaAttentionBiasCoversOutputProjection) {
  json config = json::parse(kLlama2_7B);
  config["attention_bias"] = true;
  const ModelConfig parsed = parse_ok(config.dump());
  EXPECT_TRUE(parsed.attention_bias);
  EXPECT_TRUE(parsed.o_proj_bias);
}

TEST(ModelConfigTest, ArchitectureFromModelTypeWhenListAbsent) {
  json config = json::parse(kQwen2_05B);
  config.erase("architectures");
  EXPECT_EQ(parse_ok(config.dump()).family, ModelFamily::kQwen2);
}

TEST(ModelConfigTest, NewerTransformersSpellings) {
  json config = json::parse(kLlama31_8B);
  config.erase("torch_dtype");
  config["dtype"] = "float16";
  config["rope_parameters"] = config["rope_scaling"];
  config["rope_parameters"]["rope_theta"] = 250000.0;
  config.erase("rope_scaling");
  config.erase("rope_theta");
  const ModelConfig parsed = parse_ok(config.dump());
  EXPECT_EQ(parsed.torch_dtype, DType::kF16);
  EXPECT_DOUBLE_EQ(parsed.rope_theta, 250000.0);
  EXPECT_EQ(parsed.rope_scaling.type, RopeScalingType::kLlama3);
}

TEST(ModelConfigTest, LegacyRopeScalingTypeKeyAndLinear) {
  json config = json::parse(kLlama2_7B);
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  const ModelConfig parsed = parse_ok(config.dump());
  EXPECT_EQ(parsed.rope_scaling.type, RopeScalingType::kLinear);
  const std::vector<float> inv_freq = rope_inverse_frequencies(parsed);
  EXPECT_FLOAT_EQ(inv_freq[0], 0.25f);
}

TEST(ModelConfigTest, RefusesUnsupportedArchitecture) {
  expect_refused(kMistral7B_v03, [](json& c) { c["architectures"] = {"MixtralForCausalLM"}; },
                 {"architectures", "MixtralForCausalLM"});
  expect_refused(kMistral7B_v03,
                 [](json& c) {
                   c.erase("architectures");
                   c["model_type"] = "gemma";
                 },
                 {"model_type", "gemma"});
}

TEST(ModelConfigTest, RefusesUnsupportedRopeScaling) {
  expect_refused(kLlama31_8B, [](json& c) { c["rope_scaling"]["rope_type"] = "yarn"; },
                 {"rope_scaling.rope_type", "yarn"});
  expect_refused(kLlama2_7B,
                 [](json& c) {
                   c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
                 },
                 {"rope_scaling.type", "dynamic"});
  expect_refused(kLlama31_8B,
                 [](json& c) { c["rope_scaling"].erase("original_max_position_embeddings"); },
                 {"rope_scaling.original_max_position_embeddings", "missing"});
  expect_refused(kLlama31_8B, [](json& c) { c["rope_scaling"]["high_freq_factor"] = 0.5; },
                 {"high_freq_factor"});
  // A factor whose fp32 frequencies underflow to 0 (found by the model_config fuzzer).
  expect_refused(kLlama31_8B, [](json& c) { c["rope_scaling"]["factor"] = 1e300; },
                 {"factor", "1024"});
}

// Query width past int32 would overflow q_size() (UBSan found it through the model_config fuzz
// harness contract; tests/fuzz/regressions/model_config/).
TEST(ModelConfigTest, RefusesQueryWidthPastInt32) {
  expect_refused(kLlama31_8B,
                 [](json& c) {
                   c["num_attention_heads"] = 65536;
                   c["num_key_value_heads"] = 65536;
                   c["head_dim"] = 65536;
                 },
                 {"head_dim", "4294967296"});
}

TEST(ModelConfigTest, RefusesOtherActivationsAndDtypes) {
  expect_refused(kLlama2_7B, [](json& c) { c["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"});
  expect_refused(kLlama2_7B, [](json& c) { c["torch_dtype"] = "float8_e4m3fn"; },
                 {"torch_dtype", "float8_e4m3fn"});
  expect_refused(kLlama2_7B, [](json& c) { c["mlp_bias"] = true; }, {"mlp_bias"});
}

TEST(ModelConfigTest, RefusesBadShapes) {
  expect_refused(kLlama2_7B, [](json& c) { c.erase("hidden_size"); }, {"hidden_size", "missing"});
  expect_refused(kLlama2_7B, [](json& c) { c["num_key_value_heads"] = 5; },
                 {"num_key_value_heads", "5"});
  expect_refused(kLlama2_7B, [](json& c) { c["num_attention_heads"] = 0; },
                 {"num_attention_heads", "0"});
  expect_refused(kLlama1_7B, [](json& c) { c["num_attention_heads"] = 3; },
                 {"num_attention_heads", "3", "hidden_size"});
  expect_refused(kLlama2_7B, [](json& c) { c["vocab_size"] = "32000"; }, {"vocab_size"});
  expect_refused(kLlama2_7B, [](json& c) { c["head_dim"] = 127; }, {"head_dim", "127"});
  expect_refused(kLlama2_7B, [](json& c) { c["rms_norm_eps"] = -1.0; }, {"rms_norm_eps"});
  // RoPE frequencies are float32: a base outside its normal range gives inf or zero frequencies
  // (found by model_config_fuzz_test).
  expect_refused(kLlama31_8B, [](json& c) { c["rope_theta"] = 1e-300; }, {"rope_theta", "float32"});
  expect_refused(kLlama2_7B, [](json& c) { c["rope_theta"] = 1e39; }, {"rope_theta"});
  expect_refused(kLlama2_7B, [](json& c) { c["rope_theta"] = 0.0; }, {"rope_theta"});
}

TEST(ModelConfigTest, RefusesTokenIdsOutsideVocabulary) {
  expect_refused(kLlama31_8B,
                 [](json& c) {
                   c["eos_token_id"] = {128001, 200000};
                 },
                 {"eos_token_id", "200000"});
  expect_refused(kLlama2_7B, [](json& c) { c["bos_token_id"] = -1; }, {"bos_token_id", "-1"});
}

TEST(ModelConfigTest, RefusesMalformedJson) {
  for (const char* text : {"", "{", "[]", "{\"hidden_size\": }", "null"}) {
    absl::StatusOr<ModelConfig> parsed = parse_model_config(text);
    EXPECT_FALSE(parsed.ok()) << text;
  }
}

TEST(ModelConfigTest, LoadsFromDirectoryOrFile) {
  const std::filesystem::path dir =
      std::filesystem::path(testing::TempDir()) / "deft_model_config_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << kLlama32_1B;
  absl::StatusOr<ModelConfig> from_dir = load_model_config(dir);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->hidden_size, 2048);
  absl::StatusOr<ModelConfig> from_file = load_model_config(dir / "config.json");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  absl::StatusOr<ModelConfig> missing = load_model_config(dir / "nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

TEST(RopeTest, DefaultInverseFrequencies) {
  const ModelConfig config = parse_ok(kLlama2_7B);
  const std::vector<float> inv_freq = rope_inverse_frequencies(config);
  ASSERT_EQ(inv_freq.size(), 64u);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double expected = std::pow(10000.0, -2.0 * static_cast<double>(i) / 128.0);
    EXPECT_NEAR(inv_freq[i], expected, 1e-6 * expected) << i;
  }
}

// The llama3 rule written out again in double precision, band by band.
TEST(RopeTest, Llama3ScalingBands) {
  const ModelConfig config = parse_ok(kLlama31_8B);
  const std::vector<float> inv_freq = rope_inverse_frequencies(config);
  ASSERT_EQ(inv_freq.size(), 64u);
  const double low_freq_wavelen = 8192.0 / 1.0;
  const double high_freq_wavelen = 8192.0 / 4.0;
  int high = 0, low = 0, medium = 0;
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double base = std::pow(500000.0, -2.0 * static_cast<double>(i) / 128.0);
    const double wavelen = 2.0 * std::numbers::pi / base;
    double expected;
    if (wavelen < high_freq_wavelen) {
      expected = base;
      ++high;
    } else if (wavelen > low_freq_wavelen) {
      expected = base / 8.0;
      ++low;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      expected = (1.0 - smooth) * base / 8.0 + smooth * base;
      ++medium;
      EXPECT_GT(inv_freq[i], base / 8.0 * (1 - 1e-6));
      EXPECT_LT(inv_freq[i], base * (1 + 1e-6));
    }
    EXPECT_NEAR(inv_freq[i], expected, 2e-6 * expected) << i;
  }
  // Every band is exercised by Llama 3.1's shapes.
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
  // Spot values (float32, transformers' formula): first unchanged, last divided by 8.
  EXPECT_FLOAT_EQ(inv_freq[0], 1.0f);
  EXPECT_NEAR(inv_freq[63], std::pow(500000.0, -126.0 / 128.0) / 8.0, 1e-12);
}

}  // namespace
}  // namespace deft::models
