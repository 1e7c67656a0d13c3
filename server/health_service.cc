#include "server/health_service.h"

#include <chrono>

namespace deft::server {
namespace {

using grpc::health::v1::HealthCheckResponse;

// How often a Watch looks at its client while nothing changes.
constexpr std::chrono::milliseconds kWatchPoll{100};

bool known_service(const std::string& service) {
  return service.empty() || service == "deft.v1.Deft";
}

}  // namespace

HealthService::HealthService(const Authenticator& auth, bool require_key)
    : auth_(auth), require_key_(require_key) {}

void HealthService::set_serving(bool serving) {
  {
    std::lock_guard lock(mutex_);
    serving_ = serving;
  }
  changed_.notify_all();
}

void HealthService::shutdown() {
  {
    std::lock_guard lock(mutex_);
    serving_ = false;
    shut_down_ = true;
  }
  changed_.notify_all();
}

grpc::Status HealthService::authenticate(const grpc::ServerContext& context) const {
  if (!require_key_) return grpc::Status::OK;
  absl::StatusOr<Caller> caller = auth_.authenticate(context);
  if (caller.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
}

grpc::Status HealthService::Check(grpc::ServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  if (grpc::Status status = authenticate(*context); !status.ok()) return status;
  if (!known_service(request->service())) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "unknown service '" + request->service() + "'");
  }
  std::lock_guard lock(mutex_);
  response->set_status(serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  if (grpc::Status status = authenticate(*context); !status.ok()) return status;
  const bool known = known_service(request->service());
  std::unique_lock lock(mutex_);
  bool first = true;
  bool sent_serving = false;
  while (!shut_down_ && !context->IsCancelled()) {
    if (first || (known && serving_ != sent_serving)) {
      HealthCheckResponse response;
      response.set_status(!known     ? HealthCheckResponse::SERVICE_UNKNOWN
                          : serving_ ? HealthCheckResponse::SERVING
                                     : HealthCheckResponse::NOT_SERVING);
      sent_serving = serving_;
      first = false;
      lock.unlock();
      const bool written = writer->Write(response);
      lock.lock();
      if (!written) break;
      continue;
    }
    changed_.wait_for(lock, kWatchPoll);
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the health watch ended");
}

}  // namespace deft::server
