#include "server/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace deft::server {

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> render)
    : render_(std::move(render)) {}

MetricsHttpServer::~MetricsHttpServer() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
  if (socket_ >= 0) ::close(socket_);
}

absl::StatusOr<int> MetricsHttpServer::listen(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\" is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": \"", host, "\" is not an IPv4 address"));
  }
  socket_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(socket_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (socket_ < 0 || ::bind(socket_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(socket_, 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", std::strerror(errno)));
  }
  socklen_t length = sizeof(addr);
  ::getsockname(socket_, reinterpret_cast<sockaddr*>(&addr), &length);
  thread_ = std::thread([this] { serve(); });
  return static_cast<int>(ntohs(addr.sin_port));
}

void MetricsHttpServer::serve() {
  while (!stopping_.load()) {
    pollfd ready{.fd = socket_, .events = POLLIN, .revents = 0};
    if (::poll(&ready, 1, 200) <= 0) continue;  // wakes now and then to see stopping_
    const int client = ::accept4(socket_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    answer(client);
    ::close(client);
  }
}

void MetricsHttpServer::answer(int client) {
  // The request line is all we need; headers up to 8 KB are read and ignored.
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
    pollfd ready{.fd = client, .events = POLLIN, .revents = 0};
    if (::poll(&ready, 1, 2000) <= 0) return;
    const ssize_t got = ::recv(client, buffer, sizeof(buffer), 0);
    if (got <= 0) break;
    request.append(buffer, static_cast<size_t>(got));
  }
  const bool metrics = request.starts_with("GET /metrics ") || request.starts_with("GET /metrics?");
  const std::string body = metrics ? render_() : "not found: the endpoint is /metrics\n";
  const std::string response = absl::StrCat(
      metrics ? "HTTP/1.0 200 OK\r\n" : "HTTP/1.0 404 Not Found\r\n",
      "Content-Type: ", metrics ? "text/plain; version=0.0.4" : "text/plain",
      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t wrote =
        ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (wrote <= 0) return;
    sent += static_cast<size_t>(wrote);
  }
}

}  // namespace deft::server
