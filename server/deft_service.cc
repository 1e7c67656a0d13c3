#include "server/deft_service.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <variant>

#include "absl/strings/str_cat.h"
#include "engine/draft_acceptance.h"
#include "engine/sampler.h"
#include "server/metrics.h"
#include "server/protobuf_log.h"
#include "server/request_log.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

namespace v1 = deft::v1;

grpc::Status to_grpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share the google.rpc.Code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::Status invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

// Who a job is for, for admission's order (engine/scheduler.h): the caller's API key or, on a
// server without keys, the connection; and the request's priority.
absl::StatusOr<engine::Requester> requester(const grpc::ServerContext& context,
                                            const Caller& caller, v1::Priority priority) {
  engine::Requester out;
  out.client =
      std::hash<std::string>{}(caller.key_id.empty() ? context.peer() : "key:" + caller.key_id);
  switch (priority) {
    case v1::PRIORITY_NORMAL:
      out.priority = engine::Priority::kNormal;
      break;
    case v1::PRIORITY_LOW:
      out.priority = engine::Priority::kLow;
      break;
    case v1::PRIORITY_HIGH:
      out.priority = engine::Priority::kHigh;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("priority = ", static_cast<int>(priority),
                       " is not PRIORITY_NORMAL (0), PRIORITY_LOW (1) or PRIORITY_HIGH (2)"));
  }
  return out;
}

using engine::FinishReason;

v1::FinishReason to_proto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kPruned:
      return v1::FINISH_REASON_PRUNED;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void fill_tokens(engine::TokenDelta& delta, v1::Tokens* tokens) {
  tokens->mutable_ids()->Add(delta.ids.begin(), delta.ids.end());
  tokens->set_text(std::move(delta.text));
  tokens->mutable_logprobs()->Add(delta.logprobs.begin(), delta.logprobs.end());
  for (const auto& top : delta.top_logprobs) {
    v1::TopLogprobs* entries = tokens->add_top_logprobs();
    for (const engine::TokenLogprob& entry : top) {
      v1::TokenLogprob* out = entries->add_entries();
      out->set_token(entry.token);
      out->set_logprob(entry.logprob);
    }
  }
}

// How often a streaming handler looks at its client while waiting for the engine.
constexpr std::chrono::milliseconds kPollInterval{50};

// A stream's writer under the watchdog (server/stream_watchdog.h): Write() is false when the
// client went away or the watchdog cut the call, which cut() then says.
template <typename Stream>
class WatchedWriter {
 public:
  WatchedWriter(Stream* stream, grpc::ServerContext* context, const char* rpc,
                StreamWatchdog& watchdog)
      : stream_(stream), context_(context), rpc_(rpc), watchdog_(watchdog) {}

  template <typename Response>
  bool Write(const Response& response) {
    const StreamWatchdog::Write guard(watchdog_, context_, rpc_);
    if (stream_->Write(response)) return true;
    cut_ = cut_ || guard.cut();
    return false;
  }
  bool cut() const { return cut_; }
  // The call's status once cut: the client, which reads nothing, sees CANCELLED; this is what
  // the request log and the metrics see.
  grpc::Status cut_status() const {
    return grpc::Status(
        grpc::StatusCode::CANCELLED,
        absl::StrCat("the client read no response for ", watchdog_.stall().count() / 1000.0,
                     " s (stream_stall_seconds): the stream was cut"));
  }

 private:
  Stream* stream_;
  grpc::ServerContext* context_;
  const char* rpc_;
  StreamWatchdog& watchdog_;
  bool cut_ = false;
};

// Streams a request's engine events to its client until the engine ends the stream (then its
// final status), cancelling the request when the client cancels or goes away. A client that
// stops reading blocks Write (HTTP/2 flow control): events then wait in the queue, the work
// pauses at its backlog limit (engine/works/event_queue.h), and the watchdog cuts the call
// after stream_stall_seconds.
template <typename Event, typename Response, typename ToResponse>
grpc::Status stream_events(grpc::ServerContext* context, engine::EventQueue<Event>& events,
                           WatchedWriter<grpc::ServerWriter<Response>>* writer,
                           ToResponse to_response) {
  std::vector<Event> batch;
  for (;;) {
    batch.clear();
    const bool more = events.next(batch, kPollInterval);
    for (Event& event : batch) {
      if (!writer->Write(to_response(event))) {
        events.cancel();
        if (writer->cut()) return writer->cut_status();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
    }
    if (!more) break;
    if (context->IsCancelled()) {
      events.cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
    }
  }
  return to_grpc(events.final_status());
}

// One RunTree event as the proto.
v1::TreeEvent tree_event(engine::TreeSearchEvent& event) {
  v1::TreeEvent out;
  switch (event.kind) {
    case engine::TreeSearchEvent::Kind::kNodeCreated: {
      v1::TreeNodeInfo* node = out.mutable_node_created();
      node->set_node(event.node);
      node->set_parent(event.parent);
      node->set_depth(event.depth);
      break;
    }
    case engine::TreeSearchEvent::Kind::kTokens:
      out.mutable_tokens()->set_node(event.node);
      out.mutable_tokens()->set_finish_reason(to_proto(event.delta.finish));
      fill_tokens(event.delta, out.mutable_tokens()->mutable_delta());
      break;
    case engine::TreeSearchEvent::Kind::kPruned:
      out.set_pruned(event.node);
      break;
    case engine::TreeSearchEvent::Kind::kFinished: {
      v1::TreeResult* result = out.mutable_finished();
      result->mutable_best_path()->Add(event.best_path.begin(), event.best_path.end());
      result->set_best_text(event.best_text);
      for (engine::TreeSearchNode& node : event.nodes) {
        v1::TreeNodeInfo* info = result->add_nodes();
        info->set_node(node.id);
        info->set_parent(node.parent);
        info->set_depth(node.depth);
        info->set_score(node.score);
        info->set_finish_reason(to_proto(node.finish));
        engine::TokenDelta tokens{.ids = std::move(node.tokens),
                                  .text = std::move(node.text),
                                  .logprobs = std::move(node.logprobs)};
        fill_tokens(tokens, info->mutable_tokens());
      }
      break;
    }
  }
  return out;
}

}  // namespace

