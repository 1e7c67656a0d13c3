#include "server/engine_thread.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/incremental_detokenizer.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "engine/stop_strings.h"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

using Clock = std::chrono::steady_clock;
using engine::NodeId;
using engine::TokenId;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

}  // namespace

// ---- GenerateStream -----------------------------------------------------------------------

bool GenerateStream::next(std::vector<BranchDelta>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return finished_ || !deltas_.empty(); });
  while (!deltas_.empty()) {
    out.push_back(std::move(deltas_.front()));
    deltas_.pop_front();
  }
  return !(finished_ && out.empty());
}

absl::Status GenerateStream::final_status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

void GenerateStream::push(BranchDelta delta) {
  {
    std::lock_guard lock(mutex_);
    deltas_.push_back(std::move(delta));
  }
  ready_.notify_all();
}

void GenerateStream::finish(absl::Status status) {
  {
    std::lock_guard lock(mutex_);
    if (finished_) return;  // the first outcome (e.g. a failure) stands
    finished_ = true;
    status_ = std::move(status);
  }
  ready_.notify_all();
}

// ---- Jobs ---------------------------------------------------------------------------------

struct EngineThread::Job {
  struct Branch {
    NodeId node = -1;
    TokenId pending = -1;  // sampled, not yet run through the model
    uint64_t seed = 0;
    int32_t generated = 0;
    std::unique_ptr<engine::IncrementalDetokenizer> detokenizer;
    std::string text;          // decoded so far (cut at a stop string)
    size_t emitted_bytes = 0;  // of `text`, streamed already
    bool live = true;
  };

  uint64_t id = 0;
  GenerateJobRequest request;
  std::shared_ptr<GenerateStream> stream;
  int64_t max_pages = 0;  // worst case, reserved at admission
  std::unique_ptr<engine::SequenceTree> tree;
  std::vector<Branch> branches;
  int32_t live_branches = 0;
  bool prefilled = false;
  Clock::time_point submitted_at = Clock::now();
};

// Everything only the engine thread touches.
struct EngineThread::State {
  explicit State(const EngineOptions& options)
      : kv({.page_tokens = options.page_tokens, .num_pages = options.kv_pages}),
        planner(options.planner) {}

  engine::KvCacheManager kv;
  engine::AttentionPlanner planner;
  engine::Sampler sampler;
  engine::AttentionPlan plan;
  std::deque<std::unique_ptr<Job>> queued;  // FIFO, waiting for admission
  std::vector<std::unique_ptr<Job>> live;
  int64_t reserved_pages = 0;  // sum of the live jobs' max_pages

  // The step being built.
  std::vector<std::vector<engine::QueryToken>> queries;  // per live job
  std::vector<TokenId> tokens;
  std::vector<int32_t> logit_rows;
  std::vector<float> logits;
};

absl::StatusOr<std::unique_ptr<EngineThread>> EngineThread::start(
    EngineOptions options, std::unique_ptr<engine::ModelRunner> runner,
    const engine::Tokenizer& tokenizer, ServerMetrics* metrics) {
  const int64_t slots = int64_t{options.kv_pages} * options.page_tokens;
  if (runner->info().num_kv_slots < slots) {
    return absl::InvalidArgumentError(absl::StrCat("engine: the model runner holds ",
                                                   runner->info().num_kv_slots,
                                                   " KV slots but the pool needs ", slots));
  }
  std::unique_ptr<EngineThread> engine(
      new EngineThread(options, std::move(runner), tokenizer, metrics));
  engine->thread_ = std::thread([raw = engine.get()] { raw->run(); });
  return engine;
}

EngineThread::EngineThread(EngineOptions options, std::unique_ptr<engine::ModelRunner> runner,
                           const engine::Tokenizer& tokenizer, ServerMetrics* metrics)
    : options_(options),
      runner_(std::move(runner)),
      tokenizer_(tokenizer),
      metrics_(metrics),
      state_(std::make_unique<State>(options)) {}

