#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "engine/works/session_work.h"
#include "spdlog/spdlog.h"

namespace deft::engine {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The planner's options with the runner's attention wave, unless the caller set one.
PlannerOptions with_wave(PlannerOptions options, const ModelRunner& runner) {
  if (options.wave.ctas == 0) options.wave = runner.attention_wave();
  return options;
}

}  // namespace

Scheduler::Scheduler(SchedulerOptions options, ModelRunner& runner, const Tokenizer& tokenizer,
                     ModelRunner* draft)
    : options_(options),
      runner_(runner),
      tokenizer_(tokenizer),
      kv_({.page_tokens = options.page_tokens, .num_pages = options.kv_pages}),
      forest_(&kv_, options.first_node_id, {.max_pages = options.prefix_cache_pages}),
      planner_(with_wave(options.planner, runner)),
      step_(forest_, sampler_, tokenizer, runner.vocab_size()) {
  if (draft != nullptr) {
    draft_ = std::make_unique<DraftModel>(
        DraftModelOptions{
            .page_tokens = options.page_tokens,
            .kv_pages = options.draft_kv_pages > 0 ? options.draft_kv_pages : options.kv_pages,
            .max_step_tokens = options.max_step_tokens,
            .max_prefill_tokens = options.max_prefill_tokens,
            .prefix_cache_pages = options.prefix_cache_pages,
            .planner = options.planner},
        *draft, tokenizer);
  }
}

Scheduler::~Scheduler() {
  abort_all(absl::UnavailableError("the engine stopped"));
  refuse_queued(absl::UnavailableError("the engine stopped"));
}

absl::Status Scheduler::submit(std::unique_ptr<Work> work) {
  absl::Status status = admissible(*work);
  if (!status.ok()) {
    work->abort(status, forest_);
    return status;
  }
  queued_.push_back({.work = std::move(work), .arrival = next_arrival_++});
  return absl::OkStatus();
}

absl::Status Scheduler::admissible(const Work& work) const {
  if (work.needs_draft_model() && draft_ == nullptr) {
    return absl::FailedPreconditionError(
        "speculative decoding with a draft model needs a server started with --draft-model "
        "(the ngram policy needs none)");
  }
  const int64_t pages = work.pending_pages(forest_);
  if (pages > options_.kv_pages) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request may need ", pages, " KV pages but the KV pool has ",
                     options_.kv_pages, " pages of ", options_.page_tokens, " tokens"));
  }
  if (work.max_step_rows() > options_.max_step_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request needs steps of ", work.max_step_rows(),
                     " query rows but max_step_tokens is ", options_.max_step_tokens));
  }
  if (static_cast<int32_t>(queued_.size()) >= options_.max_queued_works) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many requests: ", queued_.size(),
                     " are waiting for admission (max_queued_jobs ", options_.max_queued_works,
                     ")"));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::open_session(uint64_t id, std::shared_ptr<SessionEvents> events) {
  if (static_cast<int32_t>(sessions_.size()) >= options_.sessions.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many sessions: ", sessions_.size(), " are open (max_sessions ",
        options_.sessions.max_sessions, ")"));
  }
  sessions_[id] = std::make_shared<Session>(id, std::move(events), options_.sessions, tokenizer_,
                                            options_.page_tokens);
  return absl::OkStatus();
}

void Scheduler::session_command(uint64_t id, SessionCommand command) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second->closing() && command.counted) {
    it->second->events().inflow_taken();
  }
  if (it == sessions_.end() || it->second->closing()) {
    const absl::Status status =
        absl::NotFoundError(absl::StrCat("no open session ", id));
    if (const std::shared_ptr<VerifyReply> reply = command.verify_reply(); reply != nullptr) {
      reply->finish(status);
    }
    return;
  }
  it->second->enqueue(std::move(command));
}

void Scheduler::close_session(uint64_t id) {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second->begin_close();
}

int64_t Scheduler::reserved_pages(const Work& work) const {
  return options_.admission == Admission::kStep ? work.reserve_pages(forest_)
                                                : work.pending_pages(forest_);
}

int64_t Scheduler::committed_pages() const {
  int64_t pages = forest_.referenced_pages();  // cached pages are free for admission
  for (const Live& live : live_) pages += reserved_pages(*live.work);
  return pages;
}

void Scheduler::end_live(size_t index, const absl::Status& status) {
  if (!live_[index].work->finished()) live_[index].work->abort(status, forest_);
  live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(index));
}

