#include "server/engine_thread.h"

#include <malloc.h>

#include <future>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

using Clock = std::chrono::steady_clock;

// How long the engine sleeps when every live work is paused for its reader: short next to a
// reader's pace, long enough that a paused server uses no CPU to speak of.
constexpr std::chrono::milliseconds kPausedNap{5};

absl::Status shutting_down() { return absl::UnavailableError("the server is shutting down"); }

}  // namespace

absl::StatusOr<std::unique_ptr<EngineThread>> EngineThread::start(
    engine::SchedulerOptions options, std::unique_ptr<engine::ModelRunner> runner,
    const engine::Tokenizer& tokenizer, ServerMetrics* metrics,
    std::unique_ptr<engine::ModelRunner> draft) {
  const int64_t slots = int64_t{options.kv_pages} * options.page_tokens;
  if (runner->info().num_kv_slots < slots) {
    return absl::InvalidArgumentError(absl::StrCat("engine: the model runner holds ",
                                                   runner->info().num_kv_slots,
                                                   " KV slots but the pool needs ", slots));
  }
  if (draft != nullptr) {
    const int64_t draft_slots =
        int64_t{options.draft_kv_pages > 0 ? options.draft_kv_pages : options.kv_pages} *
        options.page_tokens;
    if (draft->info().num_kv_slots < draft_slots) {
      return absl::InvalidArgumentError(absl::StrCat("engine: the draft model runner holds ",
                                                     draft->info().num_kv_slots,
                                                     " KV slots but its pool needs ", draft_slots));
    }
    if (draft->vocab_size() != runner->vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine: the draft model's vocabulary has ", draft->vocab_size(),
                       " tokens but the model's has ", runner->vocab_size(),
                       ": a draft model must share the model's tokenizer"));
    }
  }
  std::unique_ptr<EngineThread> engine(
      new EngineThread(options, std::move(runner), tokenizer, metrics, std::move(draft)));
  engine->thread_ = std::thread([raw = engine.get()] { raw->run(); });
  return engine;
}

EngineThread::EngineThread(engine::SchedulerOptions options,
                           std::unique_ptr<engine::ModelRunner> runner,
                           const engine::Tokenizer& tokenizer, ServerMetrics* metrics,
                           std::unique_ptr<engine::ModelRunner> draft)
    : options_(options),
      runner_(std::move(runner)),
      tokenizer_(tokenizer),
      metrics_(metrics),
      draft_(std::move(draft)),
      scheduler_(std::make_unique<engine::Scheduler>(options, *runner_, tokenizer, draft_.get())) {}

EngineThread::~EngineThread() { shutdown(std::chrono::milliseconds(0)); }

bool EngineThread::post(Command command) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    inbox_.push_back(std::move(command));
  }
  wake_.notify_one();
  return true;
}

template <typename Events>
std::shared_ptr<Events> EngineThread::submit(std::unique_ptr<engine::Work> work,
                                             std::shared_ptr<Events> events) {
  // A refusal by the scheduler reaches the client through the work's events (submit aborts it).
  auto shared = std::make_shared<std::unique_ptr<engine::Work>>(std::move(work));
  if (!post([shared](engine::Scheduler& scheduler) { (void)scheduler.submit(std::move(*shared)); })) {
    events->finish(shutting_down());
  }
  return events;
}

std::shared_ptr<engine::GenerateEvents> EngineThread::generate(engine::GenerateJob job) {
  auto events = std::make_shared<engine::GenerateEvents>();
  return submit(std::make_unique<engine::GenerateWork>(std::move(job), events, tokenizer_,
                                                       options_.page_tokens),
                events);
}

std::shared_ptr<engine::TreeSearchEvents> EngineThread::run_tree(engine::TreeSearchJob job) {
  auto events = std::make_shared<engine::TreeSearchEvents>();
  return submit(std::make_unique<engine::TreeSearchWork>(std::move(job), events, tokenizer_,
                                                         options_.page_tokens),
                events);
}

absl::StatusOr<uint64_t> EngineThread::open_session(
    std::shared_ptr<engine::SessionEvents> events) {
  const uint64_t id = next_session_id_.fetch_add(1);
  auto opened = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = opened->get_future();
  if (!post([id, events, opened](engine::Scheduler& scheduler) {
        opened->set_value(scheduler.open_session(id, events));
      })) {
    return shutting_down();
  }
  if (absl::Status status = result.get(); !status.ok()) return status;
  return id;
}

void EngineThread::session_command(uint64_t session, engine::SessionCommand command) {
  auto shared = std::make_shared<engine::SessionCommand>(std::move(command));
  (void)post([session, shared](engine::Scheduler& scheduler) {
    scheduler.session_command(session, std::move(*shared));
  });
}

void EngineThread::close_session(uint64_t session) {
  (void)post([session](engine::Scheduler& scheduler) { scheduler.close_session(session); });
}

void EngineThread::verify(uint64_t session, engine::VerifyCommand command) {
  std::shared_ptr<engine::VerifyReply> reply = command.reply;
  auto shared =
      std::make_shared<engine::SessionCommand>(engine::SessionCommand{.op = std::move(command)});
  if (!post([session, shared](engine::Scheduler& scheduler) {
        scheduler.session_command(session, std::move(*shared));
      })) {
    reply->finish(shutting_down());
  }
}

