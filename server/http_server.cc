#include "server/http_server.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

// 8 MiB, glibc's default for the main thread: room for cuBLAS's static TLS and deep handlers.
constexpr size_t kWorkerStackBytes = size_t{8} << 20;

// "Queued" as TaskQueue::enqueue says it: nothing (void) or true.
template <typename Result>
Result queued() {
  if constexpr (!std::is_void_v<Result>) return true;
}

// The connections' threads (httplib::TaskQueue): `count` pthreads with an explicit stack size,
// made once; accepted connections wait in a queue for a free one.
class BigStackThreadPool final : public httplib::TaskQueue {
 public:
  explicit BigStackThreadPool(int count, const std::string& name) {
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setstacksize(&attributes, kWorkerStackBytes);
    for (int i = 0; i < count; ++i) {
      pthread_t thread;
      const int error = pthread_create(&thread, &attributes, &BigStackThreadPool::run, this);
      if (error != 0) {
        spdlog::error("{}: cannot create an HTTP worker thread (error {}); {} serve", name, error,
                      threads_.size());
        break;
      }
      threads_.push_back(thread);
    }
    pthread_attr_destroy(&attributes);
  }
  ~BigStackThreadPool() override { shutdown(); }

  // void in 0.11 (Debian 12), bool ("queued, else drop the connection") from 0.15 (newer
  // distributions): the override takes whichever the installed header declares.
  using EnqueueResult =
      decltype(std::declval<httplib::TaskQueue&>().enqueue(std::function<void()>()));

  EnqueueResult enqueue(std::function<void()> job) override {
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    wake_.notify_one();
    return queued<EnqueueResult>();
  }

  // Runs the queued connections to their end, then joins.
  void shutdown() override {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    wake_.notify_all();
    for (pthread_t thread : threads_) pthread_join(thread, nullptr);
  }

 private:
  static void* run(void* self) {
    auto& pool = *static_cast<BigStackThreadPool*>(self);
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(pool.mutex_);
        pool.wake_.wait(lock, [&] { return pool.stopping_ || !pool.jobs_.empty(); });
        if (pool.jobs_.empty()) return nullptr;
        job = std::move(pool.jobs_.front());
        pool.jobs_.pop_front();
      }
      job();
    }
  }

  std::vector<pthread_t> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
};

}  // namespace

bool split_host_port(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  if (!absl::SimpleAtoi(address.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return false;
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  if (*host == "localhost") *host = "127.0.0.1";
  return !host->empty();
}

HttpServer::HttpServer(HttpServerOptions options) : options_(std::move(options)) {
  const int workers = std::max(1, options_.worker_threads);
  const std::string name = options_.name;
  server_.new_task_queue = [workers, name] { return new BigStackThreadPool(workers, name); };
  server_.set_payload_max_length(options_.max_body_bytes);
  server_.set_read_timeout(options_.read_timeout);
  server_.set_write_timeout(options_.write_timeout);
  // One request per connection (the response says Connection: close). 0.11.4 decides whether
  // to read a next request before routing, so after a refusal that leaves a body unread (411,
  // 413 below) the rest of the body would be parsed as a next request (a request smuggled in a
  // body); and an idle keep-alive connection would hold a worker thread. A new loopback
  // connection costs far less than any completion.
  server_.set_keep_alive_max_count(1);
  server_.set_tcp_nodelay(true);  // SSE events are small: send each at once
  // SO_REUSEADDR only: the library's default adds SO_REUSEPORT, with which a second server on a
  // busy port would start and share its connections (main.cc says the same of gRPC).
  server_.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });

  const auto error_body = options_.error_body;
  const auto answer = [error_body](httplib::Response& res, int status, const std::string& message) {
    res.status = status;
    if (error_body) {
      auto [body, type] = error_body(status, message);
      res.set_content(body, type);
    } else {
      res.set_content(message + "\n", "text/plain");
    }
  };
  const size_t max_body = options_.max_body_bytes;
  // Before routing and before the body is read: refuse what the library would not bound. The
  // refused body stays unread; since every connection closes after one response (above), its
  // bytes are never parsed as a next request.
  server_.set_pre_routing_handler([answer, max_body](const httplib::Request& req,
                                                     httplib::Response& res) {
    if (req.has_header("Transfer-Encoding")) {
      answer(res, 411,
             "chunked request bodies are not accepted: send the body with a Content-Length");
      return httplib::Server::HandlerResponse::Handled;
    }
    size_t length = 0;
    if (req.has_header("Content-Length") &&
        (!absl::SimpleAtoi(req.get_header_value("Content-Length"), &length) || length > max_body)) {
      answer(res, 413,
             absl::StrCat("the request body is larger than this server accepts (", max_body,
                          " bytes)"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Errors the library answers itself (no route: 404, bad request line or header: 400, a body
  // over the limit: 413) get the caller's body; a handler's own error keeps its body.
  server_.set_error_handler([answer](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message;
    switch (res.status) {
      case 404:
        message = absl::StrCat("no route ", req.method, " ", req.path);
        break;
      case 413:
        message = "the request is larger than this server accepts";
        break;
      case 400:
        message = "malformed HTTP request";
        break;
      default:
        message = absl::StrCat("HTTP ", res.status);
        break;
    }
    answer(res, res.status, message);
  });
  server_.set_exception_handler(
      [answer, name](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("{}: {} {} failed: {}", name, req.method, req.path, what);
        answer(res, 500, "internal error");
      });
}

HttpServer::~HttpServer() { stop(); }

absl::StatusOr<int> HttpServer::listen(const std::string& address) {
  std::string host;
  int port = 0;
  if (!split_host_port(address, &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat(options_.name, " address \"", address, "\" is not host:port"));
  }
  int bound = 0;
  if (port == 0) {
    bound = server_.bind_to_any_port(host);
  } else if (server_.bind_to_port(host, port)) {
    bound = port;
  } else {
    bound = -1;
  }
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (", options_.name,
                                               "): the port is busy or the host is not local"));
  }
  accept_thread_ = std::thread([this] { server_.listen_after_bind(); });
  return bound;
}

void HttpServer::stop() {
  if (!accept_thread_.joinable()) return;
  server_.stop();
  accept_thread_.join();
}

}  // namespace deft::server
