// The engine's scheduler (DESIGN.md §2): continuous batching of every live job and session
// command over one shared forest of KV. Each iteration:
//   1. cancellations: works whose client cancelled or went away end now and free their KV;
//   2. sessions: their queued commands start (branch / prune / close at once, the others as
//      works);
//   3. admission, in arrival order: a work is admitted while the referenced KV pages plus the
//      pending (worst-case) pages of every live work still fit the pool, so a live work never
//      runs out of KV. Cached KV (the prefix cache, engine/forest.h) counts as free: a step
//      that needs its pages evicts it (Forest::append), so the cache never holds a work back. A
//      work that does not fit yet waits without holding back the ones behind it (a one-page job
//      passes a sixteen-page one), but a job (Generate, RunTree) that has waited
//      `admission_patience` steps reserves the room: no later job is admitted before it.
//      Session commands are never held back: their sessions hold KV that only their own later
//      commands (prune, close) free, so making them wait could wait forever;
//   4. one step: every live work, in a rotating order (fair under a short budget), adds its
//      query rows under the step's token budget (prompts are prefilled in chunks), one plan
//      and one forward pass serve them all, and each work takes its logits.
// Single-threaded: the engine thread owns it (server/engine_thread.h feeds it).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention_planner.h"
#include "engine/forest.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/session.h"
#include "engine/works/work.h"

namespace deft::engine {

struct SchedulerOptions {
  int32_t page_tokens = 16;
  int32_t kv_pages = 2048;
  int32_t max_queued_works = 64;  // waiting for admission
  // Steps a job may wait while later, smaller ones are admitted before it holds them back.
  int32_t admission_patience = 64;
  int32_t max_step_tokens = 2048;  // query rows per step
  // Node ids of the forest start here (after the root, 0; at most kMaxFirstNodeId). Clients
  // see them (TreeSession, Verify): a high start shows at once whether a client handles ids
  // past 2^32, which a real server reaches after days.
  NodeId first_node_id = 1;
  // Most KV pages finished requests' prefixes keep cached (engine/prefix_cache.h): -1, the
  // whole pool; 0, no prefix cache.
  int64_t prefix_cache_pages = -1;
  PlannerOptions planner;
  SessionLimits sessions;
};

// What one step did (metrics, logs).
struct StepStats {
  int64_t rows = 0;
  int64_t logit_rows = 0;
  int64_t generated = 0;  // tokens sampled
  int32_t works = 0;
  int64_t kv_tokens_read = 0;
  double plan_seconds = 0;
  double forward_seconds = 0;
  double attention_seconds = -1;  // of the forward, when timed (every 16th step)
  double step_seconds = 0;
};

class Scheduler {
 public:
  // `runner` must hold KV slots for kv_pages * page_tokens tokens (checked by the caller).
  Scheduler(SchedulerOptions options, ModelRunner& runner, const Tokenizer& tokenizer);
  ~Scheduler();

  // Queues a work for admission. RESOURCE_EXHAUSTED when it could never fit the KV pool or
  // the step budget, or the queue is full: the work is then aborted with that status (its
  // client hears it) and nothing else changes.
  absl::Status submit(std::unique_ptr<Work> work);

  // Sessions (server/deft_service.cc's TreeSession and Verify handlers, via the engine thread).
  absl::Status open_session(uint64_t id, std::shared_ptr<SessionEvents> events);
  // Queues a command of a session; a Verify for an unknown session is answered NOT_FOUND.
  void session_command(uint64_t id, SessionCommand command);
  // The client closed or went away: the running command is cancelled, queued ones dropped,
  // and every node freed.
  void close_session(uint64_t id);

  // Steps 1-3 of an iteration.
  void prepare();
  // Step 4; nullopt when no live work had rows to add.
  std::optional<StepStats> step();

  // Ends every queued work with `status` (shutdown: stop admitting).
  void refuse_queued(const absl::Status& status);
  // Ends every live work and session with `status` (shutdown after the grace).
  void abort_all(const absl::Status& status);

  bool has_live() const { return !live_.empty(); }
  // A session has commands waiting that prepare() can start or answer now (the engine loop
  // must not sleep then: nothing else would wake it).
  bool has_ready_sessions() const;
  int32_t queued() const { return static_cast<int32_t>(queued_.size()); }
  int32_t live() const { return static_cast<int32_t>(live_.size()); }
  int32_t sessions() const { return static_cast<int32_t>(sessions_.size()); }
  const KvCacheManager& kv() const { return kv_; }
  const Forest& forest() const { return forest_; }

 private:
  absl::Status admissible(const Work& work) const;
  int64_t committed_pages() const;
  void pump_sessions();
  void end_live(size_t index, const absl::Status& status);
  // The step's logits destination for `rows` rows: the runner's buffer, or logits_.
  std::span<float> logits_for(size_t rows);

  SchedulerOptions options_;
  ModelRunner& runner_;
  const Tokenizer& tokenizer_;
  KvCacheManager kv_;
  Forest forest_;
  AttentionPlanner planner_;
  Sampler sampler_;
  AttentionPlan plan_;
  StepContext step_;
  std::vector<float> logits_;  // when the runner offers no logits_buffer()
  struct Queued {
    std::unique_ptr<Work> work;
    int32_t waited = 0;  // admission passes (steps) it has waited
  };
  std::deque<Queued> queued_;
  std::vector<std::unique_ptr<Work>> live_;
  size_t rotation_ = 0;
  std::vector<size_t> order_;  // this step's work order (kept to reuse its storage)
  int64_t step_count_ = 0;
  std::unordered_map<uint64_t, std::shared_ptr<Session>> sessions_;
};

}  // namespace deft::engine
