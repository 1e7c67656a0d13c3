// Server-side speculative decoding through the real deft-server (CPU backend) and the real gRPC
// client: the embedded default model with its trained draft (models/default-draft). Speculative
// Generates of every policy give exactly the tokens of the same requests without speculation,
// concurrently, greedy and sampled; the last message of a branch says what it accepted; bad
// options get INVALID_ARGUMENT or FAILED_PRECONDITION and change nothing; a cancelled
// speculative stream frees its KV; /metrics counts drafted and accepted tokens.
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <map>

#include "tests/integration/server_process.h"

namespace deft::testing {
namespace {

namespace v1 = deft::v1;
using std::chrono::seconds;

struct SpecBranch {
  std::vector<int32_t> ids;
  v1::SpeculativeStats stats;
  bool finished = false;
};

struct SpecResult {
  grpc::Status status;
  std::map<int32_t, SpecBranch> branches;
};

SpecResult generate(v1::Deft::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  auto reader = stub.Generate(&context, request);
  SpecResult result;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    SpecBranch& branch = result.branches[response.branch()];
    branch.ids.insert(branch.ids.end(), response.delta().ids().begin(),
                      response.delta().ids().end());
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      branch.finished = true;
      branch.stats = response.speculative();
    }
  }
  result.status = reader->Finish();
  return result;
}

v1::GenerateRequest request(const std::string& text, int n, int max_tokens, float temperature,
                            uint64_t seed, v1::SpeculativeOptions::Policy policy) {
  v1::GenerateRequest out;
  out.mutable_prompt()->set_text(text);
  out.set_n(n);
  out.mutable_sampling()->set_max_tokens(max_tokens);
  out.mutable_sampling()->set_temperature(temperature);
  out.mutable_sampling()->set_seed(seed);
  out.mutable_speculative()->set_policy(policy);
  return out;
}

class SpeculativeServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(
        {"--draft-model", DEFT_SOURCE_DIR "/models/default-draft", "--kv-pages", "1024"});
  }
  static void TearDownTestSuite() {
    if (server_->running()) {
      EXPECT_TRUE(server_->serving()) << server_->log();
      EXPECT_EQ(server_->stop(SIGTERM), 0) << server_->log();
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(server_->running()) << server_->log(); }
  void TearDown() override {
    EXPECT_EQ(server_->wait_metric("deft_live_jobs", 0), 0);
    EXPECT_EQ(server_->wait_metric("deft_kv_pages_used", 0), 0);
  }
  static ServerProcess* server_;
};

ServerProcess* SpeculativeServer::server_ = nullptr;

TEST_F(SpeculativeServer, ModelInfoNamesTheDraftModel) {
  std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  ASSERT_TRUE(stub->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.draft_model(), "default-draft");
  EXPECT_EQ(info.max_speculative_tokens(), 128);
  EXPECT_EQ(info.max_verify_entries(), 256);
  EXPECT_EQ(info.max_verify_distribution_tokens(), 16384);
}

TEST_F(SpeculativeServer, ConcurrentSpeculativeJobsGiveThePlainTokens) {
  const std::vector<std::string> texts = {
      "Once upon a time",  "The little fox",
      "The king said",     "In the forest there was a",
      "Every morning the", "def main():\n    print(\"hello\")\n    print("};
  const v1::SpeculativeOptions::Policy policies[] = {v1::SpeculativeOptions::POLICY_STATIC_TREE,
                                                     v1::SpeculativeOptions::POLICY_DYNAMIC_TREE,
                                                     v1::SpeculativeOptions::POLICY_NGRAM};
  std::vector<v1::GenerateRequest> requests;
  for (size_t i = 0; i < 12; ++i) {
    requests.push_back(request(texts[i % texts.size()], 1 + static_cast<int>(i % 3), 48,
                               i % 2 == 0 ? 0.0f : 0.8f, 100 + i, policies[i % 3]));
  }
  std::vector<std::future<SpecResult>> speculative;
  for (const v1::GenerateRequest& r : requests) {
    speculative.push_back(std::async(std::launch::async, [&, r] {
      std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
      return generate(*stub, r);
    }));
  }
  std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
  int64_t accepted = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(i);
    const SpecResult got = speculative[i].get();
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    v1::GenerateRequest plain_request = requests[i];
    plain_request.clear_speculative();
    const SpecResult want = generate(*stub, plain_request);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    ASSERT_EQ(got.branches.size(), want.branches.size());
    for (const auto& [index, branch] : want.branches) {
      EXPECT_EQ(got.branches.at(index).ids, branch.ids) << "branch " << index;
      EXPECT_TRUE(got.branches.at(index).finished);
      EXPECT_EQ(branch.stats.steps(), 0);  // no speculation, no stats
      const v1::SpeculativeStats& stats = got.branches.at(index).stats;
      EXPECT_LE(stats.accepted(), stats.drafted());
      accepted += stats.accepted();
    }
  }
  // The trained draft agrees with the model on nearly every token of its corpus.
  EXPECT_GT(accepted, 100);
  EXPECT_GT(server_->wait_metric("deft_speculative_accepted_tokens_total", accepted), 0);
  const std::map<std::string, double> metrics = server_->metrics();
  EXPECT_GE(metrics.at("deft_speculative_drafted_tokens_total"),
            metrics.at("deft_speculative_accepted_tokens_total"));
  EXPECT_GT(metrics.at("deft_draft_rows_total"), 0);
}

