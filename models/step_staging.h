// A step's inputs staged for the GPU in one pinned-to-device copy with its attention plan. The CUDA
// runner (models/llama_cuda.h) lays them out in one host buffer, passed to the plan's upload as
// its extra bytes (DevicePlan::upload / stage_padded: they land at DevicePlan::extra()), so the
// plan and the inputs reach the GPU in one transfer, and in a graph step in the graph's first node:
//   tokens | positions | slots | logit rows      int32, launch_rows x 3 + launch_logit_rows
//   sampling params of the logit rows            from step_params_offset(), 16-byte aligned
// Each array is padded from the step's size to the launch's (a graph bucket's, or the step's own,
// models/step_graphs.h): padded rows read token 0 at position 0 and write their K/V into the
// runner's sink slot (one past the KV pool, never read); padded logit rows point at row 0 and
// sample greedily (no workspace, no top list). StepInputsView reads the same layout on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/model_runner.h"
#include "kernels/sampling.h"

namespace deft::models {

// Where a step's sampling params start in the staged inputs: after its four int32 arrays
// (launch_rows x 3 + launch_logit_rows), 16-byte aligned.
size_t step_params_offset(int32_t launch_rows, int32_t launch_logit_rows);

// Device pointers into a step's staged inputs once the plan's copy has run.
struct StepInputsView {
  const int32_t* tokens = nullptr;                              // [launch_rows]
  const int32_t* positions = nullptr;                           // [launch_rows]
  const int32_t* slots = nullptr;                               // [launch_rows]
  const int32_t* logit_rows = nullptr;                          // [launch_logit_rows]
  const kernels::RowSamplingParams* sampling_params = nullptr;  // [launch_logit_rows]
};
StepInputsView step_inputs_view(const unsigned char* device_inputs, int32_t launch_rows,
                                int32_t launch_logit_rows);

// What the sampled logit rows ask for beyond the greedy token.
struct StepSamplingNeeds {
  bool any_draw = false;          // a row draws (temperature != 0, top_k != 1): the workspace
  bool any_top_logprobs = false;  // a row wants its top logprobs back
};

// The host side of a step's inputs: one buffer, reused by every step.
class StepInputs {
 public:
  // Room for steps of up to `max_rows` query rows and logit rows.
  void reserve(int32_t max_rows);

  // Stages the sampling params of the step's logit rows (`sampling`, one per logit row; a row
  // without params, which wants its logits, samples greedily and keeps them), and greedy ones
  // for the padded rows up to `launch_logit_rows`.
  StepSamplingNeeds stage_sampling(std::span<const engine::RowSampling> sampling,
                                   int32_t launch_rows, int32_t launch_logit_rows);
  // Stages the step's tokens, positions, slots (from `batch` and its plan) and logit rows padded
  // to the launch's sizes (padded rows write `sink_slot`). Returns the bytes to upload: the four
  // arrays, and with `sample` the sampling params staged by stage_sampling().
  std::span<const unsigned char> stage_rows(const engine::StepBatch& batch, int32_t launch_rows,
                                            int32_t launch_logit_rows, int32_t sink_slot,
                                            bool sample);
  // Tensor parallelism (models/tensor_parallel.h): after stage_rows(), the staged tokens become
  // rows of a rank's embedding shard: token t in [begin, begin + count) becomes t - begin, any
  // other `outside` (the shard's zero row).
  void map_tokens_to_shard(int32_t launch_rows, int32_t begin, int32_t count, int32_t outside);

 private:
  std::vector<unsigned char> host_;
};

}  // namespace deft::models
