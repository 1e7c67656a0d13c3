// The Llama-3-8B shape the GPU benchmarks run with random weights (no checkpoint needed).
#pragma once

#include "models/model_config.h"

namespace deft::bench {

models::ModelConfig llama3_8b_config();

}  // namespace deft::bench
