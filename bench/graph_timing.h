// Timing of GPU work by CUDA-graph replays: `launch(i)` for i in [0, launches_per_graph) is
// captured once into a graph, which is replayed `warmup` times, then `reps` times between two
// events; each sample is one replay's time / launches_per_graph, in µs. Neither host launch gaps
// nor idle clocks between launches enter the samples. Header-only: included by the CUDA benches.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "kernels/cuda_check.h"

namespace deft::bench {

inline std::vector<double> time_graph_replays(cudaStream_t stream, int launches_per_graph,
                                              int warmup, int reps,
                                              const std::function<void(int)>& launch) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches_per_graph; ++i) launch(i);
  DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int w = 0; w < warmup; ++w) DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t start, stop;
  DEFT_CUDA_CHECK(cudaEventCreate(&start));
  DEFT_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> samples_us;
  for (int r = 0; r < reps; ++r) {
    DEFT_CUDA_CHECK(cudaEventRecord(start, stream));
    DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DEFT_CUDA_CHECK(cudaEventRecord(stop, stream));
    DEFT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    samples_us.push_back(ms * 1e3 / launches_per_graph);
  }
  DEFT_CUDA_CHECK(cudaEventDestroy(start));
  DEFT_CUDA_CHECK(cudaEventDestroy(stop));
  DEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  return samples_us;
}

}  // namespace deft::bench
