#include "models/tensor_parallel_runner.h"

#include <utility>

#include "kernels/check.h"

namespace deft::models {

TensorParallelRunner::TensorParallelRunner(std::vector<std::unique_ptr<engine::ModelRunner>> ranks,
                                           std::shared_ptr<void> shared)
    : ranks_(std::move(ranks)), shared_(std::move(shared)) {
  DEFT_CHECK(!ranks_.empty(), "TensorParallelRunner: no ranks");
  for (int32_t r = 1; r < num_ranks(); ++r) threads_.emplace_back([this, r] { worker(r); });
}

TensorParallelRunner::~TensorParallelRunner() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& thread : threads_) thread.join();
  ranks_.clear();  // before `shared_` (the communicators they use)
}

void TensorParallelRunner::worker(int32_t rank) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int32_t)>* job = nullptr;
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(rank);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

void TensorParallelRunner::on_every_rank(const std::function<void(int32_t)>& body) {
  {
    std::lock_guard lock(mutex_);
    job_ = &body;
    pending_ = num_ranks() - 1;
    ++generation_;
  }
  work_ready_.notify_all();
  body(0);
  std::unique_lock lock(mutex_);
  work_done_.wait(lock, [&] { return pending_ == 0; });
}

void TensorParallelRunner::run_parallel(int32_t count, const std::function<void(int32_t)>& body) {
  std::vector<std::thread> threads;
  for (int32_t r = 1; r < count; ++r) threads.emplace_back(body, r);
  if (count > 0) body(0);
  for (std::thread& thread : threads) thread.join();
}

absl::Status TensorParallelRunner::forward(const engine::StepBatch& batch,
                                           std::span<float> logits) {
  std::vector<absl::Status> statuses(ranks_.size());
  on_every_rank([&](int32_t r) {
    statuses[static_cast<size_t>(r)] =
        ranks_[static_cast<size_t>(r)]->forward(batch, r == 0 ? logits : std::span<float>());
  });
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status TensorParallelRunner::forward_sampled(const engine::StepBatch& batch,
                                                   std::span<const engine::RowSampling> rows,
                                                   std::span<engine::SampledToken> out,
                                                   std::span<float> logits) {
  if (!samples_on_device()) return engine::ModelRunner::forward_sampled(batch, rows, out, logits);
  if (absl::Status status =
          engine::check_row_sampling(batch, rows, out, logits.size(), info().vocab_size);
      !status.ok()) {
    return status;
  }
  // Rank 0 samples; the others run the step without logits (forward()'s path on them).
  std::vector<absl::Status> statuses(ranks_.size());
  on_every_rank([&](int32_t r) {
    statuses[static_cast<size_t>(r)] = r == 0 ? ranks_[0]->forward_sampled(batch, rows, out, logits)
                                              : ranks_[static_cast<size_t>(r)]->forward(batch, {});
  });
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void TensorParallelRunner::time_attention(bool on) {
  for (const std::unique_ptr<engine::ModelRunner>& rank : ranks_) rank->time_attention(on);
}

}  // namespace deft::models
