#include "server/metrics_http_server.h"

#include "server/http_server.h"

namespace deft::server {

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> render) {
  // Scrapes are small and rare: a few threads; no request has a body.
  http_ = std::make_unique<HttpServer>(
      HttpServerOptions{.name = "metrics", .max_body_bytes = 0, .worker_threads = 4});
  http_->routes().Get(
      "/metrics", [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
        res.set_content(render(), "text/plain; version=0.0.4");
      });
}

MetricsHttpServer::~MetricsHttpServer() = default;

absl::StatusOr<int> MetricsHttpServer::listen(const std::string& address) {
  return http_->listen(address);
}

}  // namespace deft::server
