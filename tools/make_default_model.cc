// make-default-model: writes the embedded default model (models/default/): a tiny
// Llama-architecture checkpoint in Hugging Face layout (config.json, generation_config.json,
// model.safetensors in bf16) with random weights drawn from a fixed seed, so every machine
// makes the same bytes. The tokenizer (tokenizer.model) is trained separately with spm_train;
// models/default/README.md has both commands.
//
//   make-default-model --out models/default [--vocab-size 512] [--seed 20261123]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace {

using deft::models::DType;
using deft::models::OwnedTensor;

// The shape of the default model: GQA (4 query heads on 2 KV heads) so the default run
// exercises the grouped path; small enough that CI runs it in well under a second.
constexpr int32_t kHidden = 128;
constexpr int32_t kIntermediate = 352;
constexpr int32_t kLayers = 4;
constexpr int32_t kHeads = 4;
constexpr int32_t kKvHeads = 2;
constexpr int32_t kHeadDim = kHidden / kHeads;

// SplitMix64 (Steele et al., 2014): fully specified, unlike std::normal_distribution, so the
// weights are the same on every standard library.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-limit, limit): 24 random bits, exact in float.
  float uniform(float limit) {
    const float unit = static_cast<float>(next() >> 40) / static_cast<float>(1 << 24);
    return (2.0f * unit - 1.0f) * limit;
  }

 private:
  uint64_t state_;
};

OwnedTensor random_tensor(Random& random, std::string name, std::vector<int64_t> shape,
                          float std_dev) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  // Uniform with the given standard deviation: limit = std * sqrt(3).
  const float limit = std_dev * std::sqrt(3.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = random.uniform(limit);
  return deft::models::make_tensor(std::move(name), DType::kBF16, std::move(shape), values);
}

OwnedTensor ones(std::string name, int64_t size) {
  const std::vector<float> values(static_cast<size_t>(size), 1.0f);
  return deft::models::make_tensor(std::move(name), DType::kBF16, {size}, values);
}

std::string config_json(int32_t vocab_size) {
  return absl::StrCat(R"({
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": )", kHidden, R"(,
  "intermediate_size": )", kIntermediate, R"(,
  "num_hidden_layers": )", kLayers, R"(,
  "num_attention_heads": )", kHeads, R"(,
  "num_key_value_heads": )", kKvHeads, R"(,
  "head_dim": )", kHeadDim, R"(,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "max_position_embeddings": 4096,
  "vocab_size": )", vocab_size, R"(,
  "tie_word_embeddings": false,
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "torch_dtype": "bfloat16"
}
)");
}

constexpr std::string_view kGenerationConfig = R"({
  "bos_token_id": 1,
  "eos_token_id": 2
}
)";

int usage(const char* message) {
  if (message != nullptr) std::fprintf(stderr, "make-default-model: %s\n", message);
  std::fprintf(stderr,
               "usage: make-default-model --out DIR [--vocab-size N] [--seed N]\n"
               "Writes config.json, generation_config.json and model.safetensors of the tiny\n"
               "default model into DIR (deterministic for a given seed).\n");
  return message == nullptr ? 0 : 2;
}

bool write_text(const std::filesystem::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  return static_cast<bool>(out);
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path out_dir;
  int32_t vocab_size = 512;
  uint64_t seed = 20261123;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return usage(nullptr);
    if (i + 1 >= argc) return usage(absl::StrCat(arg, " needs a value").c_str());
    const std::string value = argv[++i];
    if (arg == "--out") {
      out_dir = std::string(value);
    } else if (arg == "--vocab-size") {
      if (!absl::SimpleAtoi(value, &vocab_size) || vocab_size < 8) return usage("bad --vocab-size");
    } else if (arg == "--seed") {
      if (!absl::SimpleAtoi(value, &seed)) return usage("bad --seed");
    } else {
      return usage(absl::StrCat("unknown flag ", arg).c_str());
    }
  }
  if (out_dir.empty()) return usage("--out is required");
  std::filesystem::create_directories(out_dir);

  // transformers' default initializer_range: weights ~ 0.02 standard deviation, norms 1.
  constexpr float kStd = 0.02f;
  Random random(seed);
  std::vector<OwnedTensor> tensors;
  tensors.push_back(random_tensor(random, "model.embed_tokens.weight", {vocab_size, kHidden}, kStd));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    const std::string prefix = absl::StrCat("model.layers.", layer, ".");
    tensors.push_back(ones(prefix + "input_layernorm.weight", kHidden));
    tensors.push_back(random_tensor(random, prefix + "self_attn.q_proj.weight",
                                    {kHeads * kHeadDim, kHidden}, kStd));
    tensors.push_back(random_tensor(random, prefix + "self_attn.k_proj.weight",
                                    {kKvHeads * kHeadDim, kHidden}, kStd));
    tensors.push_back(random_tensor(random, prefix + "self_attn.v_proj.weight",
                                    {kKvHeads * kHeadDim, kHidden}, kStd));
    tensors.push_back(random_tensor(random, prefix + "self_attn.o_proj.weight",
                                    {kHidden, kHeads * kHeadDim}, kStd));
    tensors.push_back(ones(prefix + "post_attention_layernorm.weight", kHidden));
    tensors.push_back(
        random_tensor(random, prefix + "mlp.gate_proj.weight", {kIntermediate, kHidden}, kStd));
    tensors.push_back(
        random_tensor(random, prefix + "mlp.up_proj.weight", {kIntermediate, kHidden}, kStd));
    tensors.push_back(
        random_tensor(random, prefix + "mlp.down_proj.weight", {kHidden, kIntermediate}, kStd));
  }
  tensors.push_back(ones("model.norm.weight", kHidden));
  tensors.push_back(random_tensor(random, "lm_head.weight", {vocab_size, kHidden}, kStd));

  const absl::Status status = deft::models::write_safetensors(
      out_dir / "model.safetensors", tensors, {{"format", "pt"}});
  if (!status.ok()) {
    std::fprintf(stderr, "make-default-model: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  if (!write_text(out_dir / "config.json", config_json(vocab_size)) ||
      !write_text(out_dir / "generation_config.json", kGenerationConfig)) {
    std::fprintf(stderr, "make-default-model: cannot write into %s\n", out_dir.c_str());
    return 1;
  }
  // Read it back through the loader the runner uses, so a bad file never gets committed.
  const absl::StatusOr<deft::models::ModelConfig> config =
      deft::models::load_model_config(out_dir);
  if (!config.ok()) {
    std::fprintf(stderr, "make-default-model: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  std::printf("wrote %s (vocab %d, hidden %d, %d layers, seed %llu)\n", out_dir.c_str(),
              vocab_size, kHidden, kLayers, static_cast<unsigned long long>(seed));
  return 0;
}
