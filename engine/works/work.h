// One unit of engine work that needs forward passes: a Generate job, a RunTree job, or one
// command of a tree session (create, extend, decode, score, verify). The Scheduler admits
// works by priority and fair share under the KV capacity (engine/scheduler.h) and, every step,
// lets each live work add query rows under the step's token budget, runs one forward pass for
// all of them, and hands each work the logits of the rows it asked for. All of it runs on the
// engine thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention_planner.h"
#include "engine/forest.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/token_stream.h"

namespace deft::engine {

// The step being built, and later its logits.
class StepContext {
 public:
  StepContext(Forest& forest, Sampler& sampler, const Tokenizer& tokenizer, int32_t vocab_size)
      : forest(forest), sampler(sampler), tokenizer(tokenizer), vocab_size(vocab_size) {}

  Forest& forest;
  Sampler& sampler;
  const Tokenizer& tokenizer;
  const int32_t vocab_size;
  int64_t budget = 0;          // query rows the step can still take
  int64_t prefill_budget = 0;  // of which prompt / extension chunks (add_chunk) may take
  int64_t generated = 0;  // tokens sampled this step (metrics)
  // Speculative decoding this step (metrics): per verified tree, the entries it accepted.
  std::vector<int32_t> accepted_lengths;
  int64_t drafted = 0;  // tree entries verified
  // Rows of tokens a client sent (prompts, extensions, scored continuations, Verify trees), not
  // of tokens the engine made or feeds again (decode rows, drafts, recomputed ones): metrics.
  int64_t prompt_rows = 0;
  // Whether speculating works draft and verify trees this step (set by the scheduler before
  // any draft pass; SchedulerOptions::speculative_max_batch). When not, they decode plainly.
  bool speculate = true;

  enum class Logits : uint8_t { kNone, kLast, kAll };
  // Appends `tokens` to leaf `node` (Forest::append: evicting cached KV for room) and adds one
  // query row per token, asking for the logits of no row, the last row, or every row. Fails
  // (nothing added) when KV is short.
  absl::Status add_run(NodeId node, std::span<const TokenId> tokens, Logits logits = Logits::kLast);
  // Feeds `tokens` (a prompt, an extension) to `node` in chunks under the budget and the
  // prefill budget: appends tokens [*next, *next + chunk) and advances *next; only the chunk
  // that ends `tokens` asks for logits (its last row's, unless `last_logits` is kNone). Sets
  // *ended to whether this call added that chunk; adds nothing when either budget is spent.
  // The rows count as prompt_rows unless `recomputed` (tokens fed again after a preemption).
  absl::Status add_chunk(NodeId node, std::span<const TokenId> tokens, int64_t* next, bool* ended,
                         Logits last_logits = Logits::kLast, bool recomputed = false);
  // Rows the next add_chunk() of `remaining` tokens would add.
  int64_t chunk_rows(int64_t remaining) const {
    return std::max<int64_t>(0, std::min({remaining, budget, prefill_budget}));
  }

  // Rows of the step, for the planner and the runner.
  std::vector<QueryToken> queries;
  std::vector<TokenId> tokens;
  std::vector<int32_t> logit_rows;

  // Marks the step's last logit row as one that only needs a sampled token (a decode row):
  // when every logit row of a step is such a row, a runner that samples on its device does
  // it there and only tokens come back. `step` is the Sampler's counter (the token's position).
  void sample_last_row(const SamplingParams& params, uint64_t step);

  // After the forward pass: the logits, taken by the works in the order they asked (a work
  // reads next_logits() for a row it wanted, next_sampled() for a row it marked).
  std::span<const float> logits;
  std::span<const float> next_logits();
  // The token of a row marked by sample_last_row(), in the same order as next_logits():
  // sampled on the device, or here from the row's logits with the row's params.
  absl::StatusOr<SampledToken> next_sampled();

  // The scheduler's side of device sampling: when some rows only need a token, the runner
  // samples those on its device (forward_sampled) and returns the logits of the others only.
  bool any_row_sampled() const;
  // One per logit row, null params for a row that wants its logits (valid until the next add).
  std::span<const RowSampling> row_sampling();
  // Rows without params in the last row_sampling(): the rows a device step returns logits of.
  size_t wanted_logit_rows() const { return wanted_rows_; }
  std::vector<SampledToken> sampled;  // filled by forward_sampled(); empty: `logits` has all rows

  void clear();