DeftService::DeftService(const ServerConfig& config, const Authenticator& auth,
                         ServerMetrics* metrics)
    : config_(config),
      auth_(auth),
      metrics_(metrics),
      key_limits_({.max_concurrent = config.max_concurrent_per_key,
                   .max_queued_jobs = config.max_queued_jobs_per_key,
                   .max_tokens_per_minute = config.max_tokens_per_minute_per_key}),
      watchdog_(
          std::chrono::milliseconds(static_cast<int64_t>(config.stream_stall_seconds * 1000.0))) {}

void DeftService::attach(ModelFacts model, const engine::Tokenizer& tokenizer,
                         EngineThread& engine) {
  model_ = std::move(model);
  tokenizer_ = &tokenizer;
  engine_ = &engine;
  ready_.store(true, std::memory_order_release);
}

bool DeftService::ready() const { return ready_.load(std::memory_order_acquire); }

grpc::Status DeftService::loading() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "the model is still loading; retry when the health service reports SERVING");
}

grpc::Status DeftService::done(const RequestLog& call, const Caller& caller,
                               grpc::Status status) const {
  if (metrics_ != nullptr) {
    metrics_->record_request(call.rpc(), std::string(status_code_name(status.error_code())),
                             caller.key_id);
  }
  call.finish(caller, status);
  return status;
}

grpc::Status DeftService::authenticate(const grpc::ServerContext& context, Caller* caller) const {
  absl::StatusOr<Caller> authenticated = auth_.authenticate(context);
  if (!authenticated.ok()) return to_grpc(authenticated.status());
  *caller = std::move(*authenticated);
  return grpc::Status::OK;
}

absl::Status DeftService::admit_job(const Caller& caller, KeyLimits::Hold* stream,
                                    KeyLimits::Hold* queued) {
  if (absl::Status status = key_limits_.check_tokens(caller.key_id); !status.ok()) return status;
  if (absl::Status status = key_limits_.open_stream(caller.key_id, stream); !status.ok()) {
    return status;
  }
  return key_limits_.queue_job(caller.key_id, queued);
}

void DeftService::count_tokens(const Caller& caller, int64_t tokens) {
  if (caller.key_id.empty() || tokens == 0) return;
  key_limits_.add_tokens(caller.key_id, tokens);
  if (metrics_ != nullptr) metrics_->record_key_tokens(caller.key_id, tokens);
}

absl::StatusOr<std::vector<engine::TokenId>> DeftService::prompt_tokens(
    const v1::Prompt& prompt, const std::string& field, bool add_bos) const {
  std::vector<engine::TokenId> ids;
  switch (prompt.kind_case()) {
    case v1::Prompt::kText: {
      if (prompt.text().size() > static_cast<size_t>(config_.max_text_bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".text has ", prompt.text().size(),
                                                       " bytes; the limit is ",
                                                       config_.max_text_bytes));
      }
      // Client text is untrusted: special-token strings in it stay text.
      absl::StatusOr<std::vector<engine::TokenId>> encoded =
          tokenizer_->encode(prompt.text(), add_bos, /*parse_special=*/false);
      if (!encoded.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".text: ", encoded.status().message()));
      }
      ids = std::move(*encoded);
      break;
    }
    case v1::Prompt::kTokens: {
      const auto& given = prompt.tokens().ids();
      for (int i = 0; i < given.size(); ++i) {
        if (given[i] < 0 || given[i] >= model_.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".tokens.ids[", i, "] = ", given[i],
                                                         " is outside the vocabulary [0, ",
                                                         model_.vocab_size, ")"));
        }
      }
      ids.assign(given.begin(), given.end());
      break;
    }
    case v1::Prompt::KIND_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is empty: set ", field, ".text or ", field, ".tokens"));
  }
  if (ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has no tokens"));
  }
  if (static_cast<int64_t>(ids.size()) > config_.max_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", ids.size(), " tokens; the limit is ",
                     config_.max_prompt_tokens, " (max_prompt_tokens)"));
  }
  return ids;
}

