// Binds a Llama-family checkpoint (config + safetensors) to named weights: checks that every
// tensor the config implies is present with the config's dtype and the right shape, and hands
// back views of them for the runner. Weight layouts are the Hugging Face ones (nn.Linear
// weights are [out_features, in_features], row-major).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace deft::models {

struct LlamaLayerWeights {
  TensorView input_layernorm;                        // [hidden]
  TensorView q_proj;                                 // [heads * head_dim, hidden]
  TensorView k_proj;                                 // [kv_heads * head_dim, hidden]
  TensorView v_proj;                                 // [kv_heads * head_dim, hidden]
  TensorView o_proj;                                 // [hidden, heads * head_dim]
  std::optional<TensorView> q_bias, k_bias, v_bias;  // config.attention_bias
  std::optional<TensorView> o_bias;                  // config.o_proj_bias
  TensorView post_attention_layernorm;               // [hidden]
  TensorView gate_proj;                              // [intermediate, hidden]
  TensorView up_proj;                                // [intermediate, hidden]
  TensorView down_proj;                              // [hidden, intermediate]
};

struct LlamaWeights {
  TensorView embed_tokens;  // [vocab, hidden]
  std::vector<LlamaLayerWeights> layers;
  TensorView norm;     // [hidden]
  TensorView lm_head;  // [vocab, hidden]; the embedding itself when tie_word_embeddings
};

// One tensor the config implies.
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor name and shape a checkpoint of `config` must hold (lm_head.weight only when
// the embeddings are not tied), in a stable order.
std::vector<ExpectedTensor> expected_llama_tensors(const ModelConfig& config);

// Checks `checkpoint` against `config` and returns the weights. INVALID_ARGUMENT lists every
// missing tensor and every tensor of the wrong shape or dtype (with its file), up to a limit.
// Tensors the config does not use (e.g. rotary_emb.inv_freq of old conversions) are ignored.
absl::StatusOr<LlamaWeights> bind_llama_weights(const ModelConfig& config,
                                                const SafetensorsSet& checkpoint);

}  // namespace deft::models
