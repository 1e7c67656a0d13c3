// The engine thread: one thread owns the model runner, the KV cache and every live job
// (DESIGN.md §2); gRPC handlers talk to it only through a mutex-guarded command queue (submit)
// and per-job event streams (GenerateStream). Generate jobs are batched continuously: every
// step decodes the next token of every live branch of every live job, plus the prefill of
// newly admitted prompts, under one attention plan and one forward pass.
//
// Admission never over-commits KV: a job is admitted only when its worst case (prompt pages
// plus max_tokens pages per branch) fits beside the worst cases of the live jobs, so a live
// job never runs out of KV; jobs wait in a FIFO queue until then (max_queued_jobs, then
// RESOURCE_EXHAUSTED). A finished branch frees its node's pages at once, a cancelled job its
// whole tree.
//
// Nothing here knows gRPC; server/deft_service.cc maps requests and events to the proto.
// TODO(scheduler issue): the step logic belongs in engine/Scheduler once that exists, with
// RunTree and TreeSession jobs beside Generate.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_planner.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

namespace deft::server {

class ServerMetrics;
struct StepRecord;

enum class FinishReason : uint8_t { kNone, kLength, kStop, kEos, kCancelled };

// New tokens of one branch, as one streamed message.
struct BranchDelta {
  int32_t branch = 0;
  std::vector<engine::TokenId> ids;
  std::string text;  // complete UTF-8; text held back for a possible stop string comes later
  std::vector<float> logprobs;
  std::vector<std::vector<engine::TokenLogprob>> top_logprobs;  // one per id when asked for
  FinishReason finish = FinishReason::kNone;
};

// The event stream of one job, shared by its gRPC handler and the engine thread.
class GenerateStream {
 public:
  // Handler side. Moves the deltas that arrived into `out` (waiting up to `timeout` for the
  // first); returns false once the job has ended and every delta has been taken.
  bool next(std::vector<BranchDelta>& out, std::chrono::milliseconds timeout);
  // The job's end: OK, or why it failed (valid once next() returned false).
  absl::Status final_status() const;
  // Asks the engine to drop the job (client cancelled or went away); its KV is freed at the
  // start of the next step.
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }

  // Engine side.
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  void push(BranchDelta delta);
  void finish(absl::Status status);

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<BranchDelta> deltas_;
  bool finished_ = false;
  absl::Status status_;
  std::atomic<bool> cancelled_{false};
};

struct GenerateJobRequest {
  std::vector<engine::TokenId> prompt;  // validated: non-empty, ids inside the vocabulary
  int32_t n = 1;                        // branches
  int32_t max_tokens = 1;               // per branch
  engine::SamplingParams sampling;      // its stop_token_ids end a branch (reason kStop)
  std::vector<std::string> stop;        // stop strings (the text is cut before them)
  bool ignore_eos = false;              // EOS tokens do not end a branch
};

struct EngineOptions {
  int32_t page_tokens = 16;
  int32_t kv_pages = 2048;
  int32_t max_queued_jobs = 64;
  int32_t max_step_tokens = 2048;
  engine::PlannerOptions planner;
};

// Counters a health check or a test can read at any time.
struct EngineSnapshot {
  int32_t kv_pages_used = 0;
  int32_t kv_pages_free = 0;
  int32_t queued_jobs = 0;
  int32_t live_jobs = 0;
};

class EngineThread {
 public:
  // Starts the thread. `runner` must hold KV slots for kv_pages * page_tokens tokens;
  // `tokenizer` and `metrics` (optional) must outlive this object.
  static absl::StatusOr<std::unique_ptr<EngineThread>> start(
      EngineOptions options, std::unique_ptr<engine::ModelRunner> runner,
      const engine::Tokenizer& tokenizer, ServerMetrics* metrics);
  ~EngineThread();  // shutdown(0) when still running
  EngineThread(const EngineThread&) = delete;
  EngineThread& operator=(const EngineThread&) = delete;

  const engine::ModelInfo& model_info() const { return runner_->info(); }
  const EngineOptions& options() const { return options_; }

  // KV pages a job may hold at its peak.
  int64_t job_max_pages(const GenerateJobRequest& request) const;

  // Queues a job. RESOURCE_EXHAUSTED when the queue is full or the job could never fit in the
  // KV pool; UNAVAILABLE once shutdown has begun.
  absl::StatusOr<std::shared_ptr<GenerateStream>> submit(GenerateJobRequest request);

  // Stops admitting (queued jobs end with UNAVAILABLE), lets live jobs run for up to `grace`,
  // then cancels the rest (UNAVAILABLE, branches finish kCancelled). Returns at once; may be
  // called again with a shorter grace.
  void begin_shutdown(std::chrono::milliseconds grace);
  // begin_shutdown(grace), then waits for the engine thread to end.
  void shutdown(std::chrono::milliseconds grace);

  EngineSnapshot snapshot() const;

 private:
  struct Job;
  EngineThread(EngineOptions options, std::unique_ptr<engine::ModelRunner> runner,
               const engine::Tokenizer& tokenizer, ServerMetrics* metrics);
  // The engine thread's loop and its parts (engine thread only).
  void run();
  void publish();
  void drain_commands(bool* stopping, bool* cancel_live);
  void cancel_jobs(bool stopping, bool cancel_live);
  void admit_jobs();
  void run_step();
  absl::Status build_step(StepRecord& record);
  void sample_step(StepRecord& record);
  absl::Status add_token(Job& job, int32_t index, const engine::SampledToken& sampled,
                         StepRecord& record);
  void end_job(size_t index, FinishReason reason, const absl::Status& status);

  EngineOptions options_;
  std::unique_ptr<engine::ModelRunner> runner_;
  const engine::Tokenizer& tokenizer_;
  ServerMetrics* metrics_;

  // Command queue (handlers -> engine).
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::unique_ptr<Job>> submitted_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point cancel_at_;
  uint64_t next_job_id_ = 1;

  std::atomic<int32_t> queued_jobs_{0};
  std::atomic<int32_t> live_jobs_{0};
  std::atomic<int32_t> kv_pages_used_{0};

  struct State;  // owned by the engine thread only
  std::unique_ptr<State> state_;
  std::mutex join_mutex_;
  std::thread thread_;
};

}  // namespace deft::server
