// The server's log as a collector reads it (--log-format json): every line is one JSON object; a
// request's line carries its id (the client's x-request-id, echoed back as initial metadata),
// the peer, the key id (never the key), the RPC, the status and the duration; refused calls are
// logged once a minute per peer, not one line per call.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "nlohmann/json.hpp"
#include "tests/integration/server_process.h"
#include "tests/integration/tree_clients.h"

namespace deft::testing {
namespace {

namespace v1 = deft::v1;
using std::chrono::seconds;

constexpr char kKey[] = "0123456789abcdef-log-test-key";

grpc::Status model_info(v1::Deft::Stub& stub, const std::string& key) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(10));
  if (!key.empty()) context.AddMetadata("authorization", "Bearer " + key);
  v1::ModelInfoResponse response;
  return stub.ModelInfo(&context, {}, &response);
}

TEST(StructuredLog, JsonLinesCarryRequestFieldsAndRefusalsAreLoggedOncePerPeer) {
  const std::filesystem::path keys = std::filesystem::temp_directory_path() /
                                     ("deft-log-keys-" + std::to_string(getpid()) + ".txt");
  std::ofstream(keys) << "alice:" << kKey << "\n";
  ServerProcess server({"--log-format", "json", "--api-keys", keys.string()});
  ASSERT_TRUE(server.running());
  auto stub = server.stub();

  // A Generate with the client's request id, and a refused request (INVALID_ARGUMENT).
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kKey);
    context.AddMetadata("x-request-id", "trace-0042");
    auto reader = stub->Generate(&context, greedy_request({1, 5, 6}, 4));
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    EXPECT_TRUE(reader->Finish().ok());
    const auto echoed = context.GetServerInitialMetadata().find("x-request-id");
    ASSERT_NE(echoed, context.GetServerInitialMetadata().end());
    EXPECT_EQ(std::string(echoed->second.data(), echoed->second.size()), "trace-0042");
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kKey);
    v1::DetokenizeRequest request;
    request.add_ids(100000);
    v1::DetokenizeResponse response;
    EXPECT_EQ(stub->Detokenize(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Five refused calls from one address: one log line.
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(model_info(*stub, i % 2 == 0 ? "" : "not-a-key-0123456789abcdef").error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  std::filesystem::remove(keys);

  const std::string log = server.log();
  EXPECT_EQ(log.find(kKey), std::string::npos) << log;
  std::istringstream lines(log);
  int refusal_lines = 0;
  bool generate_seen = false;
  bool detokenize_seen = false;
  for (std::string line; std::getline(lines, line);) {
    nlohmann::json entry;
    ASSERT_NO_THROW(entry = nlohmann::json::parse(line)) << line;
    ASSERT_TRUE(entry.contains("time") && entry.contains("level") && entry.contains("msg")) << line;
    const std::string message = entry["msg"];
    if (message.rfind("auth: refused", 0) == 0) {
      ++refusal_lines;
      EXPECT_EQ(entry["peer"], "ipv4:127.0.0.1") << line;
      EXPECT_EQ(entry["level"], "warning") << line;
      EXPECT_TRUE(entry.contains("reason")) << line;
    }
    if (message != "request") continue;
    EXPECT_NE(entry["status"], "UNAUTHENTICATED") << "refusals are not request lines: " << line;
    EXPECT_EQ(std::string(entry["peer"]).rfind("ipv4:127.0.0.1:", 0), 0u) << line;
    EXPECT_GE(entry["ms"].get<double>(), 0.0) << line;
    if (entry["rpc"] == "Generate") {
      generate_seen = true;
      EXPECT_EQ(entry["status"], "OK") << line;
      EXPECT_EQ(entry["id"], "trace-0042") << line;
      EXPECT_EQ(entry["key"], "alice") << line;
    }
    if (entry["rpc"] == "Detokenize") {
      detokenize_seen = true;
      EXPECT_EQ(entry["status"], "INVALID_ARGUMENT") << line;
      EXPECT_NE(std::string(entry["error"]).find("100000"), std::string::npos) << line;
      EXPECT_FALSE(std::string(entry["id"]).empty()) << line;  // made by the server
    }
  }
  EXPECT_TRUE(generate_seen) << log;
  EXPECT_TRUE(detokenize_seen) << log;
  EXPECT_EQ(refusal_lines, 1) << log;
}

}  // namespace
}  // namespace deft::testing