// ---- Generate -----------------------------------------------------------------------------

grpc::Status DeftService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const RequestLog call(*context, "Generate", /*streaming=*/true);
  Caller caller;
  grpc::Status status = authenticate(*context, &caller);
  if (status.ok()) status = ready() ? generate(context, caller, *request, writer) : loading();
  return done(call, caller, std::move(status));
}

grpc::Status DeftService::generate(grpc::ServerContext* context, const Caller& caller,
                                   const v1::GenerateRequest& request,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  engine::GenerateJob job;
  absl::StatusOr<std::vector<engine::TokenId>> prompt = prompt_tokens(request.prompt(), "prompt");
  if (!prompt.ok()) return to_grpc(prompt.status());
  job.prompt = std::move(*prompt);

  if (request.n() < 0 || request.n() > config_.max_branches) {
    return invalid(absl::StrCat("n = ", request.n(), " must be in [1, ", config_.max_branches,
                                "] (0 means 1; max_branches)"));
  }
  job.n = request.n() == 0 ? 1 : request.n();
  absl::StatusOr<engine::Requester> who = requester(*context, caller, request.priority());
  if (!who.ok()) return to_grpc(who.status());
  job.requester = *who;
  if (absl::Status status = sampling(request.sampling(), "sampling", &job.sampling, &job.limits,
                                     &job.max_tokens);
      !status.ok()) {
    return to_grpc(status);
  }
  absl::StatusOr<std::shared_ptr<const engine::SpeculativeOptions>> speculative =
      speculative_options(request.speculative(), model_.speculation, "speculative");
  if (!speculative.ok()) return to_grpc(speculative.status());
  job.speculative = std::move(*speculative);

  const int64_t prompt_size = static_cast<int64_t>(job.prompt.size());
  if (prompt_size + job.max_tokens > model_.max_context) {
    return invalid(absl::StrCat("prompt (", prompt_size, " tokens) + sampling.max_tokens (",
                                job.max_tokens, ") exceeds the model's context of ",
                                model_.max_context, " tokens"));
  }
  const int64_t tree_tokens = prompt_size + int64_t{job.n} * job.max_tokens;
  if (tree_tokens > config_.max_tree_tokens) {
    return invalid(absl::StrCat("the job may hold ", tree_tokens, " tokens (prompt ", prompt_size,
                                " + n ", job.n, " x max_tokens ", job.max_tokens,
                                "); the limit is ", config_.max_tree_tokens, " (max_tree_tokens)"));
  }

  KeyLimits::Hold stream_hold;
  KeyLimits::Hold queued_hold;
  if (absl::Status status = admit_job(caller, &stream_hold, &queued_hold); !status.ok()) {
    return to_grpc(status);
  }
  std::shared_ptr<engine::GenerateEvents> events = engine_->generate(std::move(job));
  bool first = true;
  WatchedWriter watched(writer, context, "Generate", watchdog_);
  return stream_events(context, *events, &watched, [&](engine::GenerateEvent& event) {
    queued_hold.release();  // answering: no longer waiting
    count_tokens(caller, static_cast<int64_t>(event.delta.ids.size()));
    v1::GenerateResponse response;
    response.set_branch(event.branch);
    if (first) response.set_prompt_tokens(static_cast<int32_t>(prompt_size));
    first = false;
    fill_tokens(event.delta, response.mutable_delta());
    response.set_finish_reason(to_proto(event.delta.finish));
    if (event.delta.finish != engine::FinishReason::kNone && event.speculation.steps > 0) {
      v1::SpeculativeStats* stats = response.mutable_speculative();
      stats->set_steps(static_cast<int32_t>(event.speculation.steps));
      stats->set_drafted(static_cast<int32_t>(event.speculation.drafted));
      stats->set_accepted(static_cast<int32_t>(event.speculation.accepted));
    }
    return response;
  });
}

