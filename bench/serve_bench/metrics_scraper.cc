#include "bench/serve_bench/metrics_scraper.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>

namespace deft::bench::serve {
namespace {

// GET http://address/path over HTTP/1.0; the body, or empty on any failure.
std::string http_get(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) return "";
  std::string response;
  const int fd = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  if (fd >= 0) {
    timeval timeout{.tv_sec = 5, .tv_usec = 0};  // a stuck server must not stall the level
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    if (connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
      const std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + host + "\r\n\r\n";
      if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
        char buffer[8192];
        for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
      }
    }
    close(fd);
  }
  freeaddrinfo(found);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

}  // namespace

MetricValues MetricsScraper::scrape() const {
  MetricValues values;
  if (!enabled()) return values;
  std::istringstream lines(http_get(address_, "/metrics"));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#' || line.find('{') != std::string::npos) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    values[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return values;
}

void MetricsScraper::start_sampling(double interval_s) {
  stop_sampling();
  if (!enabled()) return;
  maxima_.clear();
  sampling_ = true;
  sampler_ = std::thread([this, interval_s] {
    const auto interval = std::chrono::duration<double>(interval_s);
    while (sampling_) {
      const auto next = std::chrono::steady_clock::now() + interval;
      const MetricValues values = scrape();
      {
        std::lock_guard lock(maxima_mutex_);
        for (const auto& [name, value] : values) {
          const auto [it, inserted] = maxima_.try_emplace(name, value);
          if (!inserted) it->second = std::max(it->second, value);
        }
      }
      while (sampling_ && std::chrono::steady_clock::now() < next) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
}

MetricValues MetricsScraper::stop_sampling() {
  sampling_ = false;
  if (sampler_.joinable()) sampler_.join();
  std::lock_guard lock(maxima_mutex_);
  return maxima_;
}

}  // namespace deft::bench::serve
