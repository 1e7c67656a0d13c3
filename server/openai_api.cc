#include "server/openai_api.h"

#include <chrono>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

using json = nlohmann::json;

// How often a handler looks at its request's events while waiting for the engine.
constexpr std::chrono::milliseconds kPollInterval{50};

// Tokens and user text may hold invalid UTF-8 (a byte-fallback token alone): replace it
// rather than fail the whole answer.
std::string dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 random(std::random_device{}());
  return absl::StrCat(prefix, absl::Hex(random(), absl::kZeroPad16),
                      absl::Hex(random() & 0xffffffff, absl::kZeroPad8));
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

json finish_reason(engine::FinishReason reason) {
  switch (reason) {
    case engine::FinishReason::kLength:
      return "length";
    case engine::FinishReason::kStop:
    case engine::FinishReason::kEos:
      return "stop";
    case engine::FinishReason::kCancelled:
    case engine::FinishReason::kPruned:
      return "abort";  // vLLM's name; OpenAI has none for a request the server ended
    case engine::FinishReason::kNone:
      break;
  }
  return nullptr;
}

json byte_list(const std::string& bytes) {
  json list = json::array();
  for (unsigned char byte : bytes) list.push_back(static_cast<int>(byte));
  return list;
}

// One branch's answer so far, and the logprobs of a delta in the endpoint's format.
class ChoiceBuilder {
 public:
  ChoiceBuilder(const engine::Tokenizer& tokenizer, const OpenAiRequest& request)
      : tokenizer_(tokenizer), request_(request) {}

  // The logprobs object of `delta` (null when not asked for); `text_offset` advances.
  json logprobs(const engine::TokenDelta& delta, int64_t* text_offset) const {
    if (!request_.logprobs) return nullptr;
    if (request_.chat) {
      json content = json::array();
      for (size_t i = 0; i < delta.ids.size(); ++i) {
        const std::string piece = tokenizer_.token_bytes(delta.ids[i]);
        json top = json::array();
        if (i < delta.top_logprobs.size()) {
          for (const engine::TokenLogprob& entry : delta.top_logprobs[i]) {
            const std::string alternative = tokenizer_.token_bytes(entry.token);
            top.push_back({{"token", alternative},
                           {"logprob", entry.logprob},
                           {"bytes", byte_list(alternative)}});
          }
        }
        content.push_back({{"token", piece},
                           {"logprob", delta.logprobs[i]},
                           {"bytes", byte_list(piece)},
                           {"top_logprobs", std::move(top)}});
      }
      return {{"content", std::move(content)}, {"refusal", nullptr}};
    }
    json tokens = json::array();
    json token_logprobs = json::array();
    json top_logprobs = json::array();
    json offsets = json::array();
    for (size_t i = 0; i < delta.ids.size(); ++i) {
      const std::string piece = tokenizer_.token_bytes(delta.ids[i]);
      tokens.push_back(piece);
      token_logprobs.push_back(delta.logprobs[i]);
      offsets.push_back(*text_offset);
      *text_offset += static_cast<int64_t>(piece.size());
      if (request_.top_logprobs > 0) {
        json top = json::object();
        if (i < delta.top_logprobs.size()) {
          for (const engine::TokenLogprob& entry : delta.top_logprobs[i]) {
            top[tokenizer_.token_bytes(entry.token)] = entry.logprob;
          }
        }
        top_logprobs.push_back(std::move(top));
      }
    }
    return {{"tokens", std::move(tokens)},
            {"token_logprobs", std::move(token_logprobs)},
            {"top_logprobs", request_.top_logprobs > 0 ? std::move(top_logprobs) : json(nullptr)},
            {"text_offset", std::move(offsets)}};
  }

 private:
  const engine::Tokenizer& tokenizer_;
  const OpenAiRequest& request_;
};

// A speculative request's choice, on its last message: "deft": {"speculative": {"steps",
// "drafted", "accepted"}} (as GenerateResponse.speculative: target steps that verified a tree of
// this choice, tree entries verified, of which accepted).
void add_speculation(const OpenAiRequest& request, const engine::SpeculationStats& stats,
                     json& choice) {
  if (request.job.speculative == nullptr) return;
  choice["deft"] = {
      {"speculative",
       {{"steps", stats.steps}, {"drafted", stats.drafted}, {"accepted", stats.accepted}}}};
}

