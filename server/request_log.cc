#include "server/request_log.h"

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/log_format.h"

namespace deft::server {
namespace {

constexpr size_t kMaxClientIdBytes = 64;

bool usable_client_id(const grpc::string_ref& id) {
  if (id.empty() || id.size() > kMaxClientIdBytes) return false;
  for (const char c : id) {
    if (c < 0x21 || c > 0x7e) return false;  // printable, no spaces
  }
  return true;
}

// "<process prefix>-<counter>": unique across restarts (a random prefix per process) and cheap.
std::string server_request_id() {
  static const uint64_t prefix = std::random_device{}() * 0x100000000ULL ^ std::random_device{}();
  static std::atomic<uint64_t> counter{0};
  return absl::StrFormat("%016x-%d", prefix, counter.fetch_add(1) + 1);
}

}  // namespace

std::string_view status_code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

RequestLog::RequestLog(grpc::ServerContext& context, const char* rpc, bool streaming)
    : context_(context),
      rpc_(rpc),
      streaming_(streaming),
      start_(std::chrono::steady_clock::now()) {
  const auto& metadata = context.client_metadata();
  const auto given = metadata.find("x-request-id");
  if (given != metadata.end() && usable_client_id(given->second)) {
    request_id_.assign(given->second.data(), given->second.size());
  } else {
    request_id_ = server_request_id();
  }
  context.AddInitialMetadata("x-request-id", request_id_);
}

void RequestLog::finish(const Caller& caller, const grpc::Status& status) const {
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  const grpc::StatusCode code = status.error_code();
  const bool quiet =
      code == grpc::StatusCode::UNAUTHENTICATED || (code == grpc::StatusCode::OK && !streaming_);
  const spdlog::level::level_enum level = quiet ? spdlog::level::debug : spdlog::level::info;
  const std::string peer = context_.peer();
  const std::string_view code_text = status_code_name(code);
  if (status.ok()) {
    log_fields(level, "request",
               {{"rpc", rpc_},
                {"status", code_text},
                {"id", request_id_},
                {"peer", peer},
                {"key", caller.key_id},
                {"ms", ms}});
  } else {
    log_fields(level, "request",
               {{"rpc", rpc_},
                {"status", code_text},
                {"id", request_id_},
                {"peer", peer},
                {"key", caller.key_id},
                {"ms", ms},
                {"error", status.error_message()}});
  }
}

}  // namespace deft::server
