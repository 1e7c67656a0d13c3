// Test support: tiny random-weight Llama-family checkpoints built in memory, and a harness
// that runs engine steps (any mix of trees and queries) on a LlamaCpuRunner.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <utility>
#include <cmath>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "models/llama_checkpoint.h"
#include "models/llama_cpu.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace deft::models::testing {

struct TinyLlamaSpec {
  std::string architecture = "LlamaForCausalLM";
  int32_t hidden = 48;
  int32_t heads = 4;
  int32_t kv_heads = 2;
  int32_t head_dim = 12;
  int32_t intermediate = 96;
  int32_t layers = 2;
  int32_t vocab = 97;
  bool bias = false;  // Qwen2ForCausalLM always has q/k/v bias
  bool tie = false;
  uint64_t seed = 1;
};

inline std::string tiny_config_json(const TinyLlamaSpec& spec) {
  return absl::StrCat(R"({"architectures": [")", spec.architecture, R"("], "hidden_size": )",
                      spec.hidden, R"(, "intermediate_size": )", spec.intermediate,
                      R"(, "num_hidden_layers": )", spec.layers, R"(, "num_attention_heads": )",
                      spec.heads, R"(, "num_key_value_heads": )", spec.kv_heads,
                      R"(, "head_dim": )", spec.head_dim, R"(, "vocab_size": )", spec.vocab,
                      R"(, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                      "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32",
                      "tie_word_embeddings": )",
                      spec.tie ? "true" : "false", R"(, "bos_token_id": 1, "eos_token_id": 2)",
                      spec.architecture == "LlamaForCausalLM"
                          ? absl::StrCat(R"(, "attention_bias": )", spec.bias ? "true" : "false")
                          : "",
                      "}");
}

// Config and checkpoint of a random model: unit-scale activations (weights ~ 1/sqrt(fan_in)),
// norm weights around 1, logits a few units apart.
struct TinyLlama {
  ModelConfig config;
  SafetensorsSet checkpoint;
};

inline TinyLlama make_tiny_llama(const TinyLlamaSpec& spec) {
  absl::StatusOr<ModelConfig> config = parse_model_config(tiny_config_json(spec));
  EXPECT_TRUE(config.ok()) << config.status();
  std::mt19937_64 random(spec.seed);
  std::vector<OwnedTensor> tensors;
  for (const ExpectedTensor& expected : expected_llama_tensors(*config)) {
    int64_t count = 1;
    for (int64_t dim : expected.shape) count *= dim;
    std::vector<float> values(static_cast<size_t>(count));
    const bool is_norm = expected.name.ends_with("norm.weight");
    const bool is_bias = expected.name.ends_with(".bias");
    const bool is_embed = expected.name.find("embed_tokens") != std::string::npos;
    const double std_dev = is_embed ? 1.0 : is_bias ? 0.3
                           : expected.name.starts_with("lm_head") ? 3.0 / std::sqrt(expected.shape[1])
                           : expected.shape.size() == 2 ? 1.0 / std::sqrt(expected.shape[1])
                                                        : 0.0;
    std::normal_distribution<float> normal(0.0f, static_cast<float>(std_dev));
    std::uniform_real_distribution<float> around_one(0.5f, 1.5f);
    for (float& value : values) value = is_norm ? around_one(random) : normal(random);
    tensors.push_back(make_tensor(expected.name, DType::kF32, expected.shape, values));
  }
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::from_bytes(*bytes, "tiny.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  TinyLlama model{*config, SafetensorsSet()};
  EXPECT_TRUE(model.checkpoint.add_file(std::move(*file)).ok());
  return model;
}

// A two-layer model the GPU's DeFT kernels run (hidden 256, 8 query heads over 2 KV heads of
// head_dim 64 or 128, vocab 300), random weights from `seed`: the CUDA runner's tests.
inline TinyLlama make_tiny_deft_llama(int32_t head_dim, uint64_t seed) {
  return make_tiny_llama({.hidden = 256,
                          .heads = 8,
                          .kv_heads = 2,
                          .head_dim = head_dim,
                          .intermediate = 512,
                          .layers = 2,
                          .vocab = 300,
                          .seed = seed});
}

// max |a - b| / max |b|.
inline double relative_error(std::span<const float> a, std::span<const float> b) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale == 0.0 ? diff : diff / scale;
}

inline engine::TokenId argmax(std::span<const float> row) {
  return static_cast<engine::TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
}

// One tree's part of a step: the queries (tokens already appended to the tree) and their ids.
struct TreeStep {
  engine::SequenceTree* tree = nullptr;
  std::vector<engine::QueryToken> queries;
  std::vector<engine::TokenId> tokens;
};

