// Checks against files made by the reference implementations (transformers 5.17, safetensors
// 0.8, torch 2.11, on the device machine by a one-off script; see testdata/README.md):
// RoPE frequencies, torch's bf16/fp16 rounding, and checkpoints saved by save_pretrained.
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/llama_checkpoint.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/models/hf_configs.h"

namespace deft::models {
namespace {

using ::testing::ElementsAre;

const std::filesystem::path kTestData =
    std::filesystem::path(DEFT_SOURCE_DIR) / "tests" / "models" / "testdata";

int64_t ulp_distance(float a, float b) {
  return std::llabs(static_cast<int64_t>(std::bit_cast<int32_t>(a)) -
                    static_cast<int64_t>(std::bit_cast<int32_t>(b)));
}

TEST(HfInteropTest, RopeInverseFrequenciesMatchTransformers) {
  std::ifstream stream(kTestData / "rope_inv_freq.json");
  ASSERT_TRUE(stream) << kTestData;
  const nlohmann::json reference = nlohmann::json::parse(stream);
  const std::map<std::string, const char*> configs = {
      {"kLlama1_7B", testing_configs::kLlama1_7B},
      {"kLlama2_7B", testing_configs::kLlama2_7B},
      {"kLlama3_8B", testing_configs::kLlama3_8B},
      {"kLlama31_8B", testing_configs::kLlama31_8B},
      {"kLlama32_1B", testing_configs::kLlama32_1B},
      {"kCodeLlama7B", testing_configs::kCodeLlama7B},
      {"kMistral7B_v03", testing_configs::kMistral7B_v03},
      {"kQwen25_7B", testing_configs::kQwen25_7B},
      {"kQwen2_05B", testing_configs::kQwen2_05B}};
  for (const auto& [name, text] : configs) {
    SCOPED_TRACE(name);
    absl::StatusOr<ModelConfig> config = parse_model_config(text);
    ASSERT_TRUE(config.ok()) << config.status();
    const std::vector<float> ours = rope_inverse_frequencies(*config);
    const auto& bits = reference.at(name).at("inv_freq_bits");
    ASSERT_EQ(ours.size(), bits.size());
    int64_t max_ulps = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      const float theirs = std::bit_cast<float>(bits[i].get<uint32_t>());
      max_ulps = std::max(max_ulps, ulp_distance(ours[i], theirs));
    }
    // torch computes base ** exponent with its own float32 pow; one rounding apart at most.
    EXPECT_LE(max_ulps, 1);
    EXPECT_EQ(reference.at(name).at("attention_scaling").get<double>(), 1.0);
  }
}

TEST(HfInteropTest, ReadsTorchWrittenFileAndMatchesTorchRounding) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::open(kTestData / "torch_written.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("origin"), "torch");
  const std::vector<float> source = tensor_to_floats(*(*file)->tensor("src_f32"));
  absl::StatusOr<TensorView> as_bf16 = (*file)->tensor("as_bf16");
  absl::StatusOr<TensorView> as_f16 = (*file)->tensor("as_f16");
  ASSERT_TRUE(as_bf16.ok() && as_f16.ok());
  ASSERT_EQ(as_bf16->dtype, DType::kBF16);
  ASSERT_EQ(as_f16->dtype, DType::kF16);
  ASSERT_EQ(as_bf16->numel(), static_cast<int64_t>(source.size()));
  for (size_t i = 0; i < source.size(); ++i) {
    uint16_t bf16_bits;
    uint16_t f16_bits;
    std::memcpy(&bf16_bits, as_bf16->data + 2 * i, 2);
    std::memcpy(&f16_bits, as_f16->data + 2 * i, 2);
    EXPECT_EQ(float_to_bf16(source[i]), bf16_bits) << "element " << i << " = " << source[i];
    EXPECT_EQ(float_to_fp16(source[i]), f16_bits) << "element " << i << " = " << source[i];
  }
  absl::StatusOr<TensorView> matrix = (*file)->tensor("matrix");
  EXPECT_THAT(std::vector<int64_t>(matrix->shape.begin(), matrix->shape.end()), ElementsAre(3, 4));
  EXPECT_EQ(matrix->at(11), 11.0f);
  absl::StatusOr<TensorView> scalar = (*file)->tensor("scalar");
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->at(0), 3.5f);
  EXPECT_EQ((*file)->tensor("empty")->numel(), 0);
}

TEST(HfInteropTest, LoadsShardedLlamaSavedByTransformers) {
  const std::filesystem::path dir = kTestData / "hf_llama_tiny";
  absl::StatusOr<ModelConfig> config = load_model_config(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  // transformers 5 spellings: "dtype", and rope_theta inside "rope_parameters".
  EXPECT_EQ(config->torch_dtype, DType::kBF16);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(config->rope_scaling.original_max_position_embeddings, 64);
  EXPECT_EQ(config->head_dim, 4);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2, 3));

  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->files().size(), 2u);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(*config, *checkpoint);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->layers.size(), 2u);
  EXPECT_NE(weights->lm_head.data, weights->embed_tokens.data);
  // RMSNorm weights start at one.
  EXPECT_EQ(weights->layers[1].post_attention_layernorm.at(0), 1.0f);
}

TEST(HfInteropTest, LoadsTiedQwen2SavedByTransformers) {
  const std::filesystem::path dir = kTestData / "hf_qwen2_tiny";
  absl::StatusOr<ModelConfig> config = load_model_config(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->family, ModelFamily::kQwen2);
  EXPECT_EQ(config->torch_dtype, DType::kF16);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_TRUE(config->attention_bias);
  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(*config, *checkpoint);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE(weights->layers[0].q_bias.has_value());
  EXPECT_EQ(weights->layers[0].q_bias->numel(), 16);
  EXPECT_EQ(weights->lm_head.data, weights->embed_tokens.data);
}

}  // namespace
}  // namespace deft::models
