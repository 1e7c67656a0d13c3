// One line per RPC when it ends (server/log_format.h: text or JSON), with its request id, the
// peer, the caller's key id (never the key), the RPC, the status code and the duration:
//
//   request rpc=Generate status=OK id=5f3a0c0e2d41b7a9-17 peer=ipv4:10.0.0.7:53122 key=alice
//           ms=812.345
//
// Level: info, except a successful unary call (Verify, Tokenize, Detokenize, ModelInfo: a
// speculative client makes one Verify per step) and an UNAUTHENTICATED one (server/auth.h logs a
// refusal once a minute per peer, not per call), which go to debug. A failure's message is a
// field too. The request id is the client's `x-request-id` metadata when it has one of 1 to 64
// printable ASCII characters, otherwise the server makes one; either way it is sent back as
// `x-request-id` initial metadata, so a client can quote it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <string_view>

#include "server/auth.h"

namespace deft::server {

// "OK", "INVALID_ARGUMENT", ...: the code's name as gRPC documents it.
std::string_view status_code_name(grpc::StatusCode code);

class RequestLog {
 public:
  // At the start of a handler, before anything is written. `rpc` is a literal.
  RequestLog(grpc::ServerContext& context, const char* rpc, bool streaming);

  const char* rpc() const { return rpc_; }
  const std::string& request_id() const { return request_id_; }
  // Logs the call's line.
  void finish(const Caller& caller, const grpc::Status& status) const;

 private:
  const grpc::ServerContext& context_;
  const char* rpc_;
  bool streaming_;
  std::string request_id_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace deft::server