// A runner with its KV manager and planner; runs steps and hands back logits of every row.
class RunnerHarness {
 public:
  explicit RunnerHarness(const TinyLlama& model, int32_t num_pages = 256, int32_t page_tokens = 8,
                         engine::PlannerOptions planner = {})
      : kv_({.page_tokens = page_tokens, .num_pages = num_pages}), planner_(planner) {
    absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner =
        LlamaCpuRunner::create(model.config, model.checkpoint, kv_.num_slots(), "tiny");
    EXPECT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner);
  }

  // The CPU twin of tensor parallelism (LlamaCpuRunner::create_tensor_parallel) over `ranks`.
  struct TensorParallel {
    int32_t ranks = 1;
  };
  RunnerHarness(const TinyLlama& model, TensorParallel tp, int32_t num_pages = 256,
                int32_t page_tokens = 8)
      : kv_({.page_tokens = page_tokens, .num_pages = num_pages}) {
    absl::StatusOr<std::unique_ptr<engine::ModelRunner>> runner =
        LlamaCpuRunner::create_tensor_parallel(model.config, model.checkpoint, kv_.num_slots(),
                                               tp.ranks, "tiny");
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (runner.ok()) runner_ = std::move(*runner);
  }

  // The same harness on a checkpoint directory (e.g. the embedded default model).
  RunnerHarness(const std::string& model_dir, int32_t num_pages, int32_t page_tokens)
      : kv_({.page_tokens = page_tokens, .num_pages = num_pages}) {
    absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> runner =
        LlamaCpuRunner::load(model_dir, kv_.num_slots());
    EXPECT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner);
  }

  engine::KvCacheManager& kv() { return kv_; }
  engine::ModelRunner& runner() { return *runner_; }
  int32_t vocab() const { return runner_->vocab_size(); }

  std::unique_ptr<engine::SequenceTree> new_tree() {
    return std::make_unique<engine::SequenceTree>(next_tree_id_++, &kv_);
  }

  // Plans and runs one step; returns logits [rows][vocab] for every query row.
  std::vector<std::vector<float>> step(std::span<const TreeStep> parts) {
    std::vector<engine::TreeQueries> trees;
    std::vector<engine::TokenId> tokens;
    for (const TreeStep& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
    }
    const absl::Status planned = planner_.plan(trees, plan_);
    EXPECT_TRUE(planned.ok()) << planned;
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    std::vector<float> logits(rows.size() * static_cast<size_t>(vocab()));
    const engine::StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = rows};
    const absl::Status ran = runner_->forward(batch, logits);
    EXPECT_TRUE(ran.ok()) << ran;
    std::vector<std::vector<float>> out(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      out[r].assign(logits.begin() + r * vocab(), logits.begin() + (r + 1) * vocab());
    }
    return out;
  }

  // Appends `tokens` to `node` and returns the step part that runs them.
  static TreeStep append(engine::SequenceTree& tree, engine::NodeId node,
                         std::span<const engine::TokenId> tokens) {
    const int32_t first = static_cast<int32_t>(tree.node(node).tokens.size());
    EXPECT_TRUE(tree.append(node, tokens).ok());
    TreeStep part{.tree = &tree};
    for (size_t i = 0; i < tokens.size(); ++i) {
      part.queries.push_back({node, first + static_cast<int32_t>(i)});
      part.tokens.push_back(tokens[i]);
    }
    return part;
  }

  // Runs `prefix` as one sequence (prefill in one step), then `steps` greedy tokens one step
  // at a time. Returns the logits before each greedy token (steps rows) and the tokens.
  void decode_alone(std::span<const engine::TokenId> prefix, int32_t steps,
                    std::vector<std::vector<float>>* logits,
                    std::vector<engine::TokenId>* tokens) {
    std::unique_ptr<engine::SequenceTree> tree = new_tree();
    const TreeStep prefill = append(*tree, tree->root(), prefix);
    std::vector<float> last = step({&prefill, 1}).back();
    for (int32_t s = 0; s < steps; ++s) {
      logits->push_back(last);
      const engine::TokenId token = argmax(last);
      tokens->push_back(token);
      if (s + 1 == steps) break;
      const TreeStep decode = append(*tree, tree->root(), {&token, 1});
      last = step({&decode, 1}).back();
    }
  }

 private:
  engine::KvCacheManager kv_;
  engine::AttentionPlanner planner_;
  engine::AttentionPlan plan_;
  std::unique_ptr<engine::ModelRunner> runner_;
  uint32_t next_tree_id_ = 1;
};

// The token tree of a transformers golden (`spec["tree"]`: a prompt, then nodes with a parent
// index and tokens) hung under `tree`'s root, as one step whose queries are every tree token.
struct GoldenTree {
  TreeStep all;                                         // every prompt and node token, in order
  std::vector<engine::NodeId> node_ids;                 // golden node index -> tree node
  std::map<std::pair<engine::NodeId, int32_t>, size_t> row_of;  // (node, token) -> query row
};

inline GoldenTree build_golden_tree(const nlohmann::json& tree_spec, engine::SequenceTree& tree) {
  GoldenTree golden;
  golden.all = RunnerHarness::append(
      tree, tree.root(), tree_spec["prompt"].get<std::vector<engine::TokenId>>());
  for (const nlohmann::json& node : tree_spec["nodes"]) {
    const int parent = node["parent"].get<int>();
    const engine::NodeId parent_id =
        parent < 0 ? tree.root() : golden.node_ids.at(static_cast<size_t>(parent));
    const engine::NodeId id = (*tree.branch(parent_id, 1))[0];
    golden.node_ids.push_back(id);
    const TreeStep part =
        RunnerHarness::append(tree, id, node["tokens"].get<std::vector<engine::TokenId>>());
    golden.all.queries.insert(golden.all.queries.end(), part.queries.begin(), part.queries.end());
    golden.all.tokens.insert(golden.all.tokens.end(), part.tokens.begin(), part.tokens.end());
  }
  for (size_t row = 0; row < golden.all.queries.size(); ++row) {
    golden.row_of[{golden.all.queries[row].node, golden.all.queries[row].token_index}] = row;
  }
  return golden;
}

}  // namespace deft::models::testing
