// Integration tests of the server's security: TLS and mutual TLS with certificates made by the
// openssl command line at test time (a CA, a server certificate for localhost and 127.0.0.1, a
// client certificate of that CA, and one of a second, untrusted CA), API keys (UNAUTHENTICATED
// without a valid one, health open, reload on SIGHUP), sessions owned by their key, per-key
// limits, server reflection open or keyed, and deft-cli with --tls-ca and --api-key. Channels
// come from clients/cli's make_channel, as deft-cli makes them.
#include <google/protobuf/descriptor.pb.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "clients/cli/cli_channel.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/integration/server_process.h"
#include "tests/integration/tree_clients.h"

#ifndef DEFT_CLI_BINARY
#error "DEFT_CLI_BINARY must name the deft-cli binary"
#endif

namespace deft::testing {
namespace {

namespace v1 = deft::v1;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kKeyA[] = "alice-0123456789abcdef0123456789";
constexpr char kKeyB[] = "bob-fedcba9876543210fedcba98765";
constexpr char kKeyC[] = "carol-00112233445566778899aabbcc";

std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

// Certificates and a key file in a temp dir, made once for all tests.
class Certificates {
 public:
  Certificates() {
    dir_ = std::filesystem::temp_directory_path() / ("deft-security-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    // ca: trusted CA; server: localhost + 127.0.0.1 (SAN); client: signed by ca;
    // rogue_ca / rogue_client: a second CA the server does not trust.
    const std::string script = R"(set -e
cd ")" + dir_.string() + R"("
ossl() { openssl "$@" 2>>openssl.log; }
ossl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj "/CN=DeFT test CA"
ossl req -x509 -newkey rsa:2048 -nodes -keyout rogue_ca.key -out rogue_ca.pem -days 2 -subj "/CN=Rogue CA"
ossl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=localhost"
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > server.ext
ossl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext
ossl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj "/CN=deft client"
ossl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2
ossl req -newkey rsa:2048 -nodes -keyout rogue_client.key -out rogue_client.csr -subj "/CN=rogue client"
ossl x509 -req -in rogue_client.csr -CA rogue_ca.pem -CAkey rogue_ca.key -CAcreateserial -out rogue_client.pem -days 2
)";
    const ProgramResult made = run_program({"/bin/sh", "-c", script}, seconds(120));
    ok_ = made.exit_code == 0;
    EXPECT_TRUE(ok_) << made.output << read_text(dir_ / "openssl.log");
    write_text(keys(), std::string("# test keys\nalice:") + kKeyA + "\n\n" + kKeyB + "\n");
  }
  ~Certificates() { std::filesystem::remove_all(dir_); }

  bool ok() const { return ok_; }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path keys() const { return dir_ / "keys.txt"; }

 private:
  std::filesystem::path dir_;
  bool ok_ = false;
};

Certificates* certificates = nullptr;

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { certificates = new Certificates(); }
  static void TearDownTestSuite() {
    delete certificates;
    certificates = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(certificates->ok()); }

  static std::string file(const std::string& name) { return certificates->path(name); }

  static std::shared_ptr<grpc::ChannelCredentials> tls_trusting(const std::string& ca,
                                                                const std::string& client = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = read_text(file(ca));
    if (!client.empty()) {
      options.pem_cert_chain = read_text(file(client + ".pem"));
      options.pem_private_key = read_text(file(client + ".key"));
    }
    return grpc::SslCredentials(options);
  }

  // A stub on `server` as deft-cli would make it.
  static std::unique_ptr<v1::Deft::Stub> stub(const ServerProcess& server,
                                              cli::ChannelOptions options) {
    options.server = server.address();
    std::string error;
    std::shared_ptr<grpc::Channel> channel = cli::make_channel(options, &error);
    EXPECT_NE(channel, nullptr) << error;
    return v1::Deft::NewStub(channel);
  }
  static std::unique_ptr<v1::Deft::Stub> keyed(const ServerProcess& server, const char* key) {
    return stub(server, {.api_key = key});
  }

