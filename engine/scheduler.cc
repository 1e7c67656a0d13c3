#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>

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

Scheduler::Scheduler(SchedulerOptions options, ModelRunner& runner, const Tokenizer& tokenizer)
    : options_(options),
      runner_(runner),
      tokenizer_(tokenizer),
      kv_({.page_tokens = options.page_tokens, .num_pages = options.kv_pages}),
      forest_(&kv_, options.first_node_id, {.max_pages = options.prefix_cache_pages}),
      planner_(with_wave(options.planner, runner)),
      step_(forest_, sampler_, tokenizer, runner.vocab_size()) {}

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
  queued_.push_back({.work = std::move(work)});
  return absl::OkStatus();
}

absl::Status Scheduler::admissible(const Work& work) const {
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

int64_t Scheduler::committed_pages() const {
  int64_t pages = forest_.referenced_pages();  // cached pages are free for admission
  for (const auto& work : live_) pages += work->pending_pages(forest_);
  return pages;
}

void Scheduler::end_live(size_t index, const absl::Status& status) {
  if (!live_[index]->finished()) live_[index]->abort(status, forest_);
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
    if (live_[i]->cancelled()) end_live(i, absl::CancelledError("cancelled by the client"));
  }
  // 2. Sessions: closed ones go once their command has ended; the others start commands.
  pump_sessions();
  // 3. Admission in arrival order, under the KV pool (scheduler.h: who may pass whom).
  int64_t committed = committed_pages();
  bool reserved = false;  // an older job out of patience holds back the jobs behind it
  for (auto it = queued_.begin(); it != queued_.end();) {
    const bool session = it->work->is_session_command();
    const int64_t pages = it->work->pending_pages(forest_);
    if ((session || !reserved) && committed + pages <= options_.kv_pages) {
      committed += pages;
      live_.push_back(std::move(it->work));
      it = queued_.erase(it);
      live_.back()->start(forest_);
      continue;
    }
    if (!session && ++it->waited >= options_.admission_patience) reserved = true;
    ++it;
  }
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
  // Rotate who goes first, so a short budget is shared fairly across steps.
  const size_t count = live_.size();
  const size_t first = rotation_++ % count;
  std::vector<size_t>& order = order_;
  order.clear();
  for (size_t k = 0; k < count; ++k) order.push_back((first + k) % count);
  absl::Status status;
  for (size_t index : order) {
    const size_t rows_before = step_.tokens.size();
    status = live_[index]->add_rows(step_);
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
        if (absl::Status taken = live_[index]->take_logits(step_); !taken.ok()) {
          spdlog::error("engine: a request failed: {}", taken.ToString());
          live_[index]->abort(absl::InternalError(taken.message()), forest_);
        }
      }
    }
  }
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
    if (live_[i]->finished()) live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  stats.rows = static_cast<int64_t>(step_.tokens.size());
  stats.logit_rows = static_cast<int64_t>(step_.logit_rows.size());
  stats.generated = step_.generated;
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
  for (Queued& queued : queued_) queued.work->abort(status, forest_);
  queued_.clear();
}

void Scheduler::abort_all(const absl::Status& status) {
  for (size_t i = live_.size(); i-- > 0;) end_live(i, status);
  for (auto& [id, session] : sessions_) session->begin_close();
  refuse_queued(status);
  for (auto& [id, session] : sessions_) session->close(forest_, status);
  sessions_.clear();
}

}  // namespace deft::engine