 private:
  size_t logit_cursor_ = 0;
  std::vector<SamplingParams> row_params_;  // per logit row; unused for rows that want logits
  std::vector<uint64_t> row_steps_;
  std::vector<uint8_t> row_samples_;        // 1: the row only needs a sampled token
  std::vector<RowSampling> row_sampling_;
  std::vector<int32_t> logits_index_;  // per logit row: its row in a device step's `logits`
  size_t wanted_rows_ = 0;
};

// How urgent a work is: admission takes higher priorities first, and a step short of KV
// preempts the lowest first (engine/scheduler.h).
enum class Priority : int8_t { kLow = -1, kNormal = 0, kHigh = 1 };

// Who a work is for: admission shares the pool fairly between clients (an API key, or a
// connection when the server has no keys), and orders by priority.
struct Requester {
  uint64_t client = 0;
  Priority priority = Priority::kNormal;
};

class Work {
 public:
  virtual ~Work() = default;

  Requester requester;

  // KV pages this work may still allocate at worst, beyond the pages it holds now. The
  // scheduler admits a work only while the referenced pages plus every live work's pending
  // pages fit the pool (cached pages count as free: a step evicts them for room), so no live
  // work ever runs out of KV. Before start(), it counts the prompt's pages whole: a placement
  // that reuses cached KV references at most that many pages (engine/forest.h).
  virtual int64_t pending_pages(const Forest& forest) const = 0;
  // Query rows its largest single step needs (admission checks it fits the step budget).
  virtual int64_t max_step_rows() const = 0;

  // Step admission (SchedulerOptions::admission, the default): the pages admission keeps for
  // this work while it waits or lives. A work that cannot be preempted keeps its worst case
  // (pending_pages), so it never runs short; a preemptible one only what its next steps need,
  // and is preempted when a step runs short.
  virtual int64_t reserve_pages(const Forest& forest) const { return pending_pages(forest); }
  // An upper bound on the pages add_rows() allocates when called now with `step`'s budgets:
  // the scheduler makes that room (evicting cached KV, preempting) before the call, or skips
  // the work this step. Each new page holds a new row, hence the default.
  virtual int64_t step_pages(const Forest& forest, const StepContext& step) const {
    return std::min(pending_pages(forest), step.budget);
  }
  // Whether preempt() may be called (between steps or before this work's rows of a step).
  virtual bool preemptible() const { return false; }
  // Lets go of all its KV (to the prefix cache) and keeps what it needs to resume: the
  // scheduler queues it again and calls start() when it is re-admitted, after which it
  // recomputes the KV it had and goes on with no visible difference to its client (the same
  // tokens: sampling draws depend on the seed and the token's position only).
  virtual void preempt(Forest& forest) { (void)forest; }

  // Called between steps when the work is admitted (again after each preemption): place
  // prompts in the forest here
  // (a placement may split nodes, which must not happen while a step's rows are being built).
  virtual void start(Forest& forest) { (void)forest; }
  // Adds this step's rows (none is fine, e.g. when the budget is short).
  virtual absl::Status add_rows(StepContext& step) = 0;
  // Takes the logits of the rows it added, in order (exactly as many as it asked for).
  virtual absl::Status take_logits(StepContext& step) = 0;

  // A command of a tree session (admission never holds these back: scheduler.h).
  virtual bool is_session_command() const { return false; }

  // Speculative decoding with the server's draft model (engine/speculation/draft_model.h).
  // needs_draft_model(): the work cannot run without one (the scheduler refuses it then).
  // attach_draft() gives it the draft forest before its first start(); every step, before
  // add_rows(), the draft passes call add_draft_rows() and then take_draft_rows() with pass
  // l = 0, 1, ... until a pass has no rows.
  virtual bool needs_draft_model() const { return false; }
  virtual void attach_draft(Forest* draft) { (void)draft; }
  virtual absl::Status add_draft_rows(StepContext& draft, int32_t level) {
    (void)draft;
    (void)level;
    return absl::OkStatus();
  }
  virtual absl::Status take_draft_rows(StepContext& draft, int32_t level) {
    (void)draft;
    (void)level;
    return absl::OkStatus();
  }

  virtual bool finished() const = 0;
  // Its client cancelled or went away (polled before every step).
  virtual bool cancelled() const = 0;
  // Ends the work early or after a failure; releases its nodes and tells its client.
  // Called at most once; not called for a work that finished by itself.
  virtual void abort(const absl::Status& status, Forest& forest) = 0;
};

}  // namespace deft::engine
