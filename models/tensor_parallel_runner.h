// One engine::ModelRunner over the ranks of a tensor-parallel model (models/tensor_parallel.h):
// each rank is a runner of its own (a LlamaCudaRunner on its GPU with an NCCL communicator, or
// a LlamaCpuRunner with HostCollectives, the twin) that meets the others in collectives inside
// its step. Ranks are threads of this one process: rank 0 runs on the caller's thread (the
// engine thread), ranks 1.. on threads of their own that live as long as the runner. Why
// threads and not a process per GPU: the engine, its plan and the step's inputs live in one
// process; every rank reads the same host plan and uploads it to its own GPU (planned once, no
// IPC), sampled tokens come back to the engine from rank 0 and reach the other ranks as the next
// step's inputs (no broadcast), and NCCL's communicators of one process are made in one call.
//
// A step runs on every rank at once; forward()/forward_sampled() return when all have finished.
// Rank 0 writes the logits or samples; the others are called with no logits (they run the LM
// head on their vocabulary rows and the all-gather only). Contract with the ranks: they check a
// step identically (same checks on the same inputs), so a step they refuse is refused by all of
// them before any collective, and no rank waits on a collective another never reaches.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "engine/model_runner.h"

namespace deft::models {

class TensorParallelRunner final : public engine::ModelRunner {
 public:
  // `ranks[r]` is rank r; `shared` (e.g. the NCCL communicators) is released after the ranks.
  TensorParallelRunner(std::vector<std::unique_ptr<engine::ModelRunner>> ranks,
                       std::shared_ptr<void> shared = nullptr);
  ~TensorParallelRunner() override;

  int32_t num_ranks() const { return static_cast<int32_t>(ranks_.size()); }
  engine::ModelRunner& rank(int32_t r) { return *ranks_[static_cast<size_t>(r)]; }

  const engine::ModelInfo& info() const override { return ranks_[0]->info(); }
  absl::Status forward(const engine::StepBatch& batch, std::span<float> logits) override;
  bool samples_on_device() const override { return ranks_[0]->samples_on_device(); }
  absl::Status forward_sampled(const engine::StepBatch& batch,
                               std::span<const engine::RowSampling> rows,
                               std::span<engine::SampledToken> out,
                               std::span<float> logits = {}) override;
  std::span<float> logits_buffer(size_t floats) override {
    return ranks_[0]->logits_buffer(floats);
  }
  void time_attention(bool on) override;
  double last_attention_seconds() const override { return ranks_[0]->last_attention_seconds(); }
  engine::AttentionWave attention_wave() const override { return ranks_[0]->attention_wave(); }

  // Runs body(r) for r in [0, count) on `count` threads at once (r = 0 on the caller's) and
  // returns when all have: how the ranks are loaded, each on its own GPU, in parallel.
  static void run_parallel(int32_t count, const std::function<void(int32_t)>& body);

 private:
  // Runs body(r) on every rank's thread (rank 0 here) and waits for all.
  void on_every_rank(const std::function<void(int32_t)>& body);
  void worker(int32_t rank);

  std::vector<std::unique_ptr<engine::ModelRunner>> ranks_;
  std::shared_ptr<void> shared_;
  std::vector<std::thread> threads_;  // ranks 1..

  std::mutex mutex_;
  std::condition_variable work_ready_, work_done_;
  const std::function<void(int32_t)>* job_ = nullptr;
  uint64_t generation_ = 0;  // bumped per job
  int32_t pending_ = 0;      // workers still on the current job
  bool stopping_ = false;
};

}  // namespace deft::models