absl::Status DeftService::sampling(const v1::SamplingParams& sampling, const std::string& field,
                                   engine::SamplingParams* params, engine::StreamLimits* limits,
                                   int32_t* max_tokens) const {
  if (sampling.max_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".max_tokens = ", sampling.max_tokens(), " must be >= 0 (0: the server default, ",
        config_.default_max_tokens, ")"));
  }
  *max_tokens = sampling.max_tokens() == 0 ? config_.default_max_tokens : sampling.max_tokens();
  params->temperature = sampling.temperature();
  params->top_k = sampling.top_k();
  params->top_p = sampling.top_p() == 0.0f ? 1.0f : sampling.top_p();
  params->seed = sampling.seed();
  params->top_logprobs = sampling.top_logprobs();
  // Counts first: each listed item costs the request's memory (and a stop string's matcher
  // work per token) for as long as it runs.
  if (sampling.stop_size() > config_.max_stop_sequences ||
      sampling.stop_token_ids_size() > config_.max_stop_sequences) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " lists ", sampling.stop_size(), " stop strings and ",
                     sampling.stop_token_ids_size(), " stop token ids; the limit is ",
                     config_.max_stop_sequences, " of each (max_stop_sequences)"));
  }
  params->stop_token_ids.assign(sampling.stop_token_ids().begin(),
                                sampling.stop_token_ids().end());
  if (absl::Status status = engine::validate_sampling_params(*params, model_.vocab_size);
      !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", status.message()));
  }
  limits->ignore_eos = sampling.ignore_eos();
  limits->top_logprobs = params->top_logprobs > 0;
  size_t stop_bytes = 0;
  for (int i = 0; i < sampling.stop_size(); ++i) {
    if (sampling.stop(i).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".stop[", i, "] is empty"));
    }
    stop_bytes += sampling.stop(i).size();
    limits->stop.push_back(sampling.stop(i));
  }
  if (stop_bytes > static_cast<size_t>(config_.max_text_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".stop has ", stop_bytes,
                                                   " bytes; the limit is ",
                                                   config_.max_text_bytes));
  }
  return absl::OkStatus();
}

// ---- RunTree ------------------------------------------------------------------------------

grpc::Status DeftService::RunTree(grpc::ServerContext* context, const v1::RunTreeRequest* request,
                                  grpc::ServerWriter<v1::TreeEvent>* writer) {
  const RequestLog call(*context, "RunTree", /*streaming=*/true);
  Caller caller;
  grpc::Status status = authenticate(*context, &caller);
  if (status.ok()) status = ready() ? run_tree(context, caller, *request, writer) : loading();
  return done(call, caller, std::move(status));
}

grpc::Status DeftService::run_tree(grpc::ServerContext* context, const Caller& caller,
                                   const v1::RunTreeRequest& request,
                                   grpc::ServerWriter<v1::TreeEvent>* writer) {
  engine::TreeSearchJob job;
  absl::StatusOr<std::vector<engine::TokenId>> prompt = prompt_tokens(request.prompt(), "prompt");
  if (!prompt.ok()) return to_grpc(prompt.status());
  job.prompt = std::move(*prompt);
  absl::StatusOr<engine::Requester> who = requester(*context, caller, request.priority());
  if (!who.ok()) return to_grpc(who.status());
  job.requester = *who;

  const v1::BranchPolicy& policy = request.policy();
  engine::BranchPolicyOptions& options = job.policy;
  options.branch_factor = policy.branch_factor() == 0 ? 2 : policy.branch_factor();
  switch (policy.trigger_case()) {
    case v1::BranchPolicy::kEveryTokens:
      options.trigger = engine::BranchPolicyOptions::Trigger::kEveryTokens;
      options.every_tokens = policy.every_tokens();
      break;
    case v1::BranchPolicy::kDelimiter:
      options.trigger = engine::BranchPolicyOptions::Trigger::kDelimiter;
      if (policy.delimiter().size() > static_cast<size_t>(config_.max_text_bytes)) {
        return invalid(absl::StrCat("policy.delimiter has ", policy.delimiter().size(),
                                    " bytes; the limit is ", config_.max_text_bytes,
                                    " (max_text_bytes)"));
      }
      options.delimiter = policy.delimiter();
      break;
    case v1::BranchPolicy::kStepEndToken:
      options.trigger = engine::BranchPolicyOptions::Trigger::kStepEndToken;
      options.step_end_token = policy.step_end_token();
      break;
    case v1::BranchPolicy::TRIGGER_NOT_SET:
      options.trigger = engine::BranchPolicyOptions::Trigger::kEveryTokens;
      options.every_tokens = 16;
      break;
  }
  options.max_depth = policy.max_depth();
  if (!v1::BranchPolicy::Score_IsValid(policy.score())) {
    return invalid(
        absl::StrCat("policy.score = ", static_cast<int>(policy.score()),
                     " is not a Score (SCORE_CUMULATIVE_LOGPROB or SCORE_MEAN_LOGPROB)"));
  }
  options.score = policy.score() == v1::BranchPolicy::SCORE_MEAN_LOGPROB
                      ? engine::BranchPolicyOptions::Score::kMeanLogprob
                      : engine::BranchPolicyOptions::Score::kCumulativeLogprob;
  options.keep_best = policy.keep_best();
  if (absl::Status status =
          engine::validate_branch_policy(options, model_.vocab_size, config_.max_branches);
      !status.ok()) {
    return to_grpc(status);
  }
  if (absl::Status status = sampling(request.sampling(), "sampling", &job.sampling, &job.limits,
                                     &job.max_tokens);
      !status.ok()) {
    return to_grpc(status);
  }
  const auto prompt_size = static_cast<int64_t>(job.prompt.size());
  if (prompt_size + job.max_tokens > model_.max_context) {
    return invalid(absl::StrCat("prompt (", prompt_size, " tokens) + sampling.max_tokens (",
                                job.max_tokens, ") exceeds the model's context of ",
                                model_.max_context, " tokens"));
  }
  const engine::TreeSearchBounds bounds = engine::tree_search_bounds(job, config_.page_tokens);
  if (bounds.tokens > config_.max_tree_tokens) {
    return invalid(absl::StrCat("the tree may hold ", bounds.tokens,
                                " tokens (prompt, branch_factor, max_depth, keep_best and "
                                "max_tokens together); the limit is ",
                                config_.max_tree_tokens, " (max_tree_tokens)"));
  }

  KeyLimits::Hold stream_hold;
  KeyLimits::Hold queued_hold;
  if (absl::Status status = admit_job(caller, &stream_hold, &queued_hold); !status.ok()) {
    return to_grpc(status);
  }
  std::shared_ptr<engine::TreeSearchEvents> events = engine_->run_tree(std::move(job));
  WatchedWriter watched(writer, context, "RunTree", watchdog_);
  return stream_events(context, *events, &watched, [&](engine::TreeSearchEvent& event) {
    queued_hold.release();  // answering: no longer waiting
    if (event.kind == engine::TreeSearchEvent::Kind::kTokens) {
      count_tokens(caller, static_cast<int64_t>(event.delta.ids.size()));
    }
    return tree_event(event);
  });
}

