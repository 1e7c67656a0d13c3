// deft-cli session: a TreeSession scripted from a line-based file, and the synchronous
// session stream that deft-cli verify uses too.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"

namespace deft::cli {

// One TreeSession stream, one command at a time: call() writes a command and reads every
// response to it (a decode: until each of its nodes has its finish_reason, or an error).
class SessionStream {
 public:
  explicit SessionStream(deft::v1::Deft::Stub& stub);
  // False when the stream ended before the answer was complete (see finish()).
  bool call(deft::v1::SessionRequest request,
            const std::function<void(const deft::v1::SessionResponse&)>& on_response);
  // The id the server gave the session (0 before the first response).
  uint64_t session_id() const { return session_id_; }
  // Half-closes the stream and returns its final status.
  grpc::Status finish();

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<deft::v1::SessionRequest, deft::v1::SessionResponse>>
      stream_;
  uint64_t next_request_id_ = 1;
  uint64_t session_id_ = 0;
  bool writes_done_ = false;
};

// Prints one response on one line ("created node 0", "decoded node 3 +2 \"text\"", ...).
void print_session_response(const deft::v1::SessionResponse& response, uint64_t session_id);

// Runs `deft-cli session [SCRIPT]`; returns the process exit code.
int session_command(deft::v1::Deft::Stub& stub, const std::vector<std::string>& args);

}  // namespace deft::cli
