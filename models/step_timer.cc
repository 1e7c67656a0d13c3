#include "models/step_timer.h"

#include "kernels/cuda_check.h"

namespace deft::models {

StepTimer::~StepTimer() {
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
}

cudaEvent_t StepTimer::start_event() {
  if (events_.empty()) {
    cudaEvent_t event;
    DEFT_CUDA_CHECK(cudaEventCreate(&event));
    events_.push_back(event);
    phases_.push_back(StepPhase::kCopy);
  }
  return events_[0];
}

void StepTimer::mark_started_in_graph() {
  start_event();
  marks_ = mode_ != StepTiming::kOff ? 1 : 0;
  phases_[0] = StepPhase::kCopy;
}

void StepTimer::record(StepPhase phase) {
  if (marks_ == static_cast<int32_t>(events_.size())) {
    cudaEvent_t event;
    DEFT_CUDA_CHECK(cudaEventCreate(&event));
    events_.push_back(event);
    phases_.push_back(phase);
  }
  phases_[marks_] = phase;
  DEFT_CUDA_CHECK(cudaEventRecord(events_[marks_], stream_));
  ++marks_;
}

void StepTimer::collect_times() {
  times_ = StepTimes{};
  if (mode_ == StepTiming::kOff || marks_ < 2) return;
  float ms = 0;
  DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[marks_ - 1]));
  times_.total_ms = ms;
  if (mode_ == StepTiming::kPhases) {
    for (int32_t i = 1; i < marks_; ++i) {
      DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
      double* sum = phases_[i] == StepPhase::kAttention  ? &times_.attention_ms
                    : phases_[i] == StepPhase::kGemm     ? &times_.gemm_ms
                    : phases_[i] == StepPhase::kOther    ? &times_.other_ms
                    : phases_[i] == StepPhase::kSampling ? &times_.sampling_ms
                                                         : &times_.copy_ms;
      *sum += ms;
    }
  }
  times_.valid = true;
}

}  // namespace deft::models
