#include "tests/integration/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#ifndef DEFT_SERVER_BINARY
#error "DEFT_SERVER_BINARY must name the deft-server binary"
#endif

namespace deft::testing {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::filesystem::path make_temp_dir() {
  std::random_device random;
  const std::filesystem::path base =
      std::filesystem::temp_directory_path() /
      ("deft-integration-" + std::to_string(getpid()) + "-" + std::to_string(random()));
  std::filesystem::create_directories(base);
  return base;
}

}  // namespace

pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log_path) {
  // Everything allocated before fork(): the child of a multithreaded process may only make
  // async-signal-safe calls until exec.
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const std::string log = log_path.string();
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (done < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

ProgramResult run_program(const std::vector<std::string>& argv, std::chrono::seconds timeout) {
  const std::filesystem::path dir = make_temp_dir();
  const std::filesystem::path log = dir / "output.txt";
  const pid_t pid = spawn(argv, log);
  ProgramResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) result.term_signal = WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.term_signal = SIGKILL;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.output = read_file(log);
  std::filesystem::remove_all(dir);
  return result;
}

std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> values;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#' || line.find('{') != std::string::npos) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    values[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return values;
}

ServerProcess::ServerProcess(std::vector<std::string> extra_args, bool wait_serving,
                             std::shared_ptr<grpc::ChannelCredentials> credentials)
    : dir_(make_temp_dir()) {
  start(std::move(extra_args), wait_serving, std::move(credentials));
}

void ServerProcess::start(std::vector<std::string> extra_args, bool wait_serving,
                          std::shared_ptr<grpc::ChannelCredentials> credentials) {
  const std::filesystem::path port_file = dir_ / "ports.txt";
  std::vector<std::string> argv = {DEFT_SERVER_BINARY, "--listen",    "127.0.0.1:0",
                                   "--metrics-listen", "127.0.0.1:0", "--port-file",
                                   port_file.string(), "--log-level", "info"};
  // DEFT_TEST_SERVER_ARGS (space-separated) come before the test's own: the same suite against
  // another backend, e.g. "--backend cuda --tensor-parallel 2" on a GPU machine (a later flag
  // wins, so a test that names a flag keeps its value).
  if (const char* env = std::getenv("DEFT_TEST_SERVER_ARGS"); env != nullptr) {
    std::istringstream words(env);
    for (std::string word; words >> word;) argv.push_back(word);
  }
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  pid_ = spawn(argv, dir_ / "server.log");
  ASSERT_GT(pid_, 0) << "fork failed";

  // The port file appears once both listeners are up (before the model loads).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(port_file)) {
    if (const std::optional<int> exit = wait_exit(pid_, std::chrono::milliseconds(20))) {
      pid_ = -1;
      GTEST_FAIL() << "deft-server exited with " << *exit << " before listening:\n" << log();
    }
    if (std::chrono::steady_clock::now() > deadline) {
      GTEST_FAIL() << "deft-server did not listen within 60 s:\n" << log();
    }
  }
  std::istringstream ports(read_file(port_file));
  for (std::string line; std::getline(ports, line);) {
    if (line.rfind("grpc=", 0) == 0) grpc_port_ = std::stoi(line.substr(5));
    if (line.rfind("metrics=", 0) == 0) metrics_port_ = std::stoi(line.substr(8));
  }
  ASSERT_GT(grpc_port_, 0) << read_file(port_file);
  channel_ = grpc::CreateChannel(address(), credentials);
  while (wait_serving && !serving()) {
    // A model that fails to load ends the server after it listened: say so at once.
    if (const std::optional<int> exit = wait_exit(pid_, std::chrono::milliseconds(20))) {
      pid_ = -1;
      GTEST_FAIL() << "deft-server exited with " << *exit << " while loading:\n" << log();
    }
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "never SERVING:\n" << log();
  }
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    wait_exit(pid_, std::chrono::seconds(10));
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string ServerProcess::log() const { return read_file(dir_ / "server.log"); }

std::map<std::string, double> ServerProcess::metrics() const {
  const std::string text = http_get(metrics_port_, "/metrics");
  EXPECT_FALSE(text.empty()) << "no answer from /metrics on port " << metrics_port_;
  return parse_metrics(text);
}

double ServerProcess::wait_metric(const std::string& name, double value,
                                  std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  double last = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    last = metrics()[name];
    if (last == value) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return last;
}

bool ServerProcess::serving(const std::string& service) const {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  return health->Check(&context, request, &response).ok() &&
         response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

void ServerProcess::signal(int signal) const {
  if (pid_ > 0) kill(pid_, signal);
}

std::optional<int> ServerProcess::stop(int signal, std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  kill(pid_, signal);
  std::optional<int> exit = wait_exit(pid_, timeout);
  if (exit) pid_ = -1;
  return exit;
}

std::optional<int> ServerProcess::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  std::optional<int> exit = wait_exit(pid_, timeout);
  if (exit) pid_ = -1;
  return exit;
}

}  // namespace deft::testing