// Everything of one accumulated (non-streamed) branch.
struct Accumulated {
  engine::TokenDelta all;
  engine::FinishReason finish = engine::FinishReason::kNone;
  engine::SpeculationStats speculation;  // from the last event
  void add(engine::GenerateEvent& event) {
    engine::TokenDelta& delta = event.delta;
    all.ids.insert(all.ids.end(), delta.ids.begin(), delta.ids.end());
    all.text += delta.text;
    all.logprobs.insert(all.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
    for (auto& top : delta.top_logprobs) all.top_logprobs.push_back(std::move(top));
    if (delta.finish != engine::FinishReason::kNone) {
      finish = delta.finish;
      speculation = event.speculation;
    }
  }
};

json usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

// A whole choice of a non-streamed answer.
json choice(const OpenAiRequest& request, const ChoiceBuilder& builder, int32_t index,
            const Accumulated& branch) {
  int64_t offset = 0;
  json out = {{"index", index}};
  if (request.chat) {
    out["message"] = {{"role", "assistant"}, {"content", branch.all.text}};
  } else {
    out["text"] = branch.all.text;
  }
  out["logprobs"] = builder.logprobs(branch.all, &offset);
  out["finish_reason"] = finish_reason(branch.finish);
  add_speculation(request, branch.speculation, out);
  return out;
}

// A streamed request: its engine events, what was sent so far, and the key holds it keeps
// until the stream ends.
struct StreamState {
  std::shared_ptr<engine::GenerateEvents> events;
  std::vector<engine::GenerateEvent> pending;  // taken from the queue, not yet sent
  OpenAiRequest request;
  std::string id;
  int64_t created = 0;
  std::string model;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  std::vector<bool> role_sent;        // chat: the first chunk of a branch carries the role
  std::vector<int64_t> text_offsets;  // completions logprobs
  KeyLimits::Hold stream_hold;
  bool finished = false;
};

}  // namespace

OpenAiApi::OpenAiApi(const ServerConfig& config, const Authenticator& auth, KeyLimits& key_limits,
                     ServerMetrics* metrics)
    : config_(config), auth_(auth), key_limits_(key_limits), metrics_(metrics) {
  // The body bound is gRPC's request bound (server_config.h, max_request_bytes): JSON spends
  // more bytes per token id than protobuf, but never more than the 16 per token allowed there.
  http_ = std::make_unique<HttpServer>(HttpServerOptions{
      .name = "http",
      .max_body_bytes = static_cast<size_t>(max_request_bytes(config)),
      .worker_threads = config.http_threads,
      .error_body = &OpenAiApi::error_body,
  });
  httplib::Server& routes = http_->routes();
  routes.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(req, res, /*chat=*/false);
  });
  routes.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(req, res, /*chat=*/true);
  });
  routes.Get("/v1/models",
             [this](const httplib::Request& req, httplib::Response& res) { models(req, res); });
  routes.Get(R"(/v1/models/(.+))",
             [this](const httplib::Request& req, httplib::Response& res) { models(req, res); });
  routes.Get("/health", [this](const httplib::Request& req, httplib::Response& res) {
    Caller caller;
    if (config_.auth_health && !authenticate(req, res, &caller)) return;
    const bool serving = serving_.load() && ready_.load(std::memory_order_acquire);
    res.status = serving ? 200 : 503;
    res.set_content(dump({{"status", serving ? "serving" : "not_serving"}}), "application/json");
  });
}

OpenAiApi::~OpenAiApi() { stop(); }

absl::StatusOr<int> OpenAiApi::listen() { return http_->listen(config_.http_listen); }

void OpenAiApi::stop() { http_->stop(); }

void OpenAiApi::attach(const std::string& model_id, const ModelFacts& model,
                       const engine::Tokenizer& tokenizer, EngineThread& engine,
                       ChatTemplate chat_template) {
  limits_ = OpenAiLimits{.config = &config_,
                         .tokenizer = &tokenizer,
                         .model_id = model_id,
                         .vocab_size = model.vocab_size,
                         .max_context = model.max_context,
                         .chat_template = chat_template,
                         .speculation = model.speculation};
  engine_ = &engine;
  ready_.store(true, std::memory_order_release);
}

std::pair<std::string, std::string> OpenAiApi::error_body(int status, const std::string& message) {
  OpenAiError error{.http_status = status, .message = message};
  if (status == 404) error.code = "not_found";
  if (status == 413) error.code = "request_too_large";
  if (status >= 500) error.type = "server_error";
  return {dump(error.to_json()), "application/json"};
}

void OpenAiApi::reply_error(httplib::Response& res, const OpenAiError& error) const {
  res.status = error.http_status;
  res.set_content(dump(error.to_json()), "application/json");
}