// ---- TreeSession --------------------------------------------------------------------------

namespace {

absl::Status parse_failure() {
  return absl::InvalidArgumentError(
      "a SessionRequest failed to parse (a string field that is not valid UTF-8?); the session "
      "ran the commands before it and closed");
}

}  // namespace

template <typename Request>
absl::Status DeftService::verify_command(const Request& request, const std::string& prefix,
                                         engine::VerifyCommand* command) const {
  command->node = request.node();
  command->tokens.assign(request.tokens().begin(), request.tokens().end());
  command->parents.assign(request.parents().begin(), request.parents().end());
  command->draft_probs.assign(request.draft_probs().begin(), request.draft_probs().end());
  const auto with_prefix = [&](const absl::Status& status) {
    if (prefix.empty()) return status;
    return absl::Status(status.code(), absl::StrCat("verify: ", status.message()));
  };
  switch (request.draft_sampling()) {
    case v1::DRAFT_SAMPLING_UNSPECIFIED:
      command->draft_sampling = engine::DraftSampling::kUnspecified;
      break;
    case v1::DRAFT_SAMPLING_WITH_REPLACEMENT:
      command->draft_sampling = engine::DraftSampling::kWithReplacement;
      break;
    case v1::DRAFT_SAMPLING_WITHOUT_REPLACEMENT:
      command->draft_sampling = engine::DraftSampling::kWithoutReplacement;
      break;
    default:
      return with_prefix(absl::InvalidArgumentError(
          absl::StrCat("draft tree: draft_sampling = ", request.draft_sampling(),
                       " is not a DraftSampling (DRAFT_SAMPLING_WITH_REPLACEMENT or "
                       "DRAFT_SAMPLING_WITHOUT_REPLACEMENT)")));
  }
  // The copy is no larger than the parsed message, which gRPC bounds by max_request_bytes (it
  // counts max_verify_distribution_tokens pairs); validation then refuses more pairs than that.
  command->draft_distributions.reserve(static_cast<size_t>(request.draft_distributions_size()));
  for (const v1::DraftDistribution& distribution : request.draft_distributions()) {
    command->draft_distributions.push_back(
        {.entry = distribution.entry(),
         .tokens = {distribution.tokens().begin(), distribution.tokens().end()},
         .probs = {distribution.probs().begin(), distribution.probs().end()}});
  }
  const engine::DraftTree tree{.tokens = command->tokens,
                               .parents = command->parents,
                               .draft_probs = command->draft_probs,
                               .distributions = command->draft_distributions,
                               .draft_sampling = command->draft_sampling};
  if (absl::Status status =
          engine::validate_draft_tree(tree, model_.vocab_size, config_.max_verify_entries,
                                      config_.max_verify_distribution_tokens);
      !status.ok()) {
    return with_prefix(status);
  }
  int32_t unused_max_tokens = 0;
  engine::StreamLimits unused_limits;
  return sampling(request.sampling(), prefix + "sampling", &command->sampling, &unused_limits,
                  &unused_max_tokens);
}

