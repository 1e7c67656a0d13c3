// A minimal HTTP/1.0 server for GET /metrics (Prometheus text format). prometheus-cpp's own
// Exposer runs on civetweb, whose threads have a fixed 100 KB stack; a process that also loads
// cuBLAS (its libcublasLt carries ~94 KB of static TLS) cannot create them (pthread_create
// answers EINVAL), so the server serves its one endpoint itself on a default-sized thread.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace deft::server {

class MetricsHttpServer {
 public:
  // `render` produces the body of GET /metrics (called on the server's thread).
  explicit MetricsHttpServer(std::function<std::string()> render);
  ~MetricsHttpServer();  // stops and joins
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Binds host:port (port 0: any free port; host an IPv4 address or "localhost") and starts
  // serving. Returns the bound port; INVALID_ARGUMENT / UNAVAILABLE naming the address.
  absl::StatusOr<int> listen(const std::string& address);

 private:
  void serve();
  void answer(int client);

  std::function<std::string()> render_;
  int socket_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace deft::server