void OpenAiApi::done(const char* route, const Caller& caller, int http_status) const {
  if (metrics_ != nullptr) {
    metrics_->record_request(route, absl::StrCat("HTTP_", http_status), caller.key_id);
  }
  if (http_status >= 400) {
    spdlog::debug("http {}: {}{}{}", route, http_status, caller.key_id.empty() ? "" : " key ",
                  caller.key_id);
  }
}

void OpenAiApi::count_tokens(const Caller& caller, int64_t tokens) {
  if (caller.key_id.empty() || tokens == 0) return;
  key_limits_.add_tokens(caller.key_id, tokens);
  if (metrics_ != nullptr) metrics_->record_key_tokens(caller.key_id, tokens);
}

bool OpenAiApi::authenticate(const httplib::Request& req, httplib::Response& res,
                             Caller* caller) const {
  const std::string header = req.get_header_value("Authorization");
  std::optional<absl::string_view> authorization;
  if (req.has_header("Authorization")) authorization = header;
  absl::StatusOr<Caller> authenticated = auth_.authenticate(
      authorization, absl::StrCat("ipv4:", req.remote_addr, ":", req.remote_port));
  if (!authenticated.ok()) {
    // OpenAI's wording of the header rather than gRPC's "metadata".
    OpenAiError error = to_openai_error(authenticated.status());
    error.message = authorization ? "the API key is not valid (Authorization: Bearer KEY)"
                                  : "this server requires an API key: send the header "
                                    "'Authorization: Bearer KEY'";
    reply_error(res, error);
    res.set_header("WWW-Authenticate", "Bearer");
    return false;
  }
  *caller = std::move(*authenticated);
  return true;
}

void OpenAiApi::models(const httplib::Request& req, httplib::Response& res) {
  Caller caller;
  if (!authenticate(req, res, &caller)) return done("openai.models", caller, res.status);
  if (!ready_.load(std::memory_order_acquire)) {
    reply_error(res, to_openai_error(absl::UnavailableError("the model is still loading")));
    return done("openai.models", caller, res.status);
  }
  const json model = {{"id", limits_.model_id},
                      {"object", "model"},
                      {"created", 0},
                      {"owned_by", "deft"},
                      {"max_model_len", limits_.max_context}};
  if (req.matches.size() > 1) {
    if (req.matches[1] != limits_.model_id) {
      reply_error(res, {.http_status = 404,
                        .message = absl::StrCat("the model \"", std::string(req.matches[1]),
                                                "\" does not exist"),
                        .param = "model",
                        .code = "model_not_found"});
    } else {
      res.set_content(dump(model), "application/json");
    }
  } else {
    res.set_content(dump({{"object", "list"}, {"data", json::array({model})}}), "application/json");
  }
  done("openai.models", caller, res.status);
}

void OpenAiApi::completions(const httplib::Request& req, httplib::Response& res, bool chat) {
  const char* route = chat ? "openai.chat.completions" : "openai.completions";
  Caller caller;
  if (!authenticate(req, res, &caller)) return done(route, caller, res.status);
  if (!ready_.load(std::memory_order_acquire)) {
    reply_error(res, to_openai_error(absl::UnavailableError(
                         "the model is still loading; retry when GET /health answers 200")));
    return done(route, caller, res.status);
  }
  OpenAiRequest request;
  OpenAiError error;
  if (!parse_openai_request(req.body, chat, limits_, &request, &error)) {
    reply_error(res, error);
    return done(route, caller, res.status);
  }
  // Admission shares the server between clients (engine/scheduler.h): the API key, or the
  // client's address (one request per connection here, so not the connection).
  request.job.requester.client = std::hash<std::string>{}(
      caller.key_id.empty() ? "http:" + req.remote_addr : "key:" + caller.key_id);
  if (request.tree) {
    run_tree(caller, std::move(request), res);
  } else {
    generate(caller, std::move(request), res);
  }
  done(route, caller, res.status);
}