EngineThread::~EngineThread() { shutdown(std::chrono::milliseconds(0)); }

int64_t EngineThread::job_max_pages(const GenerateJobRequest& request) const {
  return pages_for(static_cast<int64_t>(request.prompt.size()), options_.page_tokens) +
         int64_t{request.n} * pages_for(request.max_tokens, options_.page_tokens);
}

absl::StatusOr<std::shared_ptr<GenerateStream>> EngineThread::submit(GenerateJobRequest request) {
  const int64_t max_pages = job_max_pages(request);
  if (max_pages > options_.kv_pages) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the job may need ", max_pages, " KV pages (prompt ", request.prompt.size(), " tokens + ",
        request.n, " branches x ", request.max_tokens, " tokens) but the KV pool has ",
        options_.kv_pages, " pages of ", options_.page_tokens, " tokens"));
  }
  if (request.n > options_.max_step_tokens ||
      static_cast<int64_t>(request.prompt.size()) > options_.max_step_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the job needs steps of ", std::max<int64_t>(request.n, request.prompt.size()),
                     " tokens but max_step_tokens is ", options_.max_step_tokens));
  }
  auto job = std::make_unique<Job>();
  job->request = std::move(request);
  job->max_pages = max_pages;
  job->stream = std::make_shared<GenerateStream>();
  std::shared_ptr<GenerateStream> stream = job->stream;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (queued_jobs_.load() >= options_.max_queued_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many jobs: ", queued_jobs_.load(), " are waiting for admission (max_queued_jobs ",
          options_.max_queued_jobs, ")"));
    }
    job->id = next_job_id_++;
    queued_jobs_.fetch_add(1);
    submitted_.push_back(std::move(job));
  }
  wake_.notify_one();
  return stream;
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
          .live_jobs = live_jobs_.load()};
}

// ---- The step loop (DESIGN.md §2) -------------------------------------------------------

void EngineThread::run() {
  State& s = *state_;
  spdlog::info("engine: started ({} KV pages of {} tokens, step budget {} tokens, plan {})",
               options_.kv_pages, options_.page_tokens, options_.max_step_tokens,
               engine::plan_kind_name(options_.planner.kind));
  publish();
  for (;;) {
    bool stopping = false;
    bool cancel_live = false;
    drain_commands(&stopping, &cancel_live);  // 1. new jobs; shutdown
    cancel_jobs(stopping, cancel_live);       //    cancellations free KV now
    if (stopping && s.live.empty()) break;
    admit_jobs();  // 2. continuous batching under the KV and token budgets
    publish();
    if (s.live.empty()) continue;
    run_step();  // 3-7. plan, forward, sample, stream
    publish();
  }
  publish();
  spdlog::info("engine: stopped");
}

void EngineThread::publish() {
  const State& s = *state_;
  kv_pages_used_.store(s.kv.used_pages());
  live_jobs_.store(static_cast<int32_t>(s.live.size()));
  if (metrics_ != nullptr) {
    metrics_->set_engine_state(queued_jobs_.load(), static_cast<int32_t>(s.live.size()),
                               s.kv.used_pages(), s.kv.free_pages());
    metrics_->refresh_rates();
  }
}

void EngineThread::drain_commands(bool* stopping, bool* cancel_live) {
  State& s = *state_;
  std::unique_lock lock(mutex_);
  // Idle: sleep until a command arrives. (A queued job waits only for a live one's pages, so
  // with no live job the queue is empty too.) The timeout refreshes the rate gauges.
  if (submitted_.empty() && s.live.empty() && !stopping_) {
    wake_.wait_for(lock, std::chrono::seconds(1));
  }
  for (std::unique_ptr<Job>& job : submitted_) s.queued.push_back(std::move(job));
  submitted_.clear();
  *stopping = stopping_;
  *cancel_live = stopping_ && Clock::now() >= cancel_at_;
}

