#include "models/step_staging.h"

#include <algorithm>

#include "engine/attention_planner.h"

namespace deft::models {

size_t step_params_offset(int32_t launch_rows, int32_t launch_logit_rows) {
  const size_t ints = sizeof(int32_t) * (3 * static_cast<size_t>(launch_rows) + launch_logit_rows);
  return (ints + 15) / 16 * 16;
}

StepInputsView step_inputs_view(const unsigned char* device_inputs, int32_t launch_rows,
                                int32_t launch_logit_rows) {
  const int32_t* tokens = reinterpret_cast<const int32_t*>(device_inputs);
  return {.tokens = tokens,
          .positions = tokens + launch_rows,
          .slots = tokens + 2 * launch_rows,
          .logit_rows = tokens + 3 * launch_rows,
          .sampling_params = reinterpret_cast<const kernels::RowSamplingParams*>(
              device_inputs + step_params_offset(launch_rows, launch_logit_rows))};
}

void StepInputs::reserve(int32_t max_rows) {
  const size_t rows = static_cast<size_t>(max_rows);
  host_.resize(step_params_offset(max_rows, max_rows) + rows * sizeof(kernels::RowSamplingParams));
}

StepSamplingNeeds StepInputs::stage_sampling(std::span<const engine::RowSampling> sampling,
                                             int32_t launch_rows, int32_t launch_logit_rows) {
  StepSamplingNeeds needs;
  const int32_t logit_rows = static_cast<int32_t>(sampling.size());
  auto* params = reinterpret_cast<kernels::RowSamplingParams*>(
      host_.data() + step_params_offset(launch_rows, launch_logit_rows));
  for (int32_t i = 0; i < logit_rows; ++i) {
    if (sampling[i].params == nullptr) {
      // A row that wants its logits: sampled greedily (cheaply), its logits kept for the copy.
      params[i] = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .keep_logits = 1};
      continue;
    }
    const engine::SamplingParams& p = *sampling[i].params;
    params[i] = {.temperature = p.temperature,
                 .top_k = p.top_k,
                 .top_p = p.top_p,
                 .top_logprobs = p.top_logprobs,
                 .seed = p.seed,
                 .step = sampling[i].step};
    needs.any_draw |= p.temperature != 0.0f && p.top_k != 1;
    needs.any_top_logprobs |= p.top_logprobs > 0;
  }
  // Padded logit rows sample greedily (no workspace, no top list).
  for (int32_t i = logit_rows; i < launch_logit_rows; ++i) {
    params[i] = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .top_logprobs = 0};
  }
  return needs;
}

std::span<const unsigned char> StepInputs::stage_rows(const engine::StepBatch& batch,
                                                      int32_t launch_rows,
                                                      int32_t launch_logit_rows, int32_t sink_slot,
                                                      bool sample) {
  const engine::AttentionPlan& plan = *batch.plan;
  const int32_t rows = plan.num_queries;
  const int32_t logit_rows = static_cast<int32_t>(batch.logit_rows.size());
  int32_t* host = reinterpret_cast<int32_t*>(host_.data());
  std::copy(batch.tokens.begin(), batch.tokens.end(), host);
  std::fill(host + rows, host + launch_rows, 0);
  std::copy(plan.query_position.begin(), plan.query_position.end(), host + launch_rows);
  std::fill(host + launch_rows + rows, host + 2 * launch_rows, 0);
  std::copy(plan.query_slot.begin(), plan.query_slot.end(), host + 2 * launch_rows);
  std::fill(host + 2 * launch_rows + rows, host + 3 * launch_rows, sink_slot);
  std::copy(batch.logit_rows.begin(), batch.logit_rows.end(), host + 3 * launch_rows);
  std::fill(host + 3 * launch_rows + logit_rows, host + 3 * launch_rows + launch_logit_rows, 0);
  const size_t bytes =
      sample ? step_params_offset(launch_rows, launch_logit_rows) +
                   sizeof(kernels::RowSamplingParams) * launch_logit_rows
             : sizeof(int32_t) * (3 * static_cast<size_t>(launch_rows) + launch_logit_rows);
  return {host_.data(), bytes};
}

void StepInputs::map_tokens_to_shard(int32_t launch_rows, int32_t begin, int32_t count,
                                     int32_t outside) {
  int32_t* tokens = reinterpret_cast<int32_t*>(host_.data());
  for (int32_t r = 0; r < launch_rows; ++r) {
    const int32_t local = tokens[r] - begin;
    tokens[r] = local >= 0 && local < count ? local : outside;
  }
}

}  // namespace deft::models