void OpenAiApi::generate(const Caller& caller, OpenAiRequest request, httplib::Response& res) {
  // The key's limits, as DeftService::admit_job: tokens of the last minute, a stream, a place
  // in the queue.
  KeyLimits::Hold stream_hold;
  KeyLimits::Hold queued_hold;
  absl::Status admitted = key_limits_.check_tokens(caller.key_id);
  if (admitted.ok()) admitted = key_limits_.open_stream(caller.key_id, &stream_hold);
  if (admitted.ok()) admitted = key_limits_.queue_job(caller.key_id, &queued_hold);
  if (!admitted.ok()) return reply_error(res, to_openai_error(admitted));

  const int32_t n = request.job.n;
  const auto prompt_tokens = static_cast<int64_t>(request.job.prompt.size());
  std::shared_ptr<engine::GenerateEvents> events = engine_->generate(request.job);
  // Wait for the first answer: a refusal before any token is still an HTTP error.
  std::vector<engine::GenerateEvent> batch;
  bool more = true;
  while (batch.empty() && more) more = events->next(batch, kPollInterval);
  queued_hold.release();
  if (batch.empty()) {
    absl::Status status = events->final_status();
    if (status.ok()) status = absl::InternalError("the engine ended the request without tokens");
    return reply_error(res, to_openai_error(status));
  }

  const std::string id = random_id(request.chat ? "chatcmpl-" : "cmpl-");
  const int64_t created = unix_seconds();
  if (!request.stream) {
    std::vector<Accumulated> branches(static_cast<size_t>(n));
    int64_t completion_tokens = 0;
    for (;;) {
      for (engine::GenerateEvent& event : batch) {
        completion_tokens += static_cast<int64_t>(event.delta.ids.size());
        count_tokens(caller, static_cast<int64_t>(event.delta.ids.size()));
        branches.at(static_cast<size_t>(event.branch)).add(event);
      }
      batch.clear();
      if (!more) break;
      more = events->next(batch, kPollInterval);
    }
    if (absl::Status status = events->final_status(); !status.ok()) {
      return reply_error(res, to_openai_error(status));
    }
    const ChoiceBuilder builder(*limits_.tokenizer, request);
    json choices = json::array();
    for (int32_t i = 0; i < n; ++i) {
      choices.push_back(choice(request, builder, i, branches[static_cast<size_t>(i)]));
    }
    const json answer = {{"id", id},
                         {"object", request.chat ? "chat.completion" : "text_completion"},
                         {"created", created},
                         {"model", limits_.model_id},
                         {"system_fingerprint", nullptr},
                         {"choices", std::move(choices)},
                         {"usage", usage(prompt_tokens, completion_tokens)}};
    res.set_content(dump(answer), "application/json");
    return;
  }

  auto state = std::make_shared<StreamState>();
  state->events = events;
  state->pending = std::move(batch);
  state->id = id;
  state->created = created;
  state->model = limits_.model_id;
  state->prompt_tokens = prompt_tokens;
  state->role_sent.assign(static_cast<size_t>(n), false);
  state->text_offsets.assign(static_cast<size_t>(n), 0);
  state->stream_hold = std::move(stream_hold);
  state->request = std::move(request);
  const engine::Tokenizer& tokenizer = *limits_.tokenizer;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // nginx: pass events on at once
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, state, caller, &tokenizer](size_t /*offset*/, httplib::DataSink& sink) {
        StreamState& s = *state;
        const OpenAiRequest& request = s.request;
        const auto send = [&](const json& chunk) {
          const std::string event = absl::StrCat("data: ", dump(chunk), "\n\n");
          return sink.write(event.data(), event.size());
        };
        const auto chunk_of = [&](json choices) {
          json chunk = {{"id", s.id},
                        {"object", request.chat ? "chat.completion.chunk" : "text_completion"},
                        {"created", s.created},
                        {"model", s.model},
                        {"system_fingerprint", nullptr},
                        {"choices", std::move(choices)}};
          if (request.include_usage) chunk["usage"] = nullptr;
          return chunk;
        };
        if (s.finished) {
          sink.done();
          return true;
        }
        bool more = true;
        if (s.pending.empty()) more = s.events->next(s.pending, kPollInterval);
        const ChoiceBuilder builder(tokenizer, request);
        for (engine::GenerateEvent& event : s.pending) {
          const auto tokens = static_cast<int64_t>(event.delta.ids.size());
          s.completion_tokens += tokens;
          count_tokens(caller, tokens);
          const auto branch = static_cast<size_t>(event.branch);
          json one = {{"index", event.branch}};
          if (request.chat) {
            json delta = json::object();
            if (!s.role_sent.at(branch)) {
              delta["role"] = "assistant";
              s.role_sent[branch] = true;
            }
            if (!event.delta.text.empty() || delta.empty()) delta["content"] = event.delta.text;
            one["delta"] = std::move(delta);
          } else {
            one["text"] = event.delta.text;
          }
          one["logprobs"] = builder.logprobs(event.delta, &s.text_offsets.at(branch));
          one["finish_reason"] = finish_reason(event.delta.finish);
          if (event.delta.finish != engine::FinishReason::kNone) {
            add_speculation(request, event.speculation, one);
          }
          if (!send(chunk_of(json::array({std::move(one)})))) {
            s.events->cancel();  // the client went away: free the job's KV
            return false;
          }
        }
        s.pending.clear();
        if (more) return true;
        // The end: an engine error as an error event, else the usage chunk; then [DONE].
        if (absl::Status status = s.events->final_status(); !status.ok()) {
          send(to_openai_error(status).to_json());
        } else if (request.include_usage) {
          json last = chunk_of(json::array());
          last["usage"] = usage(s.prompt_tokens, s.completion_tokens);
          send(last);
        }
        const std::string done_event = "data: [DONE]\n\n";
        sink.write(done_event.data(), done_event.size());
        s.finished = true;
        s.stream_hold.release();
        sink.done();
        return true;
      },
      [state](bool success) {
        if (!success) state->events->cancel();
      });
}