void EngineThread::cancel_jobs(bool stopping, bool cancel_live) {
  State& s = *state_;
  // At shutdown the queue is refused at once; live jobs end after the grace.
  for (auto it = s.queued.begin(); it != s.queued.end();) {
    if ((*it)->stream->cancelled() || stopping) {
      (*it)->stream->finish(stopping ? absl::UnavailableError("the server is shutting down")
                                     : absl::CancelledError("cancelled by the client"));
      queued_jobs_.fetch_sub(1);
      it = s.queued.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t i = s.live.size(); i-- > 0;) {
    if (s.live[i]->stream->cancelled()) {
      end_job(i, FinishReason::kCancelled, absl::CancelledError("cancelled by the client"));
    } else if (cancel_live) {
      end_job(i, FinishReason::kCancelled,
              absl::UnavailableError("the server shut down before the job finished"));
    }
  }
}

void EngineThread::admit_jobs() {
  State& s = *state_;
  // FIFO (no job overtakes an older one), while the worst cases fit the pool and the step's
  // rows fit the token budget: the new prompts now, their n branches from the next step on.
  int64_t step_rows = 0;
  for (const auto& job : s.live) step_rows += job->live_branches;
  while (!s.queued.empty()) {
    Job& job = *s.queued.front();
    const int64_t prompt_rows = static_cast<int64_t>(job.request.prompt.size());
    if (s.reserved_pages + job.max_pages > options_.kv_pages) break;
    if (step_rows + prompt_rows > options_.max_step_tokens ||
        step_rows + job.request.n > options_.max_step_tokens) {
      break;
    }
    step_rows += prompt_rows;
    s.reserved_pages += job.max_pages;
    job.tree = std::make_unique<engine::SequenceTree>(static_cast<uint32_t>(job.id), &s.kv);
    spdlog::debug("engine: job {} admitted ({} prompt tokens, n {}, max_tokens {})", job.id,
                  prompt_rows, job.request.n, job.request.max_tokens);
    s.live.push_back(std::move(s.queued.front()));
    s.queued.pop_front();
    queued_jobs_.fetch_sub(1);
  }
}

void EngineThread::end_job(size_t index, FinishReason reason, const absl::Status& status) {
  State& s = *state_;
  Job& job = *s.live[index];
  // Branches still live end with `reason`; the stream ends with `status` (a job that failed
  // earlier keeps its first status).
  if (reason != FinishReason::kNone) {
    for (size_t i = 0; i < job.branches.size(); ++i) {
      if (!job.branches[i].live) continue;
      job.branches[i].live = false;
      job.stream->push({.branch = static_cast<int32_t>(i), .finish = reason});
    }
  }
  job.stream->finish(status);
  s.reserved_pages -= job.max_pages;
  spdlog::debug("engine: job {} ended ({}), {:.3f} s", job.id, status.ToString(),
                seconds_since(job.submitted_at));
  s.live.erase(s.live.begin() + static_cast<std::ptrdiff_t>(index));  // frees its tree's pages
}

absl::Status EngineThread::build_step(StepRecord& record) {
  State& s = *state_;
  // One query row per new token: a new job's whole prompt (logits of its last row only), and
  // the pending token of every live branch.
  s.queries.resize(s.live.size());
  s.tokens.clear();
  s.logit_rows.clear();
  for (size_t j = 0; j < s.live.size(); ++j) {
    Job& job = *s.live[j];
    std::vector<engine::QueryToken>& queries = s.queries[j];
    queries.clear();
    if (!job.prefilled) {
      if (absl::Status status = job.tree->append(job.tree->root(), job.request.prompt);
          !status.ok()) {
        return status;
      }
      for (int32_t i = 0; i < static_cast<int32_t>(job.request.prompt.size()); ++i) {
        queries.push_back({job.tree->root(), i});
        s.tokens.push_back(job.request.prompt[i]);
      }
      s.logit_rows.push_back(static_cast<int32_t>(s.tokens.size()) - 1);
      record.prompt_tokens += static_cast<int64_t>(job.request.prompt.size());
      continue;
    }
    for (Job::Branch& branch : job.branches) {
      if (!branch.live) continue;
      if (absl::Status status = job.tree->append(branch.node, std::span(&branch.pending, 1));
          !status.ok()) {
        return status;
      }
      queries.push_back(
          {branch.node, static_cast<int32_t>(job.tree->node(branch.node).tokens.size()) - 1});
      s.logit_rows.push_back(static_cast<int32_t>(s.tokens.size()));
      s.tokens.push_back(branch.pending);
    }
  }
  return absl::OkStatus();
}

void EngineThread::run_step() {
  State& s = *state_;
  const Clock::time_point step_start = Clock::now();
  StepRecord record;
  absl::Status status = build_step(record);
  if (status.ok()) {
    std::vector<engine::TreeQueries> trees;
    trees.reserve(s.live.size());
    for (size_t j = 0; j < s.live.size(); ++j) {
      trees.push_back({s.live[j]->tree.get(), s.queries[j]});
    }
    const Clock::time_point plan_start = Clock::now();
    status = s.planner.plan(trees, s.plan);
    record.plan_seconds = seconds_since(plan_start);
  }
  if (status.ok()) {
    s.logits.resize(s.logit_rows.size() * static_cast<size_t>(runner_->vocab_size()));
    const engine::StepBatch batch{.plan = &s.plan, .tokens = s.tokens, .logit_rows = s.logit_rows};
    const Clock::time_point forward_start = Clock::now();
    status = runner_->forward(batch, s.logits);
    record.forward_seconds = seconds_since(forward_start);
    record.kv_tokens_read = s.plan.io.kv_tokens_read;
  }
  if (!status.ok()) {
    // An engine bug or a runner failure: the jobs of this step cannot go on.
    spdlog::error("engine: step failed, ending {} jobs: {}", s.live.size(), status.ToString());
    for (size_t i = s.live.size(); i-- > 0;) {
      end_job(i, FinishReason::kCancelled,
              absl::InternalError(absl::StrCat("engine step failed: ", status.message())));
    }
    return;
  }
  sample_step(record);
  record.step_seconds = seconds_since(step_start);
  if (metrics_ != nullptr) metrics_->record_step(record);
  spdlog::trace("engine: step {} rows, {} jobs, {:.2f} ms", s.tokens.size(), s.live.size(),
                record.step_seconds * 1e3);
}

void EngineThread::sample_step(StepRecord& record) {
  State& s = *state_;
  const size_t vocab = static_cast<size_t>(runner_->vocab_size());
  size_t logit_row = 0;
  const auto next_logits = [&] {
    return std::span<const float>(s.logits.data() + logit_row++ * vocab, vocab);
  };
  std::vector<size_t> finished;
  for (size_t j = 0; j < s.live.size(); ++j) {
    Job& job = *s.live[j];
    engine::SamplingParams params = job.request.sampling;
    absl::Status status;
    if (!job.prefilled) {
      // The prompt's last row: the root branches n ways, each child samples its first token
      // with its own seed.
      job.prefilled = true;
      const std::span<const float> logits = next_logits();
      absl::StatusOr<std::vector<NodeId>> children =
          job.tree->branch(job.tree->root(), job.request.n);
      if (!children.ok()) {
        status = children.status();
      } else {
        job.branches.resize(static_cast<size_t>(job.request.n));
        job.live_branches = job.request.n;
        const uint64_t position = job.request.prompt.size();
        for (int32_t i = 0; i < job.request.n && status.ok(); ++i) {
          Job::Branch& branch = job.branches[i];
          branch.node = (*children)[i];
          branch.seed = engine::branch_seed(job.request.sampling.seed, static_cast<uint64_t>(i));
          branch.detokenizer = std::make_unique<engine::IncrementalDetokenizer>(
              tokenizer_, /*starts_text=*/false, /*skip_special=*/true);
          params.seed = branch.seed;
          absl::StatusOr<engine::SampledToken> sampled = s.sampler.sample(logits, params, position);
          status = sampled.ok() ? add_token(job, i, *sampled, record) : sampled.status();
        }
      }
    } else {
      for (int32_t i = 0; i < static_cast<int32_t>(job.branches.size()); ++i) {
        Job::Branch& branch = job.branches[i];
        if (!branch.live) continue;
        const std::span<const float> logits = next_logits();
        if (!status.ok()) continue;
        params.seed = branch.seed;
        // The sampler's step counter is the new token's position: draws replay exactly.
        const auto position = static_cast<uint64_t>(job.tree->depth(
            branch.node, static_cast<int64_t>(job.tree->node(branch.node).tokens.size())));
        absl::StatusOr<engine::SampledToken> sampled = s.sampler.sample(logits, params, position);
        status = sampled.ok() ? add_token(job, i, *sampled, record) : sampled.status();
      }
    }
    if (!status.ok()) {
      spdlog::error("engine: job {} failed: {}", job.id, status.ToString());
      job.stream->finish(absl::InternalError(status.message()));
      job.live_branches = 0;
    }
    if (job.live_branches == 0) finished.push_back(j);
  }
  for (size_t k = finished.size(); k-- > 0;) {
    end_job(finished[k], FinishReason::kNone, absl::OkStatus());
  }
}

absl::Status EngineThread::add_token(Job& job, int32_t index, const engine::SampledToken& sampled,
                                     StepRecord& record) {
  Job::Branch& branch = job.branches[index];
  BranchDelta delta;
  delta.branch = index;
  delta.ids.push_back(sampled.token);
  delta.logprobs.push_back(sampled.logprob);
  if (job.request.sampling.top_logprobs > 0) delta.top_logprobs.push_back(sampled.top_logprobs);
  ++branch.generated;
  ++record.generated_tokens;

  const std::string piece = branch.detokenizer->feed(sampled.token);
  branch.text += piece;
  const std::vector<std::string>& stop = job.request.stop;
  FinishReason finish = FinishReason::kNone;
  if (!job.request.ignore_eos && tokenizer_.is_eos(sampled.token)) {
    finish = FinishReason::kEos;
  } else if (sampled.stop) {
    finish = FinishReason::kStop;
  } else if (const engine::StopStringMatch match =
                 engine::find_stop_string(branch.text, piece.size(), stop);
             match.found()) {
    branch.text.resize(match.position);  // the text ends before the stop string
    finish = FinishReason::kStop;
  } else if (branch.generated >= job.request.max_tokens) {
    finish = FinishReason::kLength;
  }
  // Stream what is settled: while the branch runs, hold back a tail that may be the start of
  // a stop string; at its end, flush the detokenizer (unless a stop string cut the text).
  size_t settled = branch.text.size();
  if (finish == FinishReason::kNone) {
    settled -= engine::stop_string_holdback(branch.text, stop);
  } else if (finish != FinishReason::kStop || sampled.stop) {
    branch.text += branch.detokenizer->finish();
    settled = branch.text.size();
  }
  settled = std::max(settled, branch.emitted_bytes);
  delta.text = branch.text.substr(branch.emitted_bytes, settled - branch.emitted_bytes);
  branch.emitted_bytes = settled;
  delta.finish = finish;
  job.stream->push(std::move(delta));

  if (finish == FinishReason::kNone) {
    branch.pending = sampled.token;
    return absl::OkStatus();
  }
  branch.live = false;
  --job.live_branches;
  // The branch's KV is of no further use: its pages go back now, not at the job's end.
  return job.tree->prune(branch.node);
}

}  // namespace deft::server