engine::SessionCommand DeftService::session_command(const v1::SessionRequest& request) const {
  engine::SessionCommand command;
  command.request_id = request.request_id();
  const auto tokens = [&](const v1::Prompt& prompt, const std::string& field, bool add_bos) {
    absl::StatusOr<std::vector<engine::TokenId>> ids = prompt_tokens(prompt, field, add_bos);
    if (!ids.ok()) {
      command.invalid = ids.status();
      return std::vector<engine::TokenId>();
    }
    return std::move(*ids);
  };
  switch (request.command_case()) {
    case v1::SessionRequest::kCreate:
      command.op = engine::CreateCommand{
          .prompt = tokens(request.create().prompt(), "create.prompt", /*add_bos=*/true)};
      break;
    case v1::SessionRequest::kExtend:
      command.op = engine::ExtendCommand{
          .node = request.extend().node(),
          .tokens = tokens(request.extend().content(), "extend.content", /*add_bos=*/false)};
      break;
    case v1::SessionRequest::kDecode: {
      engine::DecodeCommand decode;
      decode.nodes.assign(request.decode().nodes().begin(), request.decode().nodes().end());
      if (static_cast<int32_t>(decode.nodes.size()) > config_.max_branches) {
        command.invalid = absl::InvalidArgumentError(
            absl::StrCat("decode.nodes lists ", decode.nodes.size(), " nodes; the limit is ",
                         config_.max_branches, " (max_branches)"));
      } else {
        command.invalid = sampling(request.decode().sampling(), "decode.sampling", &decode.sampling,
                                   &decode.limits, &decode.max_tokens);
      }
      if (command.invalid.ok()) {
        absl::StatusOr<std::shared_ptr<const engine::SpeculativeOptions>> speculative =
            speculative_options(request.decode().speculative(), model_.speculation,
                                "decode.speculative");
        if (speculative.ok()) {
          decode.speculative = std::move(*speculative);
        } else {
          command.invalid = speculative.status();
        }
      }
      command.op = std::move(decode);
      break;
    }
    case v1::SessionRequest::kBranch:
      command.op =
          engine::BranchCommand{.node = request.branch().node(), .k = request.branch().k()};
      break;
    case v1::SessionRequest::kPrune:
      command.op = engine::PruneCommand{.node = request.prune().node()};
      break;
    case v1::SessionRequest::kScore:
      command.op =
          engine::ScoreCommand{.node = request.score().node(),
                               .continuation = tokens(request.score().continuation(),
                                                      "score.continuation", /*add_bos=*/false)};
      break;
    case v1::SessionRequest::kClose:
      command.op = engine::CloseCommand{};
      break;
    case v1::SessionRequest::kVerify: {
      // No reply of its own: the outcome comes back as the session's `verified` event.
      engine::VerifyCommand verify;
      command.invalid = verify_command(request.verify(), "verify.", &verify);
      command.op = std::move(verify);
      break;
    }
    case v1::SessionRequest::COMMAND_NOT_SET:
      // The op is left default: the session answers the error below, in order.
      command.invalid = absl::InvalidArgumentError(
          "the SessionRequest has no command (set create, extend, decode, branch, prune, score, "
          "verify or close)");
      break;
  }
  return command;
}

namespace {

v1::SessionResponse session_response(engine::SessionEvent& event, uint64_t session) {
  using Kind = engine::SessionEvent::Kind;
  v1::SessionResponse out;
  out.set_request_id(event.request_id);
  out.set_session_id(session);
  switch (event.kind) {
    case Kind::kCreated:
      out.set_created_node(event.node);
      break;
    case Kind::kExtended:
      out.mutable_extended()->set_node(event.node);
      out.mutable_extended()->set_length(static_cast<int32_t>(event.length));
      break;
    case Kind::kDecoded:
      out.mutable_decoded()->set_node(event.node);
      out.mutable_decoded()->set_finish_reason(to_proto(event.delta.finish));
      fill_tokens(event.delta, out.mutable_decoded()->mutable_delta());
      if (event.delta.finish != engine::FinishReason::kNone && event.speculation.steps > 0) {
        v1::SpeculativeStats* stats = out.mutable_decoded()->mutable_speculative();
        stats->set_steps(static_cast<int32_t>(event.speculation.steps));
        stats->set_drafted(static_cast<int32_t>(event.speculation.drafted));
        stats->set_accepted(static_cast<int32_t>(event.speculation.accepted));
      }
      break;
    case Kind::kBranched:
      out.mutable_branched()->mutable_children()->Add(event.children.begin(),
                                                      event.children.end());
      break;
    case Kind::kPruned:
      out.set_pruned(event.node);
      break;
    case Kind::kScored:
      out.mutable_scored()->set_logprob(event.logprob);
      out.mutable_scored()->mutable_token_logprobs()->Add(event.token_logprobs.begin(),
                                                          event.token_logprobs.end());
      break;
    case Kind::kClosed:
      out.set_closed(true);
      break;
    case Kind::kVerified: {
      v1::VerifyResponse* verified = out.mutable_verified();
      verified->mutable_accepted()->Add(event.verified.accepted.begin(),
                                        event.verified.accepted.end());
      verified->mutable_accepted_entries()->Add(event.verified.accepted_entries.begin(),
                                                event.verified.accepted_entries.end());
      verified->set_bonus_token(event.verified.bonus_token);
      verified->set_node(event.verified.node);
      break;
    }
    case Kind::kError:
      out.mutable_error()->set_code(static_cast<int32_t>(event.error.code()));
      out.mutable_error()->set_message(std::string(event.error.message()));
      break;
  }
  return out;
}

}  // namespace

grpc::Status DeftService::TreeSession(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  const RequestLog call(*context, "TreeSession", /*streaming=*/true);
  Caller caller;
  grpc::Status status = authenticate(*context, &caller);
  if (status.ok()) status = ready() ? tree_session(context, caller, stream) : loading();
  return done(call, caller, std::move(status));
}

