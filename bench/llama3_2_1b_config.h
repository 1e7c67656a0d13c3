// The Llama-3.2-1B shape the GPU benchmarks run with random weights as a draft model (no
// checkpoint needed): hidden 2048, 16 layers, 32 heads on 8 KV heads (head_dim 64), MLP 8192,
// vocab 128256, tied embeddings, Llama 3.1 RoPE scaling.
#pragma once

#include "models/model_config.h"

namespace deft::bench {

models::ModelConfig llama3_2_1b_config();

}  // namespace deft::bench
