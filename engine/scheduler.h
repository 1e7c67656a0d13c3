// The engine's scheduler (DESIGN.md §2): continuous batching of every live job and session
// command over one shared forest of KV. Each iteration:
//   1. cancellations: works whose client cancelled or went away end now and free their KV;
//   2. sessions: their queued commands start (branch / prune / close at once, the others as
//      works);
//   3. admission. Session commands first, never held back: their sessions hold KV that only
//      their own later commands (prune, close) free, so making them wait could wait forever.
//      Then jobs, in priority order and, within a priority, round robin over clients (a
//      client's k-th waiting job counts as if k of its jobs were live already: a client with
//      60 queued jobs does not starve one with 1), oldest first. A job is admitted while the
//      referenced KV pages plus every live work's reserve (Work::reserve_pages) and its own
//      fit the pool; cached KV (the prefix cache, engine/forest.h) counts as free, since a step
//      evicts it when it needs the pages. Step admission (the default) reserves a preemptible
//      job's next steps only, not its worst case; worst-case admission (the old policy, kept to
//      compare) reserves max_tokens on every branch. A job that does not fit yet waits without
//      holding back the ones behind it (a one-page job passes a sixteen-page one), but once it
//      has waited `admission_patience` steps it reserves the room: nothing after it is admitted.
//   4. one step: every live work, most important first (priority, then age), adds its query
//      rows under the step's token budget; prompts are prefilled in chunks of at most
//      `max_prefill_tokens` rows a step, so decode rows always get the rest of the budget and a
//      long prompt delays running branches by at most one chunk. Before a work adds its rows
//      the scheduler makes room for the pages they may take (Work::step_pages): it evicts
//      cached KV, then preempts the least important preemptible work that has not added rows
//      this step (the lowest priority, the newest; possibly the work itself), which lets go of
//      its KV and waits in the queue to recompute it (engine/works/generate_work.h). A work
//      that still lacks room (nothing left to preempt) skips the step. One plan and one forward
//      pass serve all the rows, and each work takes its logits.
// With a draft model (speculative decoding, engine/speculation/draft_model.h), step 4 starts with
// the draft passes of every live work, in the same order, before any target row is added.
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
#include "engine/speculation/draft_model.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/session.h"
#include "engine/works/work.h"

namespace deft::engine {

// What admission keeps free for a live job (scheduler.h, step 3).
enum class Admission : uint8_t {
  kStep,       // its next steps' pages; a step short of KV preempts (the default)
  kWorstCase,  // max_tokens on every branch; nothing is ever preempted
};

struct SchedulerOptions {
  int32_t page_tokens = 16;
  int32_t kv_pages = 2048;
  int32_t max_queued_works = 64;  // waiting for admission
  // Steps a job may wait while later, smaller ones are admitted before it holds them back.
  int32_t admission_patience = 64;
  Admission admission = Admission::kStep;
  int32_t max_step_tokens = 2048;  // query rows per step
  // Of which prompt and extension chunks may take (0: half of max_step_tokens, at least 1).
  int32_t max_prefill_tokens = 0;
  // Node ids of the forest start here (after the root, 0; at most kMaxFirstNodeId). Clients
  // see them (TreeSession, Verify): a high start shows at once whether a client handles ids
  // past 2^32, which a real server reaches after days.
  NodeId first_node_id = 1;
  // Most KV pages finished requests' prefixes keep cached (engine/prefix_cache.h): -1, the
  // whole pool; 0, no prefix cache.
  int64_t prefix_cache_pages = -1;
  PlannerOptions planner;
  SessionLimits sessions;
  // The draft model's KV pool in pages of page_tokens (0: kv_pages). A draft step short of
  // pages drafts less; admission does not count them.
  int32_t draft_kv_pages = 0;
  // Speculation pauses in steps of more than this many live works (0: never): their requests
  // decode plainly there, the same tokens. A verified tree costs its rows' compute, which is
  // free beside a small batch's weight reads and not beside a large one's.
  int32_t speculative_max_batch = 0;
};

// What one step did (metrics, logs).
struct StepStats {
  int64_t rows = 0;
  int64_t logit_rows = 0;
  int64_t generated = 0;  // tokens sampled
  int64_t prompt_rows = 0;  // rows of tokens clients sent (StepContext::prompt_rows)
  int32_t works = 0;
  int64_t kv_tokens_read = 0;
  double plan_seconds = 0;
  double forward_seconds = 0;
  double attention_seconds = -1;  // of the forward, when timed (every 16th step)
  double step_seconds = 0;
  // Speculative decoding: the draft passes, and per verified tree the entries it accepted.
  DraftStats draft;
  std::vector<int32_t> accepted_lengths;
  int64_t drafted = 0;  // tree entries verified
};

class Scheduler {
 public:
  // `runner` must hold KV slots for kv_pages * page_tokens tokens (checked by the caller), and
  // `draft` (the draft model, or null) for draft_kv_pages * page_tokens.
  Scheduler(SchedulerOptions options, ModelRunner& runner, const Tokenizer& tokenizer,
            ModelRunner* draft = nullptr);
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