grpc::Status DeftService::tree_session(
    grpc::ServerContext* context, const Caller& caller,
    grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  // Opening costs no tokens: the key's token rate is checked per decode command below.
  KeyLimits::Hold stream_hold;
  if (absl::Status status = key_limits_.open_stream(caller.key_id, &stream_hold); !status.ok()) {
    return to_grpc(status);
  }
  auto events = std::make_shared<engine::SessionEvents>();
  const absl::StatusOr<uint64_t> opened = engine_->open_session(events);
  if (!opened.ok()) return to_grpc(opened.status());
  const uint64_t session = *opened;
  {
    std::lock_guard lock(session_owners_mutex_);
    session_owners_[session] = caller.key_id;
  }
  spdlog::debug("TreeSession: session {} opened{}{}", session,
                caller.key_id.empty() ? "" : " by key ", caller.key_id);
  // One thread writes what the engine answers; this one reads the client's commands.
  std::atomic<bool> client_gone{false};
  WatchedWriter watched(stream, context, "TreeSession", watchdog_);
  std::thread writer([&] {
    std::vector<engine::SessionEvent> batch;
    for (;;) {
      batch.clear();
      const bool more = events->next(batch, kPollInterval);
      for (engine::SessionEvent& event : batch) {
        if (event.kind == engine::SessionEvent::Kind::kDecoded) {
          count_tokens(caller, static_cast<int64_t>(event.delta.ids.size()));
        }
        if (client_gone.load()) continue;
        if (!watched.Write(session_response(event, session))) client_gone.store(true);
      }
      if (!more) break;
      if (context->IsCancelled()) client_gone.store(true);
    }
  });
  v1::SessionRequest request;
  bool closed = false;
  bool parse_failed = false;  // a message gRPC could not parse, not a half-close
  while (!client_gone.load()) {
    (void)take_protobuf_parse_error();
    if (!stream->Read(&request)) {
      parse_failed = take_protobuf_parse_error();
      break;
    }
    engine::SessionCommand command = session_command(request);
    if (std::holds_alternative<engine::DecodeCommand>(command.op) && command.invalid.ok()) {
      // A decode is where a session spends tokens: the key's rate is checked per command.
      command.invalid = key_limits_.check_tokens(caller.key_id);
    }
    closed = std::holds_alternative<engine::CloseCommand>(command.op) && command.invalid.ok();
    // At most EventQueue::kInflowLimit commands wait for the engine: reading stops until it
    // takes one (engine/works/event_queue.h).
    while (!events->wait_inflow_room(kPollInterval)) {
      if (client_gone.load() || context->IsCancelled()) break;
    }
    if (client_gone.load() || context->IsCancelled()) break;
    events->inflow_added();
    command.counted = true;
    engine_->session_command(session, std::move(command));
    if (closed) break;
  }
  if (context->IsCancelled() || client_gone.load()) {
    // Disconnect: the running command is cancelled and every node freed at once.
    engine_->close_session(session);
  } else if (!closed) {
    // Half-close: the commands already sent still run, then the session closes. A message that
    // failed to parse ends the client's stream the same way (gRPC reads no further), but it is
    // answered: an `error` (request id 0: its own was not read) and INVALID_ARGUMENT at the end.
    if (parse_failed) {
      engine_->session_command(session, {.invalid = parse_failure()});
    }
    engine_->session_command(session, {.op = engine::CloseCommand{}});
  }
  writer.join();
  {
    std::lock_guard lock(session_owners_mutex_);
    session_owners_.erase(session);
  }
  spdlog::debug("TreeSession: session {} closed", session);
  if (watched.cut()) return watched.cut_status();
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
  }
  if (parse_failed) return to_grpc(parse_failure());
  return to_grpc(events->final_status());
}

// ---- Verify -------------------------------------------------------------------------------

grpc::Status DeftService::Verify(grpc::ServerContext* context, const v1::VerifyRequest* request,
                                 v1::VerifyResponse* response) {
  const RequestLog call(*context, "Verify", /*streaming=*/false);
  Caller caller;
  grpc::Status status = authenticate(*context, &caller);
  if (status.ok()) status = ready() ? verify(context, caller, *request, response) : loading();
  return done(call, caller, std::move(status));
}