  static grpc::Status model_info(v1::Deft::Stub& stub) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(10));
    v1::ModelInfoResponse response;
    return stub.ModelInfo(&context, {}, &response);
  }

  // OK only when the server answers SERVING.
  static grpc::Status health(const std::shared_ptr<grpc::Channel>& channel) {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(10));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, {}, &response);
    if (status.ok() && response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "not SERVING");
    }
    return status;
  }

  static std::vector<std::string> auth_args() {
    return {"--api-keys", certificates->keys().string()};
  }
};

void expect_status(const grpc::Status& status, grpc::StatusCode code, const std::string& mention) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(mention), std::string::npos)
      << "'" << status.error_message() << "' does not mention '" << mention << "'";
}

size_t count(const std::string& text, const std::string& part) {
  size_t found = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++found;
  }
  return found;
}

// ---- TLS ---------------------------------------------------------------------------------

TEST_F(SecurityTest, TlsServesTlsClientsAndRefusesPlaintextAndUntrustingOnes) {
  ServerProcess server({"--tls-cert", file("server.pem"), "--tls-key", file("server.key")},
                       /*wait_serving=*/true, tls_trusting("ca.pem"));
  ASSERT_TRUE(server.running());
  EXPECT_TRUE(model_info(*server.stub()).ok());
  EXPECT_NE(server.log().find("TLS"), std::string::npos) << server.log();

  auto plaintext = stub(server, {});
  EXPECT_EQ(model_info(*plaintext).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA refuses the server's certificate.
  auto channel = grpc::CreateChannel(server.address(), tls_trusting("rogue_ca.pem"));
  EXPECT_EQ(model_info(*v1::Deft::NewStub(channel)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, MutualTlsAcceptsOnlyClientsWithACertificateOfTheTrustedCa) {
  ServerProcess server({"--tls-cert", file("server.pem"), "--tls-key", file("server.key"),
                        "--tls-client-ca", file("ca.pem")},
                       /*wait_serving=*/true, tls_trusting("ca.pem", "client"));
  ASSERT_TRUE(server.running());
  EXPECT_TRUE(model_info(*server.stub()).ok());
  EXPECT_NE(server.log().find("mutual TLS"), std::string::npos) << server.log();

  auto no_certificate = stub(server, {.tls = true, .tls_ca = file("ca.pem")});
  EXPECT_EQ(model_info(*no_certificate).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto rogue = stub(server, {.tls = true,
                             .tls_ca = file("ca.pem"),
                             .tls_cert = file("rogue_client.pem"),
                             .tls_key = file("rogue_client.key")});
  EXPECT_EQ(model_info(*rogue).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto good = stub(server, {.tls = true,
                            .tls_ca = file("ca.pem"),
                            .tls_cert = file("client.pem"),
                            .tls_key = file("client.key")});
  EXPECT_TRUE(model_info(*good).ok());

  // deft-cli with the client certificate, and without.
  const ProgramResult cli =
      run_program({DEFT_CLI_BINARY, "--server", server.address(), "--tls-ca", file("ca.pem"),
                   "--tls-cert", file("client.pem"), "--tls-key", file("client.key"), "health"});
  EXPECT_EQ(cli.exit_code, 0) << cli.output;
  EXPECT_NE(cli.output.find("SERVING"), std::string::npos) << cli.output;
  const ProgramResult refused = run_program(
      {DEFT_CLI_BINARY, "--server", server.address(), "--tls-ca", file("ca.pem"), "health"});
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, BadTlsAndKeyFilesFailTheStartNamingThem) {
  write_text(file("garbage.pem"), "not a certificate\n");
  write_text(file("short-keys.txt"), "tooshort\n");
  struct Case {
    std::vector<std::string> args;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {{"--tls-cert", file("missing.pem"), "--tls-key", file("server.key")}, "missing.pem"},
      {{"--tls-cert", file("server.pem"), "--tls-key", file("missing.key")}, "missing.key"},
      {{"--tls-cert", file("garbage.pem"), "--tls-key", file("server.key")}, "garbage.pem"},
      {{"--tls-cert", file("server.pem"), "--tls-key", file("garbage.pem")}, "garbage.pem"},
      {{"--tls-cert", file("server.pem"), "--tls-key", file("client.key")}, "does not belong"},
      {{"--tls-cert", file("server.pem")}, "--tls-key"},
      {{"--tls-client-ca", file("ca.pem")}, "--tls-client-ca"},
      {{"--tls-cert", file("server.pem"), "--tls-key", file("server.key"), "--tls-client-ca",
        file("garbage.pem")},
       "garbage.pem"},
      {{"--api-keys", file("missing-keys.txt")}, "missing-keys.txt"},
      {{"--api-keys", file("short-keys.txt")}, "short-keys.txt line 1"},
      {{"--max-concurrent-per-key", "2"}, "max_concurrent_per_key"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {DEFT_SERVER_BINARY, "--listen", "127.0.0.1:0",
                                     "--metrics-listen", ""};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const ProgramResult result = run_program(argv);
    SCOPED_TRACE(c.mention);
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_NE(result.output.find(c.mention), std::string::npos) << result.output;
    EXPECT_EQ(result.output.find("loaded in"), std::string::npos) << result.output;
  }
}

// ---- API keys ----------------------------------------------------------------------------

TEST_F(SecurityTest, ApiKeysAreRequiredAndHealthStaysOpen) {
  ServerProcess server(auth_args());
  ASSERT_TRUE(server.running());
  expect_status(model_info(*server.stub()), grpc::StatusCode::UNAUTHENTICATED, "API key");
  expect_status(model_info(*keyed(server, "wrong-key-0123456789abcdef")),
                grpc::StatusCode::UNAUTHENTICATED, "not valid");
  EXPECT_TRUE(model_info(*keyed(server, kKeyA)).ok());
  EXPECT_TRUE(model_info(*keyed(server, kKeyB)).ok());
  // Streams too: Generate and TreeSession.
  const GenerateRun generated = run_generate(*server.stub(), greedy_request({1, 5, 6}, 4));
  expect_status(generated.status, grpc::StatusCode::UNAUTHENTICATED, "API key");
  {
    grpc::ClientContext context;
    auto stream = server.stub()->TreeSession(&context);
    stream->WritesDone();
    v1::SessionResponse response;
    EXPECT_FALSE(stream->Read(&response)) << response.DebugString();
    expect_status(stream->Finish(), grpc::StatusCode::UNAUTHENTICATED, "API key");
  }
  EXPECT_TRUE(run_generate(*keyed(server, kKeyA), greedy_request({1, 5, 6}, 4)).status.ok());
  EXPECT_TRUE(health(server.channel()).ok());  // open for probes

  // Refusals are logged once a minute per peer, with the key id never the key.
  const std::string log = server.log();
  EXPECT_EQ(count(log, "auth: refused a call from ipv4:127.0.0.1"), 1u) << log;
  EXPECT_EQ(log.find(kKeyA), std::string::npos) << log;
  // Per-key metrics.
  const std::string metrics = http_get(server.metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("key=\"alice\""), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("deft_key_generated_tokens_total{key=\"alice\"} 4"), std::string::npos)
      << metrics;
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, AuthHealthRequiresAKeyForTheHealthServiceToo) {
  ServerProcess server({"--api-keys", certificates->keys().string(), "--auth-health", "true"},
                       /*wait_serving=*/false);
  ASSERT_TRUE(server.running());
  std::string error;
  std::shared_ptr<grpc::Channel> keyed_channel =
      cli::make_channel({.server = server.address(), .api_key = kKeyA}, &error);
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  while (!health(keyed_channel).ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(health(keyed_channel).ok());
  expect_status(health(server.channel()), grpc::StatusCode::UNAUTHENTICATED, "API key");
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// list_services, then the file declaring deft.v1.Deft, on one reflection stream of `channel`;
// the stream's status (OK: both answered).
grpc::Status reflect(const std::shared_ptr<grpc::Channel>& channel,
                     std::vector<std::string>* services, std::string* file) {
  namespace reflection = grpc::reflection::v1alpha;
  auto stub = reflection::ServerReflection::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(10));
  auto stream = stub->ServerReflectionInfo(&context);
  reflection::ServerReflectionRequest list;
  list.set_list_services("");
  reflection::ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol("deft.v1.Deft");
  stream->Write(list);
  stream->Write(symbol);
  stream->WritesDone();
  reflection::ServerReflectionResponse response;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) {
      services->push_back(service.name());
    }
    if (response.file_descriptor_response().file_descriptor_proto_size() > 0) {
      google::protobuf::FileDescriptorProto proto;
      proto.ParseFromString(response.file_descriptor_response().file_descriptor_proto(0));
      *file = proto.name();
    }
  }
  return stream->Finish();
}

TEST_F(SecurityTest, ReflectionIsOpenByDefaultAndAuthReflectionRequiresAKey) {
  {
    ServerProcess server(auth_args());
    ASSERT_TRUE(server.running());
    std::vector<std::string> services;
    std::string file;
    EXPECT_TRUE(reflect(server.channel(), &services, &file).ok());
    EXPECT_EQ(services, (std::vector<std::string>{"deft.v1.Deft", "grpc.health.v1.Health",
                                                  "grpc.reflection.v1alpha.ServerReflection"}));
    EXPECT_EQ(file, "deft/v1/deft.proto");
    EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  }
  std::vector<std::string> args = auth_args();
  args.insert(args.end(), {"--auth-reflection", "true"});
  ServerProcess server(args);
  ASSERT_TRUE(server.running());
  std::vector<std::string> services;
  std::string file;
  expect_status(reflect(server.channel(), &services, &file), grpc::StatusCode::UNAUTHENTICATED,
                "API key");
  EXPECT_TRUE(services.empty());
  std::string error;
  const std::shared_ptr<grpc::Channel> keyed_channel =
      cli::make_channel({.server = server.address(), .api_key = kKeyA}, &error);
  EXPECT_TRUE(reflect(keyed_channel, &services, &file).ok());
  EXPECT_EQ(services.size(), 3u);
  EXPECT_EQ(file, "deft/v1/deft.proto");
  EXPECT_TRUE(health(server.channel()).ok());  // health stays open
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, SighupReloadsTheKeysAndABadFileKeepsThem) {
  const std::filesystem::path keys = file("reload-keys.txt");
  write_text(keys, std::string(kKeyA) + "\n");
  ServerProcess server({"--api-keys", keys.string()});
  ASSERT_TRUE(server.running());
  EXPECT_TRUE(model_info(*keyed(server, kKeyA)).ok());
  EXPECT_EQ(model_info(*keyed(server, kKeyC)).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Swap A for C.
  write_text(keys, std::string("carol:") + kKeyC + "\n");
  server.signal(SIGHUP);
  const auto deadline = std::chrono::steady_clock::now() + seconds(10);
  while (!model_info(*keyed(server, kKeyC)).ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(model_info(*keyed(server, kKeyC)).ok()) << server.log();
  EXPECT_EQ(model_info(*keyed(server, kKeyA)).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // A broken file is refused; the keys in use stay.
  write_text(keys, "short\n");
  server.signal(SIGHUP);
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_TRUE(model_info(*keyed(server, kKeyC)).ok());
  EXPECT_NE(server.log().find("the keys in use stay"), std::string::npos) << server.log();
  EXPECT_TRUE(server.serving());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// ---- Sessions belong to their key --------------------------------------------------------

TEST_F(SecurityTest, AnotherKeysSessionIsNotFound) {
  ServerProcess server(auth_args());
  ASSERT_TRUE(server.running());
  auto alice = keyed(server, kKeyA);
  auto bob = keyed(server, kKeyB);
  TestSession session(*alice);
  const v1::SessionResponse created = session.create({1, 5, 6, 7});
  ASSERT_FALSE(created.has_error()) << created.DebugString();
  const int64_t root = created.created_node();
  const uint64_t id = session.session_id();

  const auto verify = [&](v1::Deft::Stub& stub, uint64_t session_id) {
    v1::VerifyRequest request;
    request.set_session_id(session_id);
    request.set_node(root);
    request.add_tokens(5);
    request.add_parents(-1);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(30));
    v1::VerifyResponse response;
    return stub.Verify(&context, request, &response);
  };
  // Bob gets the very answer of an unknown id.
  const grpc::Status foreign = verify(*bob, id);
  const grpc::Status unknown = verify(*bob, id + 1000);
  expect_status(foreign, grpc::StatusCode::NOT_FOUND, "no open session " + std::to_string(id));
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(foreign.error_message(), "no open session " + std::to_string(id));
  EXPECT_TRUE(verify(*alice, id).ok());
  // Bob's own session cannot reach Alice's nodes.
  TestSession bobs(*bob);
  const v1::SessionResponse extended = bobs.extend(root, {9});
  EXPECT_EQ(error_code(extended), static_cast<int>(grpc::StatusCode::NOT_FOUND))
      << extended.DebugString();
  EXPECT_TRUE(bobs.finish().ok());
  EXPECT_TRUE(session.finish().ok());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// ---- Per-key limits ----------------------------------------------------------------------

TEST_F(SecurityTest, ConcurrentStreamsPerKeyAreLimited) {
  std::vector<std::string> args = auth_args();
  args.insert(args.end(), {"--max-concurrent-per-key", "1"});
  ServerProcess server(args);
  ASSERT_TRUE(server.running());
  auto alice = keyed(server, kKeyA);
  {
    TestSession session(*alice);
    ASSERT_FALSE(session.create({1, 5}).has_error());
    const GenerateRun second = run_generate(*alice, greedy_request({1, 5, 6}, 4));
    expect_status(second.status, grpc::StatusCode::RESOURCE_EXHAUSTED,
                  "the limit is 1 (max_concurrent_per_key)");
    // Another key is not limited by Alice's use.
    EXPECT_TRUE(run_generate(*keyed(server, kKeyB), greedy_request({1, 5, 6}, 4)).status.ok());
    EXPECT_TRUE(session.finish().ok());
  }
  EXPECT_TRUE(run_generate(*alice, greedy_request({1, 5, 6}, 4)).status.ok());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, TokensPerMinutePerKeyAreLimited) {
  std::vector<std::string> args = auth_args();
  args.insert(args.end(), {"--max-tokens-per-minute-per-key", "10"});
  ServerProcess server(args);
  ASSERT_TRUE(server.running());
  auto alice = keyed(server, kKeyA);
  EXPECT_TRUE(run_generate(*alice, greedy_request({1, 5, 6}, 12)).status.ok());
  expect_status(run_generate(*alice, greedy_request({1, 5, 6}, 4)).status,
                grpc::StatusCode::RESOURCE_EXHAUSTED,
                "generated 12 tokens in the last minute; the limit is 10 "
                "(max_tokens_per_minute_per_key)");
  // A session's decode is refused in its turn; the session goes on.
  TestSession session(*alice);
  const v1::SessionResponse created = session.create({1, 5});
  ASSERT_FALSE(created.has_error());
  const TestSession::Decoded decoded = session.decode_greedy({created.created_node()}, 2);
  ASSERT_TRUE(decoded.error.has_value());
  EXPECT_EQ(decoded.error->code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(decoded.error->message().find("max_tokens_per_minute_per_key"), std::string::npos);
  EXPECT_TRUE(session.finish().ok());
  EXPECT_TRUE(run_generate(*keyed(server, kKeyB), greedy_request({1, 5, 6}, 4)).status.ok());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST_F(SecurityTest, QueuedJobsPerKeyAreLimited) {
  // 256 pages: a job of 3900 tokens leaves no room for a second, which waits (worst-case
  // admission reserves the first job's 3900 tokens).
  std::vector<std::string> args = auth_args();
  args.insert(args.end(), {"--kv-pages", "256", "--max-queued-jobs-per-key", "1", "--kv-admission",
                           "worst_case"});
  ServerProcess server(args);
  ASSERT_TRUE(server.running());
  auto alice = keyed(server, kKeyA);
  grpc::ClientContext big_context;
  auto big = alice->Generate(&big_context, greedy_request({1, 3, 4}, 3900));
  v1::GenerateResponse response;
  ASSERT_TRUE(big->Read(&response));  // admitted: no longer waiting
  GenerateRun waiting;
  std::thread waiter([&] {
    auto own = keyed(server, kKeyA);
    waiting = run_generate(*own, greedy_request({1, 5}, 200));
  });
  EXPECT_EQ(server.wait_metric("deft_queue_depth", 1), 1);
  expect_status(run_generate(*alice, greedy_request({1, 6}, 8)).status,
                grpc::StatusCode::RESOURCE_EXHAUSTED, "the limit is 1 (max_queued_jobs_per_key)");
  big_context.TryCancel();
  while (big->Read(&response)) {
  }
  waiter.join();
  EXPECT_TRUE(waiting.status.ok()) << waiting.status.error_message();
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// ---- deft-cli over TLS with a key --------------------------------------------------------

TEST_F(SecurityTest, DeftCliWithTlsAndAnApiKey) {
  std::vector<std::string> args = {"--tls-cert", file("server.pem"), "--tls-key",
                                   file("server.key")};
  const std::vector<std::string> auth = auth_args();
  args.insert(args.end(), auth.begin(), auth.end());
  ServerProcess server(args, /*wait_serving=*/true, tls_trusting("ca.pem"));
  ASSERT_TRUE(server.running());
  const std::string address = server.address();
  const ProgramResult generated =
      run_program({DEFT_CLI_BINARY, "--server", address, "--tls-ca", file("ca.pem"), "--api-key",
                   kKeyA, "generate", "--n", "2", "--max-tokens", "4", "Once"});
  EXPECT_EQ(generated.exit_code, 0) << generated.output;
  EXPECT_NE(generated.output.find("[branch 1, "), std::string::npos) << generated.output;
  // The key from DEFT_API_KEY.
  const ProgramResult from_env =
      run_program({"/bin/sh", "-c",
                   "DEFT_API_KEY='" + std::string(kKeyB) + "' '" DEFT_CLI_BINARY "' --server " +
                       address + " --tls-ca '" + file("ca.pem") + "' info"});
  EXPECT_EQ(from_env.exit_code, 0) << from_env.output;
  EXPECT_NE(from_env.output.find("vocab_size: 512"), std::string::npos) << from_env.output;
  const ProgramResult no_key =
      run_program({DEFT_CLI_BINARY, "--server", address, "--tls-ca", file("ca.pem"), "info"});
  EXPECT_EQ(no_key.exit_code, 1) << no_key.output;
  EXPECT_NE(no_key.output.find("UNAUTHENTICATED"), std::string::npos) << no_key.output;
  const ProgramResult session = run_program(
      {"/bin/sh", "-c",
       "printf 'create Once upon a time\\nbranch $0 2\\ndecode $1,$2 4\\nclose\\n' | "
       "'" DEFT_CLI_BINARY "' --server " +
           address + " --tls-ca '" + file("ca.pem") + "' --api-key " + kKeyA + " session"});
  EXPECT_EQ(session.exit_code, 0) << session.output;
  const ProgramResult missing_ca =
      run_program({DEFT_CLI_BINARY, "--server", address, "--tls-ca", file("nowhere.pem"), "info"});
  EXPECT_EQ(missing_ca.exit_code, 2) << missing_ca.output;
  EXPECT_NE(missing_ca.output.find("nowhere.pem"), std::string::npos) << missing_ca.output;
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

}  // namespace
}  // namespace deft::testing
