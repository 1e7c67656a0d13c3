// Small synchronous C++ clients of the tree RPCs for the integration tests: a TreeSession
// stream that answers one command at a time, RunTree and Generate collected whole.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"

namespace deft::testing {

// The tokens one node (or one Generate branch) streamed, assembled.
struct StreamedTokens {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
  deft::v1::FinishReason finish = deft::v1::FINISH_REASON_UNSPECIFIED;
  int messages = 0;
  int messages_after_finish = 0;
  void add(const deft::v1::Tokens& delta, deft::v1::FinishReason reason);
};

struct GenerateRun {
  grpc::Status status;
  std::map<int32_t, StreamedTokens> branches;
};
GenerateRun run_generate(deft::v1::Deft::Stub& stub, const deft::v1::GenerateRequest& request);
// A greedy Generate of one branch from token ids, EOS ignored (so it runs to max_tokens).
deft::v1::GenerateRequest greedy_request(const std::vector<int32_t>& prompt, int max_tokens);

struct TreeRun {
  grpc::Status status;
  std::vector<deft::v1::TreeEvent> events;
  std::map<int64_t, StreamedTokens> streamed;  // per node, from `tokens` events
  int finished_events = 0;
  deft::v1::TreeResult result;  // the last `finished` event
};
TreeRun run_tree(deft::v1::Deft::Stub& stub, const deft::v1::RunTreeRequest& request);

// One TreeSession stream. call() sends a command (request ids 1, 2, ...) and reads every
// response to it: one, or for a decode one per message until each node has its finish_reason
// (or an error). Every response is checked to echo the request id and the session id.
class TestSession {
 public:
  explicit TestSession(deft::v1::Deft::Stub& stub,
                       std::chrono::seconds deadline = std::chrono::seconds(120));
  // A stream that ends before the answer is complete fails the test unless `expect_end`.
  std::vector<deft::v1::SessionResponse> call(deft::v1::SessionRequest request,
                                              bool expect_end = false);
  ~TestSession();  // cancels a stream that was not finished

  // Single-response commands: the response (has_error() when refused).
  deft::v1::SessionResponse create(const std::vector<int32_t>& prompt);
  deft::v1::SessionResponse create_text(const std::string& text);
  deft::v1::SessionResponse extend(int64_t node, const std::vector<int32_t>& tokens);
  deft::v1::SessionResponse extend_text(int64_t node, const std::string& text);
  deft::v1::SessionResponse branch(int64_t node, int32_t k);
  deft::v1::SessionResponse prune(int64_t node);
  deft::v1::SessionResponse score(int64_t node, const std::vector<int32_t>& tokens);
  deft::v1::SessionResponse score_text(int64_t node, const std::string& text);
  deft::v1::SessionResponse close();
  // The stream's verify command (greedy unless `sampling` says otherwise).
  deft::v1::SessionResponse verify(int64_t node, const std::vector<int32_t>& tokens,
                                   const std::vector<int32_t>& parents,
                                   const deft::v1::SamplingParams& sampling = {});

  // A decode: per node its tokens; `error` set when the command was refused.
  struct Decoded {
    std::map<int64_t, StreamedTokens> nodes;
    std::optional<deft::v1::Error> error;
    int responses = 0;
  };
  Decoded decode(const std::vector<int64_t>& nodes, const deft::v1::SamplingParams& sampling);
  // Greedy, EOS ignored, max_tokens new tokens per node.
  Decoded decode_greedy(const std::vector<int64_t>& nodes, int max_tokens);

  uint64_t session_id() const { return session_id_; }
  bool stream_ended() const { return ended_; }
  grpc::ClientContext& context() { return context_; }
  // Half-closes and returns the final status (responses still unread fail the test, but for
  // a `closed` confirmation of the half-close).
  grpc::Status finish();

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<deft::v1::SessionRequest, deft::v1::SessionResponse>>
      stream_;
  uint64_t next_request_id_ = 1;
  uint64_t session_id_ = 0;
  bool ended_ = false;
  bool writes_done_ = false;
  bool finished_ = false;
};

// The google.rpc.Code of a refused session command, or -1 when it was not refused.
int error_code(const deft::v1::SessionResponse& response);

}  // namespace deft::testing