void OpenAiApi::run_tree(const Caller& caller, OpenAiRequest request, httplib::Response& res) {
  engine::TreeSearchJob job{.prompt = std::move(request.job.prompt),
                            .policy = *request.tree,
                            .sampling = request.job.sampling,
                            .max_tokens = request.job.max_tokens,
                            .limits = request.job.limits,
                            .requester = request.job.requester};
  const auto prompt_tokens = static_cast<int64_t>(job.prompt.size());
  const engine::TreeSearchBounds bounds = engine::tree_search_bounds(job, config_.page_tokens);
  if (bounds.tokens > config_.max_tree_tokens) {
    return reply_error(
        res, {.message = absl::StrCat("the tree may hold ", bounds.tokens,
                                      " tokens (prompt, branch_factor, max_depth, keep_best and "
                                      "max_tokens together); the limit is ",
                                      config_.max_tree_tokens, " (max_tree_tokens)"),
              .param = "deft.tree"});
  }
  KeyLimits::Hold stream_hold;
  KeyLimits::Hold queued_hold;
  absl::Status admitted = key_limits_.check_tokens(caller.key_id);
  if (admitted.ok()) admitted = key_limits_.open_stream(caller.key_id, &stream_hold);
  if (admitted.ok()) admitted = key_limits_.queue_job(caller.key_id, &queued_hold);
  if (!admitted.ok()) return reply_error(res, to_openai_error(admitted));

  std::shared_ptr<engine::TreeSearchEvents> events = engine_->run_tree(std::move(job));
  std::vector<engine::TreeSearchEvent> batch;
  std::optional<engine::TreeSearchEvent> finished;
  for (bool more = true; more;) {
    batch.clear();
    more = events->next(batch, kPollInterval);
    if (!batch.empty()) queued_hold.release();
    for (engine::TreeSearchEvent& event : batch) {
      if (event.kind == engine::TreeSearchEvent::Kind::kTokens) {
        count_tokens(caller, static_cast<int64_t>(event.delta.ids.size()));
      } else if (event.kind == engine::TreeSearchEvent::Kind::kFinished) {
        finished = std::move(event);
      }
    }
  }
  if (absl::Status status = events->final_status(); !status.ok() || !finished) {
    if (status.ok()) status = absl::InternalError("the tree search ended without a result");
    return reply_error(res, to_openai_error(status));
  }
  int64_t completion_tokens = 0;
  engine::FinishReason best_finish = engine::FinishReason::kNone;
  json nodes = json::array();
  for (const engine::TreeSearchNode& node : finished->nodes) {
    if (node.depth > 0) completion_tokens += static_cast<int64_t>(node.tokens.size());
    if (!finished->best_path.empty() && node.id == finished->best_path.back()) {
      best_finish = node.finish;
    }
    nodes.push_back({{"id", node.id},
                     {"parent", node.parent},
                     {"depth", node.depth},
                     {"score", node.score},
                     {"text", node.text},
                     {"tokens", node.depth > 0 ? node.tokens.size() : 0},
                     {"finish_reason", node.finish == engine::FinishReason::kPruned
                                           ? json("pruned")
                                           : finish_reason(node.finish)}});
  }
  json one = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason(best_finish)}};
  if (request.chat) {
    one["message"] = {{"role", "assistant"}, {"content", finished->best_text}};
  } else {
    one["text"] = finished->best_text;
  }
  const json answer = {
      {"id", random_id(request.chat ? "chatcmpl-" : "cmpl-")},
      {"object", request.chat ? "chat.completion" : "text_completion"},
      {"created", unix_seconds()},
      {"model", limits_.model_id},
      {"system_fingerprint", nullptr},
      {"choices", json::array({std::move(one)})},
      {"usage", usage(prompt_tokens, completion_tokens)},
      {"deft", {{"tree", {{"best_path", finished->best_path}, {"nodes", std::move(nodes)}}}}}};
  res.set_content(dump(answer), "application/json");
}

}  // namespace deft::server
