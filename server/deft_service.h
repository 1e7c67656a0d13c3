// The deft.v1.Deft gRPC service (synchronous API: one handler thread per call; streaming
// handlers wait on their request's engine event queue). Validates every request before it reaches the
// engine, with a status code and a message that names the bad field and value.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/auth.h"
#include "server/engine_thread.h"
#include "server/key_limits.h"
#include "server/request_log.h"
#include "server/server_config.h"
#include "server/speculative_request.h"
#include "server/stream_watchdog.h"

namespace deft::server {

class ServerMetrics;

// Static facts about the loaded model for ModelInfo.
struct ModelFacts {
  std::string name;
  std::string architecture;
  int32_t vocab_size = 0;
  int64_t max_context = 0;
  int32_t num_layers = 0;
  int32_t hidden_size = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  std::string dtype;
  std::string backend;
  std::string draft_model;       // name of the speculative draft model; empty: none
  SpeculationOffer speculation;  // what speculative requests may ask for
};

class DeftService final : public deft::v1::Deft::Service {
 public:
  // The service can serve before the model is loaded: until attach(), every RPC answers
  // UNAVAILABLE (the health service says NOT_SERVING then). `config`, `auth` and `metrics` must
  // outlive the service; `metrics` may be null.
  //
  // Every RPC first authenticates its caller through `auth` (UNAUTHENTICATED without a valid
  // key when keys are configured), then applies the caller's key limits (config's *_per_key).
  // A TreeSession belongs to the key that opened it: a Verify on it from another key gets the
  // same NOT_FOUND as an unknown session id.
  DeftService(const ServerConfig& config, const Authenticator& auth, ServerMetrics* metrics);
  // The loaded model; `tokenizer` and `engine` must outlive the service. Called once.
  void attach(ModelFacts model, const engine::Tokenizer& tokenizer, EngineThread& engine);

  grpc::Status Generate(grpc::ServerContext* context, const deft::v1::GenerateRequest* request,
                        grpc::ServerWriter<deft::v1::GenerateResponse>* writer) override;
  grpc::Status RunTree(grpc::ServerContext* context, const deft::v1::RunTreeRequest* request,
                       grpc::ServerWriter<deft::v1::TreeEvent>* writer) override;
  grpc::Status TreeSession(grpc::ServerContext* context,
                           grpc::ServerReaderWriter<deft::v1::SessionResponse,
                                                    deft::v1::SessionRequest>* stream) override;
  grpc::Status Verify(grpc::ServerContext* context, const deft::v1::VerifyRequest* request,
                      deft::v1::VerifyResponse* response) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const deft::v1::TokenizeRequest* request,
                        deft::v1::TokenizeResponse* response) override;
  grpc::Status Detokenize(grpc::ServerContext* context, const deft::v1::DetokenizeRequest* request,
                          deft::v1::DetokenizeResponse* response) override;
  grpc::Status ModelInfo(grpc::ServerContext* context, const deft::v1::ModelInfoRequest* request,
                         deft::v1::ModelInfoResponse* response) override;

  // The per-key limits, shared with the other front ends (server/openai_api.h), so that a key's
  // streams and tokens count once whichever port they use.
  KeyLimits& key_limits() { return key_limits_; }

 private:
  grpc::Status generate(grpc::ServerContext* context, const Caller& caller,
                        const deft::v1::GenerateRequest& request,
                        grpc::ServerWriter<deft::v1::GenerateResponse>* writer);
  grpc::Status run_tree(grpc::ServerContext* context, const Caller& caller,
                        const deft::v1::RunTreeRequest& request,
                        grpc::ServerWriter<deft::v1::TreeEvent>* writer);
  grpc::Status tree_session(
      grpc::ServerContext* context, const Caller& caller,
      grpc::ServerReaderWriter<deft::v1::SessionResponse, deft::v1::SessionRequest>* stream);
  grpc::Status verify(grpc::ServerContext* context, const Caller& caller,
                      const deft::v1::VerifyRequest& request, deft::v1::VerifyResponse* response);
  // The caller of `context`, or UNAUTHENTICATED.
  grpc::Status authenticate(const grpc::ServerContext& context, Caller* caller) const;
  // A new job's key limits: tokens of the last minute, then one of the key's concurrent
  // streams into `stream`, then a waiting place into `queued`.
  absl::Status admit_job(const Caller& caller, KeyLimits::Hold* stream, KeyLimits::Hold* queued);
  // Counts tokens streamed to the caller (key limits, per-key metrics).
  void count_tokens(const Caller& caller, int64_t tokens);
  // Token ids of a prompt (text: tokenized, with BOS when `add_bos`; ids: checked against the
  // vocabulary), within max_prompt_tokens.
  absl::StatusOr<std::vector<engine::TokenId>> prompt_tokens(const deft::v1::Prompt& prompt,
                                                             const std::string& field,
                                                             bool add_bos = true) const;
  // Sampling parameters, stop conditions and max_tokens (0: the server default), validated.
  absl::Status sampling(const deft::v1::SamplingParams& sampling, const std::string& field,
                        engine::SamplingParams* params, engine::StreamLimits* limits,
                        int32_t* max_tokens) const;
  // A verify's node, drafted tree and sampling from a VerifyRequest or a session's
  // VerifyCommand (the same fields), validated; a non-empty `prefix` ("verify.") names the command
  // in errors.
  template <typename Request>
  absl::Status verify_command(const Request& request, const std::string& prefix,
                              engine::VerifyCommand* command) const;
  // A session command from the proto; a malformed one carries its error in `invalid`.
  engine::SessionCommand session_command(const deft::v1::SessionRequest& request) const;
  bool ready() const;
  static grpc::Status loading();
  // Records the RPC's outcome (metrics, the request's log line) and returns it.
  grpc::Status done(const RequestLog& call, const Caller& caller, grpc::Status status) const;

  const ServerConfig& config_;
  const Authenticator& auth_;
  ServerMetrics* metrics_;
  KeyLimits key_limits_;
  StreamWatchdog watchdog_;  // cuts streams whose client stopped reading
  // The key id that opened each open TreeSession.
  mutable std::mutex session_owners_mutex_;
  std::unordered_map<uint64_t, std::string> session_owners_;
  // Set once by attach(), then read only; ready_ publishes them to the handler threads.
  ModelFacts model_;
  const engine::Tokenizer* tokenizer_ = nullptr;
  EngineThread* engine_ = nullptr;
  std::atomic<bool> ready_{false};
};

}  // namespace deft::server
