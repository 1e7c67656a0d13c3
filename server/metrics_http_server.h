// GET /metrics (Prometheus text format) on its own port, served by the server's one HTTP stack
// (server/http_server.h: cpp-httplib on worker threads with an 8 MiB stack). prometheus-cpp's
// own Exposer is not used: it runs on civetweb, whose threads have a fixed 100 KB stack that a
// process loading cuBLAS (its libcublasLt carries ~94 KB of static TLS) cannot create
// (pthread_create answers EINVAL).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace deft::server {

class HttpServer;

class MetricsHttpServer {
 public:
  // `render` produces the body of GET /metrics (called on an HTTP worker thread).
  explicit MetricsHttpServer(std::function<std::string()> render);
  ~MetricsHttpServer();  // stops and joins
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Binds host:port (port 0: any free port) and starts serving. Returns the bound port;
  // INVALID_ARGUMENT / UNAVAILABLE naming the address.
  absl::StatusOr<int> listen(const std::string& address);

 private:
  std::unique_ptr<HttpServer> http_;
};

}  // namespace deft::server