void EngineThread::shutdown(std::chrono::milliseconds grace) {
  begin_shutdown(grace);
  std::lock_guard lock(join_mutex_);
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void EngineThread::begin_shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      stopping_ = true;
      cancel_at_ = Clock::now() + grace;
    } else {
      cancel_at_ = std::min(cancel_at_, Clock::now() + grace);
    }
  }
  wake_.notify_one();
}

EngineSnapshot EngineThread::snapshot() const {
  const int32_t used = kv_pages_used_.load();
  return {.kv_pages_used = used,
          .kv_pages_free = options_.kv_pages - used,
          .queued_jobs = queued_jobs_.load(),
          .live_jobs = live_jobs_.load(),
          .sessions = sessions_.load()};
}

void EngineThread::publish() {
  const engine::Scheduler& s = *scheduler_;
  // Used: referenced by live work; cached prefixes are free for admission (engine/forest.h).
  const auto used = static_cast<int32_t>(s.forest().referenced_pages());
  kv_pages_used_.store(used);
  queued_jobs_.store(s.queued());
  live_jobs_.store(s.live());
  sessions_.store(s.sessions());
  if (metrics_ != nullptr) {
    const engine::PrefixCacheStats& cache = s.forest().cache_stats();
    metrics_->set_engine_state(s.queued(), s.live(), used, s.kv().free_pages());
    metrics_->set_prefix_cache(cache.cached_pages, cache.hit_tokens, cache.evicted_pages);
    metrics_->set_preemptions(s.preemptions());
    metrics_->refresh_rates();
  }
}

void EngineThread::run() {
  engine::Scheduler& scheduler = *scheduler_;
  spdlog::info("engine: started ({} KV pages of {} tokens, step budget {} tokens, plan {})",
               options_.kv_pages, options_.page_tokens, options_.max_step_tokens,
               engine::plan_kind_name(options_.planner.kind));
  publish();
  bool refused = false;
  bool trimmed = true;  // nothing ran since the last malloc_trim
  for (;;) {
    std::vector<Command> commands;
    bool stopping = false;
    bool cancel_live = false;
    bool idle_second = false;
    {
      std::unique_lock lock(mutex_);
      // Idle: sleep until a command arrives (the timeout refreshes the rate gauges). A session
      // whose command just ended may have the next one queued: no sleep then.
      if (inbox_.empty() && !scheduler.has_live() && !scheduler.has_ready_sessions() &&
          !scheduler.has_preempted() && !stopping_) {
        idle_second =
            !wake_.wait_for(lock, std::chrono::seconds(1), [&] { return !inbox_.empty(); });
      }
      commands.swap(inbox_);
      stopping = stopping_;
      cancel_live = stopping_ && Clock::now() >= cancel_at_;
    }
    if (idle_second && !trimmed) {
      // A second without work after a load: hand the heap's free pages back to the OS. glibc
      // keeps freed memory of its arenas, and after the first free of a large block (a logits
      // row: 513 KB on a 128k vocabulary) it raises its mmap threshold, so later rows come from
      // the arenas and stay resident: RSS would hold the load's peak (its high-water mark)
      // until the next load reuses it. Once per idle period; a load is never slowed by it.
      malloc_trim(0);
      trimmed = true;
    }
    if (!commands.empty()) trimmed = false;
    for (Command& command : commands) command(scheduler);
    if (stopping && !refused) {
      // Stop admitting: queued requests are refused; live ones get the grace.
      scheduler.refuse_queued(shutting_down());
      refused = true;
    }
    if (cancel_live) {
      scheduler.abort_all(absl::UnavailableError("the server shut down before the request finished"));
    }
    scheduler.prepare();
    if (stopping) scheduler.refuse_queued(shutting_down());
    publish();
    if (stopping && !scheduler.has_live() && scheduler.queued() == 0) {
      scheduler.abort_all(shutting_down());  // open sessions end now
      break;
    }
    std::optional<engine::StepStats> stats = scheduler.step();
    if (!stats.has_value() && (scheduler.has_live() || scheduler.has_ready_sessions())) {
      // Work is live but added no rows: every such work is paused for a slow reader
      // (engine/works/event_queue.h). Nap until a command arrives or the readers catch up
      // rather than spin a core.
      std::unique_lock lock(mutex_);
      wake_.wait_for(lock, kPausedNap, [&] { return !inbox_.empty(); });
    }
    if (stats.has_value()) {
      if (metrics_ != nullptr) {
        metrics_->record_step({.step_seconds = stats->step_seconds,
                               .plan_seconds = stats->plan_seconds,
                               .forward_seconds = stats->forward_seconds,
                               .attention_seconds = stats->attention_seconds,
                               .prompt_tokens = stats->prompt_rows,
                               .generated_tokens = stats->generated,
                               .kv_tokens_read = stats->kv_tokens_read,
                               .rows = stats->rows,
                               .logit_rows = stats->logit_rows,
                               .draft_seconds = stats->draft.seconds,
                               .draft_rows = stats->draft.rows,
                               .drafted_tokens = stats->drafted,
                               .accepted_lengths = stats->accepted_lengths});
      }
      spdlog::trace("engine: step {} rows, {} works, {:.2f} ms", stats->rows, stats->works,
                    stats->step_seconds * 1e3);
    }
    publish();
  }
  publish();
  spdlog::info("engine: stopped");
}

}  // namespace deft::server
