// One HTTP/1.1 stack for every HTTP port of deft-server (the OpenAI-compatible API, /metrics),
// hardened once: cpp-httplib (Debian's libcpp-httplib-dev 0.11.4, a shared library) with
//
//  - request line and each header line up to 8 KiB (the library's compiled-in limit; longer:
//    400), a body up to `max_body_bytes` (Content-Length larger: 413 before the body is read),
//    no chunked request bodies (411: 0.11.4 does not bound them, CVE-2025-46728);
//  - a read and a write timeout per socket operation, so a client that stops sending or
//    reading loses its connection; one request per connection (no keep-alive: see the .cc);
//  - connections served by `worker_threads` threads that this class creates with an 8 MiB
//    stack. (prometheus-cpp's civetweb threads have a fixed 100 KB stack, which a process that
//    loads cuBLAS cannot create: libcublasLt carries ~94 KB of static TLS, which glibc takes
//    out of each thread's stack.) A connection holds a thread while it is open, so
//    `worker_threads` is also the number of connections served at once; more wait for a
//    thread in accept order.
//  - every error answered by `error_body` (a JSON body of the caller's choice), never the
//    library's empty default; an exception in a handler is a 500, not a crash.
//
// Not bounded by this version of the library: the number of header lines of one request
// (CVE-2025-52887) and the total time a slow client may take to send its headers (each read
// has its timeout, the request as a whole has none). Put the port behind a proxy (nginx)
// before exposing it to untrusted networks; README "Security" says so.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace deft::server {

struct HttpServerOptions {
  std::string name = "http";              // names the port in logs and errors ("metrics", "openai")
  size_t max_body_bytes = 1 << 20;        // larger request bodies: 413
  int worker_threads = 16;                // connections served at once
  std::chrono::seconds read_timeout{10};  // one read of a request (headers, body)
  std::chrono::seconds write_timeout{10};  // one write of a response
  // The body of an error the library itself answers (404, 413, 400 on a bad request line):
  // (status, message) -> (body, content type).
  std::function<std::pair<std::string, std::string>(int status, const std::string& message)>
      error_body;
};

class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Routes are added here before listen().
  httplib::Server& routes() { return server_; }

  // Binds host:port (port 0: any free port) and serves on a thread of its own. Returns the
  // bound port; INVALID_ARGUMENT for an address that is not host:port, UNAVAILABLE when the
  // port cannot be bound (busy: the start fails, as for the gRPC port).
  absl::StatusOr<int> listen(const std::string& address);

  // Stops accepting, lets the worker threads finish their connections, joins. Idempotent.
  void stop();

  const HttpServerOptions& options() const { return options_; }

 private:
  HttpServerOptions options_;
  httplib::Server server_;
  std::thread accept_thread_;
};

// Splits "host:port" ("[::1]:80" too); false when it is not one.
bool split_host_port(const std::string& address, std::string* host, int* port);

}  // namespace deft::server
