#include "models/llama_checkpoint.h"

#include <algorithm>
#include <map>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace deft::models {
namespace {

constexpr size_t kMaxReportedProblems = 12;

std::string shape_text(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string layer_name(int32_t layer, std::string_view suffix) {
  return absl::StrCat("model.layers.", layer, ".", absl::string_view(suffix.data(), suffix.size()));
}

}  // namespace

std::vector<ExpectedTensor> expected_llama_tensors(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_size = config.q_size();
  const int64_t kv_size = config.kv_size();
  const int64_t intermediate = config.intermediate_size;
  std::vector<ExpectedTensor> expected;
  expected.push_back({"model.embed_tokens.weight", {config.vocab_size, hidden}});
  for (int32_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    expected.push_back({layer_name(layer, "input_layernorm.weight"), {hidden}});
    expected.push_back({layer_name(layer, "self_attn.q_proj.weight"), {q_size, hidden}});
    expected.push_back({layer_name(layer, "self_attn.k_proj.weight"), {kv_size, hidden}});
    expected.push_back({layer_name(layer, "self_attn.v_proj.weight"), {kv_size, hidden}});
    expected.push_back({layer_name(layer, "self_attn.o_proj.weight"), {hidden, q_size}});
    if (config.attention_bias) {
      expected.push_back({layer_name(layer, "self_attn.q_proj.bias"), {q_size}});
      expected.push_back({layer_name(layer, "self_attn.k_proj.bias"), {kv_size}});
      expected.push_back({layer_name(layer, "self_attn.v_proj.bias"), {kv_size}});
    }
    if (config.o_proj_bias) {
      expected.push_back({layer_name(layer, "self_attn.o_proj.bias"), {hidden}});
    }
    expected.push_back({layer_name(layer, "post_attention_layernorm.weight"), {hidden}});
    expected.push_back({layer_name(layer, "mlp.gate_proj.weight"), {intermediate, hidden}});
    expected.push_back({layer_name(layer, "mlp.up_proj.weight"), {intermediate, hidden}});
    expected.push_back({layer_name(layer, "mlp.down_proj.weight"), {hidden, intermediate}});
  }
  expected.push_back({"model.norm.weight", {hidden}});
  if (!config.tie_word_embeddings) {
    expected.push_back({"lm_head.weight", {config.vocab_size, hidden}});
  }
  return expected;
}

absl::StatusOr<LlamaWeights> bind_llama_weights(const ModelConfig& config,
                                                const SafetensorsSet& checkpoint) {
  // Each layer needs at least its 9 weights. A layer count the checkpoint cannot hold is refused
  // before the expected list is built (2^31 layers would be billions of entries), unless it is
  // small enough that listing what is missing says more.
  constexpr int64_t kTensorsPerLayer = 9;
  const int64_t layers_held = static_cast<int64_t>(checkpoint.size()) / kTensorsPerLayer;
  if (config.num_hidden_layers > std::max<int64_t>(layers_held, kMaxReportedProblems)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", checkpoint.source(),
                     "' does not match its config: num_hidden_layers = ", config.num_hidden_layers,
                     " needs at least ", int64_t{config.num_hidden_layers} * kTensorsPerLayer,
                     " tensors, the checkpoint holds ", checkpoint.size()));
  }
  std::vector<std::string> problems;
  size_t total_problems = 0;
  std::map<std::string, TensorView, std::less<>> found;
  for (const ExpectedTensor& expected : expected_llama_tensors(config)) {
    absl::StatusOr<TensorView> view = checkpoint.tensor(expected.name);
    std::string problem;
    if (!view.ok()) {
      problem = absl::StrCat("missing tensor '", expected.name, "'");
    } else if (!std::equal(view->shape.begin(), view->shape.end(), expected.shape.begin(),
                           expected.shape.end())) {
      problem =
          absl::StrCat("tensor '", expected.name, "' in '",
                       absl::string_view(view->file.data(), view->file.size()), "' has shape ",
                       shape_text(view->shape), ", expected ", shape_text(expected.shape));
    } else if (view->dtype != config.torch_dtype) {
      const std::string_view got = dtype_name(view->dtype);
      const std::string_view want = dtype_name(config.torch_dtype);
      problem = absl::StrCat("tensor '", expected.name, "' in '",
                             absl::string_view(view->file.data(), view->file.size()),
                             "' has dtype ", absl::string_view(got.data(), got.size()),
                             ", config.json says ", absl::string_view(want.data(), want.size()));
    } else {
      found.emplace(expected.name, *view);
      continue;
    }
    ++total_problems;
    if (problems.size() < kMaxReportedProblems) problems.push_back(std::move(problem));
  }
  if (total_problems > 0) {
    if (total_problems > problems.size()) {
      problems.push_back(absl::StrCat("... and ", total_problems - problems.size(), " more"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", checkpoint.source(), "' does not match its config (",
                     std::string(model_family_name(config.family)), ", ", config.num_hidden_layers,
                     " layers): ", absl::StrJoin(problems, "; ")));
  }
  if (found.size() < checkpoint.size()) {
    spdlog::debug("checkpoint '{}': {} tensors not used by the model", checkpoint.source(),
                  checkpoint.size() - found.size());
  }

  auto take = [&](const std::string& name) { return found.at(name); };
  LlamaWeights weights;
  weights.embed_tokens = take("model.embed_tokens.weight");
  weights.norm = take("model.norm.weight");
  weights.lm_head = config.tie_word_embeddings ? weights.embed_tokens : take("lm_head.weight");
  weights.layers.resize(config.num_hidden_layers);
  for (int32_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    LlamaLayerWeights& w = weights.layers[layer];
    w.input_layernorm = take(layer_name(layer, "input_layernorm.weight"));
    w.q_proj = take(layer_name(layer, "self_attn.q_proj.weight"));
    w.k_proj = take(layer_name(layer, "self_attn.k_proj.weight"));
    w.v_proj = take(layer_name(layer, "self_attn.v_proj.weight"));
    w.o_proj = take(layer_name(layer, "self_attn.o_proj.weight"));
    if (config.attention_bias) {
      w.q_bias = take(layer_name(layer, "self_attn.q_proj.bias"));
      w.k_bias = take(layer_name(layer, "self_attn.k_proj.bias"));
      w.v_bias = take(layer_name(layer, "self_attn.v_proj.bias"));
    }
    if (config.o_proj_bias) w.o_bias = take(layer_name(layer, "self_attn.o_proj.bias"));
    w.post_attention_layernorm = take(layer_name(layer, "post_attention_layernorm.weight"));
    w.gate_proj = take(layer_name(layer, "mlp.gate_proj.weight"));
    w.up_proj = take(layer_name(layer, "mlp.up_proj.weight"));
    w.down_proj = take(layer_name(layer, "mlp.down_proj.weight"));
  }
  return weights;
}

}  // namespace deft::models
