// The engine thread: one thread owns the model runner and the engine Scheduler (the shared
// forest of KV, every live job and session; DESIGN.md §2). gRPC handlers talk to it only
// through a mutex-guarded inbox of commands and per-request event queues
// (engine/works/event_queue.h): they never touch the scheduler. Nothing here knows gRPC;
// server/deft_service.cc maps requests and events to the proto.
//
// Each iteration: the inbox is drained into the scheduler, cancellations free KV, sessions
// start their commands, queued works are admitted under the KV pool, and one step decodes
// every live work under one attention plan and one forward pass. Idle, the thread sleeps
// until a command arrives.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "engine/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/generate_work.h"
#include "engine/works/session.h"
#include "engine/works/tree_search_work.h"

namespace deft::server {

class ServerMetrics;

// Counters a health check or a test can read at any time.
struct EngineSnapshot {
  int32_t kv_pages_used = 0;  // referenced by live work (cached prefixes count as free)
  int32_t kv_pages_free = 0;
  int32_t queued_jobs = 0;
  int32_t live_jobs = 0;
  int32_t sessions = 0;
};

class EngineThread {
 public:
  // Starts the thread. `runner` must hold KV slots for kv_pages * page_tokens tokens, and
  // `draft` (the speculative draft model, optional) for draft_kv_pages * page_tokens with the
  // runner's vocabulary (INVALID_ARGUMENT otherwise); `tokenizer` and `metrics` (optional)
  // must outlive this object.
  static absl::StatusOr<std::unique_ptr<EngineThread>> start(
      engine::SchedulerOptions options, std::unique_ptr<engine::ModelRunner> runner,
      const engine::Tokenizer& tokenizer, ServerMetrics* metrics,
      std::unique_ptr<engine::ModelRunner> draft = nullptr);
  ~EngineThread();  // shutdown(0) when still running
  EngineThread(const EngineThread&) = delete;
  EngineThread& operator=(const EngineThread&) = delete;

  const engine::ModelInfo& model_info() const { return runner_->info(); }
  const engine::SchedulerOptions& options() const { return options_; }

  // Requests. Each returns its event queue at once; a refusal (RESOURCE_EXHAUSTED: the queue
  // is full or the request could never fit; UNAVAILABLE: shutting down) ends it with that
  // status and no event.
  std::shared_ptr<engine::GenerateEvents> generate(engine::GenerateJob job);
  std::shared_ptr<engine::TreeSearchEvents> run_tree(engine::TreeSearchJob job);
  // Opens a session and returns its id once the engine has it: RESOURCE_EXHAUSTED when too
  // many are open, UNAVAILABLE when shutting down.
  absl::StatusOr<uint64_t> open_session(std::shared_ptr<engine::SessionEvents> events);
  void session_command(uint64_t session, engine::SessionCommand command);
  void close_session(uint64_t session);
  // A Verify: answered through command.reply (NOT_FOUND for an unknown session).
  void verify(uint64_t session, engine::VerifyCommand command);

  // Stops admitting (queued requests end with UNAVAILABLE), lets live ones run for up to
  // `grace`, then ends the rest (UNAVAILABLE; branches finish kCancelled). Returns at once;
  // may be called again with a shorter grace.
  void begin_shutdown(std::chrono::milliseconds grace);
  // begin_shutdown(grace), then waits for the engine thread to end.
  void shutdown(std::chrono::milliseconds grace);

  EngineSnapshot snapshot() const;

 private:
  using Command = std::function<void(engine::Scheduler&)>;
  EngineThread(engine::SchedulerOptions options, std::unique_ptr<engine::ModelRunner> runner,
               const engine::Tokenizer& tokenizer, ServerMetrics* metrics,
               std::unique_ptr<engine::ModelRunner> draft);
  // Queues a command for the engine thread; false once shutdown has begun.
  bool post(Command command);
  // Posts a work for admission; `events` ends with UNAVAILABLE when shutdown has begun.
  template <typename Events>
  std::shared_ptr<Events> submit(std::unique_ptr<engine::Work> work,
                                 std::shared_ptr<Events> events);
  void run();
  void publish();

  engine::SchedulerOptions options_;
  std::unique_ptr<engine::ModelRunner> runner_;
  const engine::Tokenizer& tokenizer_;
  ServerMetrics* metrics_;
  std::unique_ptr<engine::ModelRunner> draft_;    // the draft model, or null
  std::unique_ptr<engine::Scheduler> scheduler_;  // engine thread only

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Command> inbox_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point cancel_at_;
  std::atomic<uint64_t> next_session_id_{1};

  std::atomic<int32_t> queued_jobs_{0};
  std::atomic<int32_t> live_jobs_{0};
  std::atomic<int32_t> sessions_{0};
  std::atomic<int32_t> kv_pages_used_{0};

  std::mutex join_mutex_;
  std::thread thread_;
};

}  // namespace deft::server
