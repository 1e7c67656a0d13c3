#include "bench/llama3_8b_config.h"

namespace deft::bench {

models::ModelConfig llama3_8b_config() {
  models::ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.max_position_embeddings = 8192;
  c.vocab_size = 128256;
  c.tie_word_embeddings = false;
  c.torch_dtype = models::DType::kBF16;
  return c;
}

}  // namespace deft::bench
