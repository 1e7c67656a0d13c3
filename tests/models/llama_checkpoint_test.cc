#include "models/llama_checkpoint.h"

#include <filesystem>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deft::models {
namespace {

using ::testing::HasSubstr;

ModelConfig tiny_config(ModelFamily family, bool tied) {
  ModelConfig config;
  config.family = family;
  config.hidden_size = 8;
  config.intermediate_size = 12;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 2;
  config.vocab_size = 11;
  config.tie_word_embeddings = tied;
  config.torch_dtype = DType::kBF16;
  config.attention_bias = family == ModelFamily::kQwen2;
  return config;
}

// Random tensors for every expected name, in the config's dtype.
std::vector<OwnedTensor> tensors_for(const ModelConfig& config, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<OwnedTensor> tensors;
  for (const ExpectedTensor& expected : expected_llama_tensors(config)) {
    int64_t numel = 1;
    for (int64_t dim : expected.shape) numel *= dim;
    std::vector<float> values(static_cast<size_t>(numel));
    for (float& value : values) value = normal(rng);
    tensors.push_back(make_tensor(expected.name, config.torch_dtype, expected.shape, values));
  }
  return tensors;
}

SafetensorsSet set_of(const std::vector<OwnedTensor>& tensors) {
  SafetensorsSet set;
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::from_bytes(*bytes, "model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(set.add_file(*std::move(file)).ok());
  return set;
}

std::string bind_error(const ModelConfig& config, const std::vector<OwnedTensor>& tensors) {
  const SafetensorsSet set = set_of(tensors);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, set);
  EXPECT_FALSE(weights.ok());
  return std::string(weights.status().message());
}

TEST(LlamaCheckpointTest, ExpectedTensorNamesAndShapes) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  const std::vector<ExpectedTensor> expected = expected_llama_tensors(config);
  // embed + 9 per layer + norm + lm_head
  ASSERT_EQ(expected.size(), 1u + 9u * 2u + 2u);
  EXPECT_EQ(expected.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(expected.front().shape, (std::vector<int64_t>{11, 8}));
  EXPECT_EQ(expected[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(expected[2].shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(expected[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(expected[3].shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(expected[9].name, "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(expected[9].shape, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(expected.back().name, "lm_head.weight");

  const ModelConfig qwen = tiny_config(ModelFamily::kQwen2, /*tied=*/true);
  const std::vector<ExpectedTensor> qwen_expected = expected_llama_tensors(qwen);
  EXPECT_EQ(qwen_expected.size(), 1u + 12u * 2u + 1u);  // 3 biases per layer, no lm_head
  EXPECT_EQ(qwen_expected[6].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(qwen_expected[6].shape, (std::vector<int64_t>{8}));
  EXPECT_EQ(qwen_expected.back().name, "model.norm.weight");
}

TEST(LlamaCheckpointTest, BindsEveryWeight) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  const std::vector<OwnedTensor> tensors = tensors_for(config, 1);
  const SafetensorsSet set = set_of(tensors);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, set);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_EQ(weights->layers.size(), 2u);
  EXPECT_EQ(weights->layers[1].down_proj.name, "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(weights->lm_head.name, "lm_head.weight");
  EXPECT_FALSE(weights->layers[0].q_bias.has_value());
  EXPECT_EQ(weights->embed_tokens.numel(), 88);
  // The views are the written bytes.
  EXPECT_EQ(
      std::memcmp(weights->layers[0].k_proj.data, tensors[3].bytes.data(), tensors[3].bytes.size()),
      0);
}

TEST(LlamaCheckpointTest, TiedEmbeddingsServeAsLmHead) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/true);
  std::vector<OwnedTensor> tensors = tensors_for(config, 2);
  const SafetensorsSet set = set_of(tensors);
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, set);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->lm_head.data, weights->embed_tokens.data);
}

TEST(LlamaCheckpointTest, Qwen2BiasesAreBoundAndRequired) {
  const ModelConfig config = tiny_config(ModelFamily::kQwen2, /*tied=*/true);
  std::vector<OwnedTensor> tensors = tensors_for(config, 3);
  {
    const SafetensorsSet set = set_of(tensors);
    absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, set);
    ASSERT_TRUE(weights.ok()) << weights.status();
    ASSERT_TRUE(weights->layers[1].v_bias.has_value());
    EXPECT_EQ(weights->layers[1].v_bias->name, "model.layers.1.self_attn.v_proj.bias");
    EXPECT_FALSE(weights->layers[1].o_bias.has_value());
  }
  std::erase_if(tensors, [](const OwnedTensor& t) {
    return t.name == "model.layers.1.self_attn.k_proj.bias";
  });
  EXPECT_THAT(bind_error(config, tensors),
              HasSubstr("missing tensor 'model.layers.1.self_attn.k_proj.bias'"));
}

TEST(LlamaCheckpointTest, MissingTensorsAreAllListed) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  std::vector<OwnedTensor> tensors = tensors_for(config, 4);
  std::erase_if(tensors, [](const OwnedTensor& t) {
    return t.name == "lm_head.weight" || t.name == "model.layers.0.mlp.up_proj.weight";
  });
  const std::string message = bind_error(config, tensors);
  EXPECT_THAT(message, HasSubstr("checkpoint 'model.safetensors'"));
  EXPECT_THAT(message, HasSubstr("missing tensor 'model.layers.0.mlp.up_proj.weight'"));
  EXPECT_THAT(message, HasSubstr("missing tensor 'lm_head.weight'"));
}

TEST(LlamaCheckpointTest, WrongShapeNamesFileAndShapes) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  std::vector<OwnedTensor> tensors = tensors_for(config, 5);
  for (OwnedTensor& tensor : tensors) {
    if (tensor.name == "model.layers.1.self_attn.v_proj.weight")
      tensor.shape = {8, 4};  // transposed
  }
  EXPECT_THAT(bind_error(config, tensors),
              HasSubstr("tensor 'model.layers.1.self_attn.v_proj.weight' in 'model.safetensors' "
                        "has shape [8, 4], expected [4, 8]"));
}

TEST(LlamaCheckpointTest, WrongDtypeIsRefused) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  std::vector<OwnedTensor> tensors = tensors_for(config, 6);
  tensors[1] =
      make_tensor(tensors[1].name, DType::kF32, tensors[1].shape, std::vector<float>(8, 1.0f));
  EXPECT_THAT(bind_error(config, tensors),
              HasSubstr("tensor 'model.layers.0.input_layernorm.weight' in 'model.safetensors' "
                        "has dtype F32, config.json says BF16"));
}

