// The deft.v1.Deft gRPC service (synchronous API: one handler thread per call; streaming
// handlers wait on their request's engine event queue). Validates every request before it reaches the
// engine, with a status code and a message that names the bad field and value.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/engine_thread.h"
#include "server/server_config.h"

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
};

class DeftService final : public deft::v1::Deft::Service {
 public:
  // The service can serve before the model is loaded: until attach(), every RPC answers
  // UNAVAILABLE (the health service says NOT_SERVING then). `config` and `metrics` must outlive
  // the service; `metrics` may be null.
  DeftService(const ServerConfig& config, ServerMetrics* metrics);
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

 private:
  grpc::Status generate(grpc::ServerContext* context, const deft::v1::GenerateRequest& request,
                        grpc::ServerWriter<deft::v1::GenerateResponse>* writer);
  grpc::Status run_tree(grpc::ServerContext* context, const deft::v1::RunTreeRequest& request,
                        grpc::ServerWriter<deft::v1::TreeEvent>* writer);
  grpc::Status tree_session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<deft::v1::SessionResponse, deft::v1::SessionRequest>* stream);
  grpc::Status verify(grpc::ServerContext* context, const deft::v1::VerifyRequest& request,
                      deft::v1::VerifyResponse* response);
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
  // Records the RPC's outcome (metrics, debug log) and returns it.
  grpc::Status done(const char* rpc, grpc::Status status) const;

  const ServerConfig& config_;
  ServerMetrics* metrics_;
  // Set once by attach(), then read only; ready_ publishes them to the handler threads.
  ModelFacts model_;
  const engine::Tokenizer* tokenizer_ = nullptr;
  EngineThread* engine_ = nullptr;
  std::atomic<bool> ready_{false};
};

}  // namespace deft::server