TEST_F(SpeculativeServer, BadOptionsAreRefusedByName) {
  std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
  const auto expect = [&](const v1::GenerateRequest& r, grpc::StatusCode code,
                          const std::string& mention) {
    const SpecResult result = generate(*stub, r);
    EXPECT_EQ(result.status.error_code(), code) << result.status.error_message();
    EXPECT_NE(result.status.error_message().find(mention), std::string::npos)
        << result.status.error_message();
  };
  v1::GenerateRequest r =
      request("Once", 1, 8, 0.0f, 0, v1::SpeculativeOptions::POLICY_STATIC_TREE);
  r.mutable_speculative()->set_tree_tokens(129);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "max_speculative_tokens");
  r.mutable_speculative()->set_tree_tokens(-1);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "speculative.tree_tokens");
  r.mutable_speculative()->set_tree_tokens(0);
  r.mutable_speculative()->set_depth(33);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "speculative.depth");
  r.mutable_speculative()->set_depth(0);
  r.mutable_speculative()->set_top_k(21);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "speculative.top_k");
  r.mutable_speculative()->set_top_k(0);
  r.mutable_speculative()->set_policy(static_cast<v1::SpeculativeOptions::Policy>(9));
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "speculative.policy");
}

// The prompt counter counts the prompt once: a speculative branch feeds its accepted tokens
// again as the next step's rows, which are neither prompt tokens nor newly generated ones.
TEST_F(SpeculativeServer, PromptTokensCountOnlyThePrompt) {
  std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
  v1::GenerateRequest plain;
  // A prompt no other test sends (so the prefix cache holds none of it).
  for (int32_t id = 300; id < 340; ++id) plain.mutable_prompt()->mutable_tokens()->add_ids(id);
  plain.mutable_sampling()->set_max_tokens(64);
  plain.mutable_sampling()->set_temperature(0.0f);
  plain.mutable_sampling()->set_ignore_eos(true);
  v1::GenerateRequest speculative = plain;
  speculative.mutable_prompt()->mutable_tokens()->set_ids(0, 299);
  speculative.mutable_speculative()->set_policy(v1::SpeculativeOptions::POLICY_STATIC_TREE);
  for (const v1::GenerateRequest* request : {&plain, &speculative}) {
    const std::map<std::string, double> before = server_->metrics();
    const SpecResult result = generate(*stub, *request);
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    ASSERT_EQ(result.branches.at(0).ids.size(), 64u);
    // The step's counters are recorded after its tokens reach the client, so wait for them.
    const double generated = before.at("deft_generated_tokens_total") + 64;
    EXPECT_EQ(server_->wait_metric("deft_generated_tokens_total", generated), generated);
    const double prompt = before.at("deft_prompt_tokens_total") + 40;
    EXPECT_EQ(server_->wait_metric("deft_prompt_tokens_total", prompt), prompt);
  }
}

TEST_F(SpeculativeServer, CancellingASpeculativeStreamFreesItsKv) {
  std::unique_ptr<v1::Deft::Stub> stub = server_->stub();
  v1::GenerateRequest r =
      request("Once upon a time", 3, 2000, 0.0f, 0, v1::SpeculativeOptions::POLICY_DYNAMIC_TREE);
  r.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, r);
  v1::GenerateResponse response;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // TearDown checks the KV is back to 0.
}

TEST(SpeculativeServerWithoutDraft, DraftPoliciesNeedADraftModelNgramDoesNot) {
  ServerProcess server;
  std::unique_ptr<v1::Deft::Stub> stub = server.stub();
  SpecResult result =
      generate(*stub, request("Once", 1, 8, 0.0f, 0, v1::SpeculativeOptions::POLICY_STATIC_TREE));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(result.status.error_message().find("--draft-model"), std::string::npos);
  result = generate(
      *stub, request("Once upon a time", 1, 24, 0.0f, 0, v1::SpeculativeOptions::POLICY_NGRAM));
  EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  ASSERT_TRUE(stub->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.draft_model(), "");
  EXPECT_EQ(server.stop(SIGTERM), 0);
}

TEST(SpeculativeServerStartup, ABadTreeFileFailsTheStartNamingThePath) {
  const std::string tree = ::testing::TempDir() + "/bad_tree.json";
  {
    std::ofstream out(tree);
    out << "[[0], [1, 0]]";
  }
  const ProgramResult result = run_program({DEFT_SERVER_BINARY, "--listen", "127.0.0.1:0",
                                            "--metrics-listen", "", "--speculative-tree", tree});
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("prefix [1]"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace deft::testing