void Scheduler::prepare() {
  // 1. Cancellations free KV now.
  for (auto it = queued_.begin(); it != queued_.end();) {
    if (it->work->cancelled()) {
      it->work->abort(absl::CancelledError("cancelled by the client"), forest_);
      it = queued_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t i = live_.size(); i-- > 0;) {
    if (live_[i].work->cancelled()) end_live(i, absl::CancelledError("cancelled by the client"));
  }
  // 2. Sessions: closed ones go once their command has ended; the others start commands.
  pump_sessions();
  // 3. Admission (scheduler.h: in which order, and who may pass whom).
  admit();
}

void Scheduler::admit() {
  preempted_waiting_ = false;
  if (queued_.empty()) return;
  const auto start = [&](Queued& queued) {
    live_.push_back({.work = std::move(queued.work), .arrival = queued.arrival});
    if (draft_ != nullptr) live_.back().work->attach_draft(&draft_->forest());
    live_.back().work->start(forest_);
  };
  // Session commands first, whatever the pages.
  for (auto it = queued_.begin(); it != queued_.end();) {
    if (it->work->is_session_command()) {
      start(*it);
      it = queued_.erase(it);
    } else {
      ++it;
    }
  }
  if (queued_.empty()) return;
  // Jobs: priority, then the client's share (its live jobs plus its earlier waiting ones),
  // then age.
  absl::flat_hash_map<uint64_t, int64_t> share;
  for (const Live& live : live_) ++share[live.work->requester.client];
  struct Key {
    int priority;
    int64_t share;
    uint64_t arrival;
  };
  std::vector<Key> keys(queued_.size());
  std::vector<size_t>& candidates = candidates_;
  candidates.resize(queued_.size());
  for (size_t i = 0; i < queued_.size(); ++i) candidates[i] = i;
  std::sort(candidates.begin(), candidates.end(),
            [&](size_t a, size_t b) { return queued_[a].arrival < queued_[b].arrival; });
  for (size_t i : candidates) {
    const Requester& requester = queued_[i].work->requester;
    keys[i] = {.priority = static_cast<int>(requester.priority),
               .share = share[requester.client]++,
               .arrival = queued_[i].arrival};
  }
  std::sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
    const Key& x = keys[a];
    const Key& y = keys[b];
    if (x.priority != y.priority) return x.priority > y.priority;
    if (x.share != y.share) return x.share < y.share;
    return x.arrival < y.arrival;
  });
  int64_t committed = committed_pages();
  bool reserved = false;  // a job out of patience holds back the jobs after it
  for (size_t i : candidates) {
    Queued& queued = queued_[i];
    if (!reserved) {
      const int64_t pages = reserved_pages(*queued.work);
      if (committed + pages <= options_.kv_pages) {
        committed += pages;
        start(queued);
        continue;
      }
    }
    if (++queued.waited >= options_.admission_patience) reserved = true;
  }
  std::erase_if(queued_, [](const Queued& queued) { return queued.work == nullptr; });
}

bool Scheduler::make_room(int64_t pages, size_t position) {
  while (kv_.free_pages() + forest_.cached_pages() < pages) {
    if (options_.admission != Admission::kStep) return false;
    // The least important preemptible work that has not added rows this step.
    size_t victim = order_.size();
    for (size_t k = order_.size(); k-- > position;) {
      const size_t index = order_[k];
      if (preempted_[index] == 0 && live_[index].work->preemptible()) {
        victim = k;
        break;
      }
    }
    if (victim == order_.size()) return false;
    const size_t index = order_[victim];
    live_[index].work->preempt(forest_);
    preempted_[index] = 1;
    ++preemptions_;
    spdlog::debug("engine: preempted a request to free KV ({} pages needed, {} free)", pages,
                  kv_.free_pages() + forest_.cached_pages());
    if (victim == position) return false;
  }
  return true;
}

