#include "bench/serve_bench/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace deft::bench::serve {
namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// The exit code of `pid` once it has exited (-1: killed by a signal); nullopt while it runs.
std::optional<int> exited(pid_t pid) {
  int status = 0;
  const pid_t done = waitpid(pid, &status, WNOHANG);
  if (done == 0) return std::nullopt;
  if (done < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::start(
    const std::string& binary, const std::vector<std::string>& args, const std::string& plan,
    double timeout_s) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  std::random_device random;
  server->dir_ = std::filesystem::temp_directory_path() /
                 absl::StrCat("serve_bench-", getpid(), "-", random());
  std::filesystem::create_directories(server->dir_);
  server->log_path_ = server->dir_ / "server.log";
  const std::filesystem::path port_file = server->dir_ / "ports.txt";

  std::vector<std::string> argv = {binary, "--listen", "127.0.0.1:0", "--metrics-listen",
                                   "127.0.0.1:0"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--port-file", port_file.string(), "--plan", plan});
  // Everything allocated before fork(): the child of a threaded process may only make
  // async-signal-safe calls until exec.
  std::vector<char*> c_argv;
  for (std::string& arg : argv) c_argv.push_back(arg.data());
  c_argv.push_back(nullptr);
  const std::string log = server->log_path_.string();
  server->pid_ = fork();
  if (server->pid_ < 0) return absl::InternalError("fork failed");
  if (server->pid_ == 0) {
    // The server ends with serve_bench, even when serve_bench is killed.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    execv(c_argv[0], c_argv.data());
    _exit(127);
  }

  // The port file appears once both listeners are up, before the model loads.
  const Clock::time_point deadline = after(timeout_s);
  int grpc_port = 0, metrics_port = 0;
  while (grpc_port == 0 || metrics_port == 0) {
    if (const std::optional<int> code = exited(server->pid_)) {
      server->pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat(binary, " exited with ", *code, " before listening:\n", server->log_tail()));
    }
    if (Clock::now() > deadline) {
      return absl::UnavailableError(
          absl::StrCat(binary, " did not listen within ", timeout_s, " s:\n", server->log_tail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::istringstream ports(read_file(port_file));
    for (std::string line; std::getline(ports, line);) {
      if (line.rfind("grpc=", 0) == 0 && !absl::SimpleAtoi(line.substr(5), &grpc_port)) {
        grpc_port = 0;
      }
      if (line.rfind("metrics=", 0) == 0 && !absl::SimpleAtoi(line.substr(8), &metrics_port)) {
        metrics_port = 0;
      }
    }
  }
  server->address_ = absl::StrCat("127.0.0.1:", grpc_port);
  server->metrics_address_ = absl::StrCat("127.0.0.1:", metrics_port);
  const double left_s = std::chrono::duration<double>(deadline - Clock::now()).count();
  if (absl::Status status = server->wait_serving(left_s); !status.ok()) return status;
  return server;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::attach(
    const std::string& address, const std::string& metrics_address, double timeout_s) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->address_ = address;
  server->metrics_address_ = metrics_address;
  if (absl::Status status = server->wait_serving(timeout_s); !status.ok()) return status;
  return server;
}

absl::Status ServerProcess::wait_serving(double timeout_s) {
  const std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  const auto health = grpc::health::v1::Health::NewStub(channel);
  const Clock::time_point deadline = after(timeout_s);
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status =
        health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    if (status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    if (pid_ > 0) {
      if (const std::optional<int> code = exited(pid_)) {
        pid_ = -1;
        return absl::UnavailableError(
            absl::StrCat("deft-server exited with ", *code, " while loading:\n", log_tail()));
      }
    }
    if (Clock::now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          address_, " did not report SERVING within ", timeout_s, " s (last: ",
          status.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())
                      : status.error_message(),
          ")\n", log_tail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string ServerProcess::log_tail(size_t bytes) const {
  if (log_path_.empty()) return "";
  const std::string log = read_file(log_path_);
  return log.size() > bytes ? "..." + log.substr(log.size() - bytes) : log;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    const Clock::time_point deadline = after(30);
    bool gone = false;
    while (!(gone = exited(pid_).has_value()) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!gone) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

}  // namespace deft::bench::serve
