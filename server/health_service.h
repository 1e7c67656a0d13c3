// grpc.health.v1.Health for the server ("") and for "deft.v1.Deft", both with one status:
// NOT_SERVING while the model loads and while the server drains, SERVING in between. Our own
// service rather than gRPC's default one so that it can require an API key (auth_health): a
// gRPC server interceptor cannot refuse a call. Open by default, for load balancer and
// Kubernetes probes.
#pragma once

#include <condition_variable>
#include <mutex>

#include "grpc/health/v1/health.grpc.pb.h"
#include "server/auth.h"

namespace deft::server {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  // With `require_key`, callers authenticate through `auth`, which must outlive the service.
  HealthService(const Authenticator& auth, bool require_key);

  void set_serving(bool serving);
  // Ends every Watch stream (before the gRPC server shuts down).
  void shutdown();

  // NOT_FOUND for a service other than "" and "deft.v1.Deft".
  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  // Sends the status now and on every change (SERVICE_UNKNOWN for another service) until the
  // client cancels or the server shuts down.
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  grpc::Status authenticate(const grpc::ServerContext& context) const;

  const Authenticator& auth_;
  const bool require_key_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool serving_ = false;
  bool shut_down_ = false;
};

}  // namespace deft::server
