// Starts the real deft-server binary on free loopback ports (port 0; the server writes the
// ports it bound to a port file), waits for the health service to report SERVING, and stops it
// with a signal. Also: a plain HTTP GET for the Prometheus endpoint, and running other programs.
#pragma once

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace deft::testing {

// Result of a program run to completion.
struct ProgramResult {
  int exit_code = -1;  // -1: killed by a signal (see term_signal)
  int term_signal = 0;
  std::string output;  // stdout and stderr together
};

// Runs `argv` (argv[0] a path) with a time limit; output captured.
ProgramResult run_program(const std::vector<std::string>& argv,
                          std::chrono::seconds timeout = std::chrono::seconds(60));

// A child process with stdout+stderr going to `log_path`.
pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log_path);

// Waits for `pid` up to `timeout`; the exit code, -1 for a signal, nullopt on timeout.
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds timeout);

// GET http://127.0.0.1:port/path; the body, or empty on failure.
std::string http_get(int port, const std::string& path);

// The samples of a Prometheus text exposition without labels: name -> value.
std::map<std::string, double> parse_metrics(const std::string& text);

class ServerProcess {
 public:
  // Starts deft-server with `extra_args` after the test defaults (loopback port 0, metrics on
  // port 0, port file, warn logging) and waits until it listens and, with `wait_serving`, until
  // its health service reports SERVING (the model is loaded). Fails the current test (and
  // returns with running() false) when it does not come up. `credentials` are those of
  // channel() (TLS for a server started with --tls-cert).
  explicit ServerProcess(
      std::vector<std::string> extra_args = {}, bool wait_serving = true,
      std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());
  ~ServerProcess();  // SIGKILL when still running

  bool running() const { return pid_ > 0; }
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  std::unique_ptr<deft::v1::Deft::Stub> stub() const { return deft::v1::Deft::NewStub(channel_); }
  std::string log() const;

  // Current metric values (fails the test when the endpoint does not answer).
  std::map<std::string, double> metrics() const;
  // Polls `name` until it equals `value` or `timeout` passes; returns the last value seen.
  double wait_metric(const std::string& name, double value,
                     std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
  // True when the health service answers SERVING for `service`.
  bool serving(const std::string& service = "") const;

  // Sends `signal` without waiting.
  void signal(int signal) const;
  // Sends `signal` and waits for the exit; the exit code (-1 killed, nullopt timeout).
  std::optional<int> stop(int signal = SIGTERM,
                          std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Waits for an exit of its own (after a signal sent earlier); as stop().
  std::optional<int> wait(std::chrono::milliseconds timeout);
  pid_t pid() const { return pid_; }

 private:
  void start(std::vector<std::string> extra_args, bool wait_serving,
             std::shared_ptr<grpc::ChannelCredentials> credentials);

  std::filesystem::path dir_;
  pid_t pid_ = -1;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace deft::testing
