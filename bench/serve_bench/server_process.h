// The deft-server that serve_bench measures: a child process on free loopback ports
// (`--listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file F`), ready once its health
// service reports SERVING (it listens NOT_SERVING while the model loads); or, with
// --address, a server someone else started.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::bench::serve {

class ServerProcess {
 public:
  // Starts `binary` with the loopback defaults, then `args`, then `--plan plan` (the last
  // occurrence of an option wins), its output going to a log file, and waits until it serves.
  // UNAVAILABLE with the log's tail when it exits or does not come up within `timeout_s`.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> start(const std::string& binary,
                                                              const std::vector<std::string>& args,
                                                              const std::string& plan,
                                                              double timeout_s);
  // A running server; `metrics_address` may be empty (no metrics).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> attach(const std::string& address,
                                                               const std::string& metrics_address,
                                                               double timeout_s);
  ~ServerProcess();  // stops a started server (SIGTERM, then SIGKILL after 30 s)

  const std::string& address() const { return address_; }                  // host:port
  const std::string& metrics_address() const { return metrics_address_; }  // empty: none
  const std::filesystem::path& log_path() const { return log_path_; }      // empty: attached
  // The last `bytes` of the server's log (started servers only).
  std::string log_tail(size_t bytes = 4000) const;

 private:
  ServerProcess() = default;
  // Polls grpc.health.v1 until SERVING; UNAVAILABLE after `timeout_s` or when the child exits.
  absl::Status wait_serving(double timeout_s);

  pid_t pid_ = -1;
  std::filesystem::path dir_;
  std::filesystem::path log_path_;
  std::string address_;
  std::string metrics_address_;
};

}  // namespace deft::bench::serve
