// The gRPC codes a well-formed or malformed request may get from the server: OK or a client
// error. Anything else (INTERNAL, UNKNOWN, a crash's UNAVAILABLE) is a server bug.
#pragma once

#include <grpcpp/support/status_code_enum.h>

namespace deft::testing {

inline bool client_error_or_ok(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return true;
    default:
      return false;
  }
}

}  // namespace deft::testing
