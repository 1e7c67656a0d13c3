// CUDA-event timing of the CUDA runner's steps (StepTiming, StepTimes in models/llama_cuda.h).
// kOff records nothing; kTotal an event at the step's start and one at its end; kPhases also one
// after every launch, each interval summed into the phase of the work launched in it. Events are
// made on first use and reused, so a timed step allocates nothing after the first. A graph step
// records the start event as the graph's first node (start_event(), mark_started_in_graph()), so
// its total starts when the GPU does and the step makes no CUDA call before its launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "models/llama_cuda.h"

namespace deft::models {

// What the work launched since the previous mark was.
enum class StepPhase { kAttention, kGemm, kOther, kCopy, kSampling };

class StepTimer {
 public:
  // Events are recorded on `stream`.
  explicit StepTimer(cudaStream_t stream) : stream_(stream) {}
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  StepTiming mode() const { return mode_; }
  void set_mode(StepTiming mode) { mode_ = mode; }

  // The step's first mark (the start event, kTotal and kPhases).
  void mark_start() {
    marks_ = 0;
    if (mode_ != StepTiming::kOff) record(StepPhase::kCopy);
  }
  // The start event a graph records as its first node on every replay, whatever the timing.
  cudaEvent_t start_event();
  // mark_start() for a step whose graph records start_event() itself.
  void mark_started_in_graph();
  // The work launched since the previous mark was of `phase` (kPhases only).
  void mark(StepPhase phase) {
    if (mode_ == StepTiming::kPhases) record(phase);
  }
  // The step's last mark (kTotal and kPhases).
  void mark_end(StepPhase phase) {
    if (mode_ != StepTiming::kOff) record(phase);
  }

  // Forgets the last step's times (a step that records none reports invalid times).
  void clear_times() { times_ = StepTimes{}; }
  // Reads the events into times(); after the stream synchronised.
  void collect_times();
  const StepTimes& times() const { return times_; }

 private:
  void record(StepPhase phase);

  cudaStream_t stream_;
  StepTiming mode_ = StepTiming::kOff;
  std::vector<cudaEvent_t> events_;  // events_[i] ends interval i, which belongs to phases_[i]
  std::vector<StepPhase> phases_;
  int32_t marks_ = 0;
  StepTimes times_;
};

}  // namespace deft::models
