#include "bench/llama3_2_1b_config.h"

namespace deft::bench {

models::ModelConfig llama3_2_1b_config() {
  models::ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_hidden_layers = 16;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling = {.type = models::RopeScalingType::kLlama3,
                    .factor = 32.0,
                    .low_freq_factor = 1.0,
                    .high_freq_factor = 4.0,
                    .original_max_position_embeddings = 8192};
  c.max_position_embeddings = 131072;
  c.vocab_size = 128256;
  c.tie_word_embeddings = true;
  c.torch_dtype = models::DType::kBF16;
  return c;
}

}  // namespace deft::bench