grpc::Status DeftService::verify(grpc::ServerContext* context, const Caller& caller,
                                 const v1::VerifyRequest& request, v1::VerifyResponse* response) {
  {
    std::lock_guard lock(session_owners_mutex_);
    const auto owner = session_owners_.find(request.session_id());
    if (owner != session_owners_.end() && owner->second != caller.key_id) {
      // Another key's session is answered as the engine answers an unknown id: its existence
      // is not revealed.
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("no open session ", request.session_id()));
    }
  }
  engine::VerifyCommand command;
  if (absl::Status status = verify_command(request, "", &command); !status.ok()) {
    return to_grpc(status);
  }
  auto reply = std::make_shared<engine::VerifyReply>();
  command.reply = reply;
  engine_->verify(request.session_id(), std::move(command));
  std::vector<engine::VerifyOutcome> outcome;
  while (reply->next(outcome, kPollInterval)) {
    if (!outcome.empty()) break;
    if (context->IsCancelled()) {
      // The client gave up (cancel or deadline): the verify is dropped if it has not run yet,
      // so nothing is committed under ids the client never learned.
      reply->cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
    }
  }
  if (outcome.empty()) return to_grpc(reply->final_status());
  response->mutable_accepted()->Add(outcome[0].accepted.begin(), outcome[0].accepted.end());
  response->mutable_accepted_entries()->Add(outcome[0].accepted_entries.begin(),
                                            outcome[0].accepted_entries.end());
  response->set_bonus_token(outcome[0].bonus_token);
  response->set_node(outcome[0].node);
  return grpc::Status::OK;
}

// ---- Tokenizer and model ------------------------------------------------------------------

grpc::Status DeftService::Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                                   v1::TokenizeResponse* response) {
  const RequestLog call(*context, "Tokenize", /*streaming=*/false);
  Caller caller;
  if (grpc::Status status = authenticate(*context, &caller); !status.ok()) {
    return done(call, caller, status);
  }
  const auto run = [&]() -> grpc::Status {
    if (request->text().size() > static_cast<size_t>(config_.max_text_bytes)) {
      return invalid(absl::StrCat("text has ", request->text().size(), " bytes; the limit is ",
                                  config_.max_text_bytes, " (max_text_bytes)"));
    }
    absl::StatusOr<std::vector<engine::TokenId>> ids =
        tokenizer_->encode(request->text(), request->add_bos(), /*parse_special=*/false);
    if (!ids.ok()) return invalid(absl::StrCat("text: ", ids.status().message()));
    response->mutable_ids()->Add(ids->begin(), ids->end());
    return grpc::Status::OK;
  };
  return done(call, caller, ready() ? run() : loading());
}

grpc::Status DeftService::Detokenize(grpc::ServerContext* context,
                                     const v1::DetokenizeRequest* request,
                                     v1::DetokenizeResponse* response) {
  const RequestLog call(*context, "Detokenize", /*streaming=*/false);
  Caller caller;
  if (grpc::Status status = authenticate(*context, &caller); !status.ok()) {
    return done(call, caller, status);
  }
  const auto run = [&]() -> grpc::Status {
    const int32_t vocab = tokenizer_->vocab_size();
    if (request->ids_size() > config_.max_tree_tokens) {
      return invalid(absl::StrCat("ids has ", request->ids_size(), " tokens; the limit is ",
                                  config_.max_tree_tokens, " (max_tree_tokens)"));
    }
    for (int i = 0; i < request->ids_size(); ++i) {
      if (request->ids(i) < 0 || request->ids(i) >= vocab) {
        return invalid(absl::StrCat("ids[", i, "] = ", request->ids(i),
                                    " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
    const std::vector<engine::TokenId> ids(request->ids().begin(), request->ids().end());
    response->set_text(tokenizer_->decode(ids, request->skip_special()));
    return grpc::Status::OK;
  };
  return done(call, caller, ready() ? run() : loading());
}

grpc::Status DeftService::ModelInfo(grpc::ServerContext* context, const v1::ModelInfoRequest*,
                                    v1::ModelInfoResponse* response) {
  const RequestLog call(*context, "ModelInfo", /*streaming=*/false);
  Caller caller;
  if (grpc::Status status = authenticate(*context, &caller); !status.ok()) {
    return done(call, caller, status);
  }
  if (!ready()) return done(call, caller, loading());
  response->set_name(model_.name);
  response->set_architecture(model_.architecture);
  response->set_vocab_size(model_.vocab_size);
  response->set_max_context(static_cast<int32_t>(model_.max_context));
  response->set_num_layers(model_.num_layers);
  response->set_hidden_size(model_.hidden_size);
  response->set_num_q_heads(model_.num_q_heads);
  response->set_num_kv_heads(model_.num_kv_heads);
  response->set_dtype(model_.dtype);
  response->set_backend(model_.backend);
  response->set_attention(config_.plan);
  response->set_kv_capacity_tokens(int64_t{config_.kv_pages} * config_.page_tokens);
  response->set_bos_token_id(tokenizer_->bos_id().value_or(-1));
  response->mutable_eos_token_ids()->Add(tokenizer_->eos_ids().begin(),
                                         tokenizer_->eos_ids().end());
  response->set_page_tokens(config_.page_tokens);
  response->set_max_prompt_tokens(config_.max_prompt_tokens);
  response->set_max_tree_tokens(config_.max_tree_tokens);
  response->set_max_branches(config_.max_branches);
  response->set_draft_model(model_.draft_model);
  response->set_max_speculative_tokens(config_.max_speculative_tokens);
  response->set_max_verify_entries(config_.max_verify_entries);
  response->set_max_verify_distribution_tokens(config_.max_verify_distribution_tokens);
  return done(call, caller, grpc::Status::OK);
}

}  // namespace deft::server
