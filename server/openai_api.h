// The OpenAI-compatible HTTP API beside gRPC (--http-listen): POST /v1/completions,
// POST /v1/chat/completions, GET /v1/models, GET /health, on the server's HTTP stack
// (server/http_server.h). Requests become the same engine jobs as gRPC's (a Generate: one prompt
// node, n branches sharing its KV; "deft": {"tree": ...}: a RunTree job) through the same
// EngineThread, under the same API keys (Authorization: Bearer KEY) and the same per-key limits
// (KeyLimits shared with DeftService).
//
// Streaming is server-sent events: one `data: {chunk}` per engine event batch, a last chunk
// with `usage` when stream_options.include_usage, then `data: [DONE]`. The stream starts only
// once the engine has admitted the job, so a refusal (queue full, key limits) is still an HTTP
// error with its status; an engine error after that is a `data: {"error": ...}` event. A client
// that goes away mid-stream cancels its job (its KV is freed before the next step); a
// non-streamed request runs to its end (max_tokens bounds it).
//
// Errors have OpenAI's shape (server/openai_request.h) and statuses: 400 bad request, 401 no or
// a wrong key, 404 unknown model or route, 413 body too large, 429 limits or full queue, 503
// loading or shutting down.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "engine/tokenizer/tokenizer.h"
#include "server/auth.h"
#include "server/chat_template.h"
#include "server/deft_service.h"
#include "server/engine_thread.h"
#include "server/http_server.h"
#include "server/key_limits.h"
#include "server/openai_request.h"
#include "server/server_config.h"

namespace deft::server {

class ServerMetrics;

class OpenAiApi {
 public:
  // Serves before the model is loaded: until attach(), every request but /health answers 503.
  // Everything given must outlive the API; `metrics` may be null.
  OpenAiApi(const ServerConfig& config, const Authenticator& auth, KeyLimits& key_limits,
            ServerMetrics* metrics);
  ~OpenAiApi();

  // Binds config.http_listen and serves; the bound port, or the error naming the address.
  absl::StatusOr<int> listen();
  // The loaded model (its id is `model_id`, what requests' "model" must name).
  void attach(const std::string& model_id, const ModelFacts& model,
              const engine::Tokenizer& tokenizer, EngineThread& engine, ChatTemplate chat_template);
  // /health says 200 only while serving (attached and not shutting down).
  void set_serving(bool serving) { serving_.store(serving); }
  // Stops the HTTP port (open streams end when the engine ends their jobs).
  void stop();

  // An error in OpenAI's shape: (body, content type), for HttpServerOptions::error_body.
  static std::pair<std::string, std::string> error_body(int status, const std::string& message);

 private:
  void completions(const httplib::Request& req, httplib::Response& res, bool chat);
  void generate(const Caller& caller, OpenAiRequest request, httplib::Response& res);
  void run_tree(const Caller& caller, OpenAiRequest request, httplib::Response& res);
  void models(const httplib::Request& req, httplib::Response& res);
  // The caller, or false with a 401 in `res`.
  bool authenticate(const httplib::Request& req, httplib::Response& res, Caller* caller) const;
  void reply_error(httplib::Response& res, const OpenAiError& error) const;
  // Metrics and the debug log of one finished request.
  void done(const char* route, const Caller& caller, int http_status) const;
  void count_tokens(const Caller& caller, int64_t tokens);

  const ServerConfig& config_;
  const Authenticator& auth_;
  KeyLimits& key_limits_;
  ServerMetrics* metrics_;
  std::unique_ptr<HttpServer> http_;
  // Set once by attach(), then read only; ready_ publishes them to the HTTP threads.
  OpenAiLimits limits_;
  EngineThread* engine_ = nullptr;
  std::atomic<bool> ready_{false};
  std::atomic<bool> serving_{false};
};

}  // namespace deft::server