void Scheduler::requeue_preempted() {
  for (size_t i = live_.size(); i-- > 0;) {
    if (preempted_[i] == 0) continue;
    preempted_waiting_ = true;
    queued_.push_back(
        {.work = std::move(live_[i].work), .arrival = live_[i].arrival, .preempted = true});
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  preempted_.clear();
}

bool Scheduler::has_ready_sessions() const {
  for (const auto& [id, session] : sessions_) {
    if (!session->busy() && (session->has_commands() || session->closing())) return true;
  }
  return false;
}

void Scheduler::pump_sessions() {
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    Session& session = *it->second;
    // next_command() runs immediate commands (a close among them) and hands over at most one
    // that needs forward passes; a refused work answers its command with the error (submit
    // aborts it).
    if (!session.busy() && !session.closing()) {
      if (std::optional<SessionCommand> command = session.next_command(forest_)) {
        (void)submit(make_session_work(it->second, std::move(*command)));
      }
    }
    if (session.closing() && !session.busy()) {
      session.close(forest_, absl::OkStatus());
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
}

std::optional<StepStats> Scheduler::step() {
  if (live_.empty()) return std::nullopt;
  const Clock::time_point start = Clock::now();
  StepStats stats;
  step_.clear();
  step_.budget = options_.max_step_tokens;
  step_.prefill_budget = options_.max_prefill_tokens > 0
                             ? options_.max_prefill_tokens
                             : std::max(1, options_.max_step_tokens / 2);
  // Most important first: priority, then age.
  std::vector<size_t>& order = order_;
  order.resize(live_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto pa = live_[a].work->requester.priority;
    const auto pb = live_[b].work->requester.priority;
    if (pa != pb) return pa > pb;
    return live_[a].arrival < live_[b].arrival;
  });
  preempted_.assign(live_.size(), 0);
  absl::Status status;
  step_.speculate = options_.speculative_max_batch <= 0 ||
                    live_.size() <= static_cast<size_t>(options_.speculative_max_batch);
  if (draft_ != nullptr && step_.speculate) {
    draft_works_.clear();
    for (size_t index : order) draft_works_.push_back(live_[index].work.get());
    status = draft_->run(draft_works_, &stats.draft);
  }
  for (size_t position = 0; status.ok() && position < order.size(); ++position) {
    const size_t index = order[position];
    if (preempted_[index] != 0) continue;
    Work& work = *live_[index].work;
    if (const int64_t pages = work.step_pages(forest_, step_);
        pages > 0 && !make_room(pages, position)) {
      continue;  // preempted, or no room this step
    }
    const size_t rows_before = step_.tokens.size();
    status = work.add_rows(step_);
    if (!status.ok()) break;
    if (step_.tokens.size() > rows_before) ++stats.works;
  }
  if (status.ok() && !step_.tokens.empty()) {
    const TreeQueries trees[] = {{&forest_.tree(), step_.queries}};
    const Clock::time_point plan_start = Clock::now();
    status = planner_.plan(trees, plan_);
    stats.plan_seconds = seconds_since(plan_start);
    if (status.ok()) {
      const StepBatch batch{.plan = &plan_, .tokens = step_.tokens,
                            .logit_rows = step_.logit_rows};
      // Attention is timed on every 16th step (the CUDA runner charges a little for it).
      const bool timed = step_count_++ % 16 == 0;
      if (timed) runner_.time_attention(true);
      const Clock::time_point forward_start = Clock::now();
      if (runner_.samples_on_device() && step_.any_row_sampled()) {
        // Decode rows sample on the device: only their tokens come back, with the logits of
        // the rows that want them (a prompt's last row, a branch point, a verify tree).
        step_.sampled.resize(step_.logit_rows.size());
        const std::span<const RowSampling> rows = step_.row_sampling();
        const std::span<float> logits = logits_for(step_.wanted_logit_rows());
        step_.logits = logits;
        status = runner_.forward_sampled(batch, rows, step_.sampled, logits);
      } else {
        const std::span<float> logits = logits_for(step_.logit_rows.size());
        step_.logits = logits;
        status = runner_.forward(batch, logits);
      }
      stats.forward_seconds = seconds_since(forward_start);
      if (timed) {
        stats.attention_seconds = runner_.last_attention_seconds();
        runner_.time_attention(false);
      }
      stats.kv_tokens_read = plan_.io.kv_tokens_read;
    }
    if (status.ok()) {
      for (size_t index : order) {
        if (preempted_[index] != 0) continue;
        Work& work = *live_[index].work;
        if (absl::Status taken = work.take_logits(step_); !taken.ok()) {
          spdlog::error("engine: a request failed: {}", taken.ToString());
          work.abort(absl::InternalError(taken.message()), forest_);
        }
      }
    }
  }
  requeue_preempted();
  if (!status.ok()) {
    // An engine bug or a runner failure: the works of this step cannot go on.
    spdlog::error("engine: step failed, ending {} requests: {}", live_.size(), status.ToString());
    for (size_t i = live_.size(); i-- > 0;) {
      end_live(i, absl::InternalError(absl::StrCat("engine step failed: ", status.message())));
    }
    // The step's rows were appended but their KV may never have been written: none of it may
    // be offered to a later prompt (the works' nodes, released above, are cached now).
    forest_.clear_cache();
  }
  for (size_t i = live_.size(); i-- > 0;) {
    if (live_[i].work->finished()) live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  stats.rows = static_cast<int64_t>(step_.tokens.size());
  stats.logit_rows = static_cast<int64_t>(step_.logit_rows.size());
  stats.generated = step_.generated;
  stats.prompt_rows = step_.prompt_rows;
  stats.accepted_lengths = step_.accepted_lengths;
  stats.drafted = step_.drafted;
  stats.step_seconds = seconds_since(start);
  step_.clear();
  if (stats.rows == 0) return std::nullopt;
  return stats;
}

std::span<float> Scheduler::logits_for(size_t rows) {
  const size_t floats = rows * static_cast<size_t>(runner_.vocab_size());
  if (const std::span<float> buffer = runner_.logits_buffer(floats); buffer.size() >= floats) {
    return buffer.first(floats);
  }
  logits_.resize(floats);
  return logits_;
}

void Scheduler::refuse_queued(const absl::Status& status) {
  for (Queued& queued : queued_) {
    if (!queued.preempted) queued.work->abort(status, forest_);
  }
  std::erase_if(queued_, [](const Queued& queued) { return !queued.preempted; });
}

void Scheduler::abort_all(const absl::Status& status) {
  for (size_t i = live_.size(); i-- > 0;) end_live(i, status);
  for (auto& [id, session] : sessions_) session->begin_close();
  for (Queued& queued : queued_) queued.work->abort(status, forest_);
  queued_.clear();
  for (auto& [id, session] : sessions_) session->close(forest_, status);
  sessions_.clear();
}

}  // namespace deft::engine