  // Ends every queued work with `status` (shutdown: stop admitting), except preempted ones:
  // they were admitted before, and get the shutdown's grace as live works do.
  void refuse_queued(const absl::Status& status);
  // Ends every live work and session with `status` (shutdown after the grace).
  void abort_all(const absl::Status& status);

  bool has_live() const { return !live_.empty(); }
  // A session has commands waiting that prepare() can start or answer now (the engine loop
  // must not sleep then: nothing else would wake it).
  bool has_ready_sessions() const;
  // The last step preempted works, which the next prepare() may admit again (the engine loop
  // must not sleep then either).
  bool has_preempted() const { return preempted_waiting_; }
  int32_t queued() const { return static_cast<int32_t>(queued_.size()); }
  // Works preempted (and queued to recompute) since the start.
  int64_t preemptions() const { return preemptions_; }
  int32_t live() const { return static_cast<int32_t>(live_.size()); }
  int32_t sessions() const { return static_cast<int32_t>(sessions_.size()); }
  const KvCacheManager& kv() const { return kv_; }
  const Forest& forest() const { return forest_; }
  // The draft model, or null.
  const DraftModel* draft() const { return draft_.get(); }

 private:
  absl::Status admissible(const Work& work) const;
  // Pages admission keeps for a work (Admission).
  int64_t reserved_pages(const Work& work) const;
  int64_t committed_pages() const;
  void admit();
  // Step 4's room for the work at order_[position]: true when `pages` more pages are free
  // or cached, preempting works from the end of order_ (at or after `position`) as needed.
  bool make_room(int64_t pages, size_t position);
  // Moves this step's preempted works back to the queue.
  void requeue_preempted();
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
  std::unique_ptr<DraftModel> draft_;
  std::vector<Work*> draft_works_;  // the step's works for the draft passes (storage kept)
  struct Queued {
    std::unique_ptr<Work> work;
    uint64_t arrival = 0;    // submission order (kept through preemptions)
    int32_t waited = 0;      // admission passes (steps) it has waited
    bool preempted = false;  // admitted before: refuse_queued() spares it
  };
  struct Live {
    std::unique_ptr<Work> work;
    uint64_t arrival = 0;
  };
  std::deque<Queued> queued_;
  std::vector<Live> live_;
  uint64_t next_arrival_ = 0;
  std::vector<size_t> order_;       // this step's work order (kept to reuse its storage)
  std::vector<uint8_t> preempted_;  // per live work, this step
  std::vector<size_t> candidates_;  // admission's order of queued_ (storage kept)
  int64_t step_count_ = 0;
  int64_t preemptions_ = 0;
  bool preempted_waiting_ = false;
  std::unordered_map<uint64_t, std::shared_ptr<Session>> sessions_;
};

}  // namespace deft::engine