TEST(LlamaCheckpointTest, ManyProblemsAreCapped) {
  ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  config.num_hidden_layers = 5;
  const std::string message = bind_error(config, {});
  EXPECT_THAT(message, HasSubstr("missing tensor 'model.embed_tokens.weight'"));
  EXPECT_THAT(message, HasSubstr("more"));
}

// A layer count no checkpoint could hold is refused at once, not after listing 2^31 layers.
TEST(LlamaCheckpointTest, ImpossibleLayerCountIsRefusedAtOnce) {
  ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  const std::vector<OwnedTensor> tensors = tensors_for(config, 8);
  config.num_hidden_layers = 2147483647;
  const std::string message = bind_error(config, tensors);
  EXPECT_THAT(message, HasSubstr("num_hidden_layers = 2147483647"));
  EXPECT_THAT(message, HasSubstr("model.safetensors"));
}

TEST(LlamaCheckpointTest, ExtraTensorsAreIgnored) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  std::vector<OwnedTensor> tensors = tensors_for(config, 7);
  tensors.push_back(make_tensor("model.layers.0.self_attn.rotary_emb.inv_freq", DType::kF32, {1},
                                std::vector<float>{1.0f}));
  const SafetensorsSet set = set_of(tensors);
  EXPECT_TRUE(bind_llama_weights(config, set).ok());
}

TEST(LlamaCheckpointTest, ShardedCheckpointOnDisk) {
  const ModelConfig config = tiny_config(ModelFamily::kLlama, /*tied=*/false);
  const std::vector<OwnedTensor> tensors = tensors_for(config, 8);
  const std::filesystem::path dir =
      std::filesystem::path(testing::TempDir()) / "deft_llama_checkpoint_sharded";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const size_t half = tensors.size() / 2;
  const std::vector<OwnedTensor> first(tensors.begin(), tensors.begin() + half);
  const std::vector<OwnedTensor> second(tensors.begin() + half, tensors.end());
  ASSERT_TRUE(write_safetensors(dir / "model-00001-of-00002.safetensors", first).ok());
  ASSERT_TRUE(write_safetensors(dir / "model-00002-of-00002.safetensors", second).ok());
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    weight_map[tensors[i].name] =
        i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    total += tensors[i].bytes.size();
  }
  ASSERT_TRUE(
      write_safetensors_index(dir / "model.safetensors.index.json", weight_map, total).ok());

  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::open(dir);
  ASSERT_TRUE(set.ok()) << set.status();
  absl::StatusOr<LlamaWeights> weights = bind_llama_weights(config, *set);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_THAT(std::string(weights->lm_head.file), HasSubstr("model-00002-of-00002"));

  // A truncated shard: the error names the shard file and the tensor cut off.
  const std::filesystem::path second_path = dir / "model-00002-of-00002.safetensors";
  std::filesystem::resize_file(second_path, std::filesystem::file_size(second_path) - 2);
  absl::StatusOr<SafetensorsSet> truncated = SafetensorsSet::open(dir);
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr(second_path.string()));
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr("truncated"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace deft::models
