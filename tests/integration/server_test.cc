// Integration tests: the real deft-server binary (embedded default model, CPU backend) on a
// loopback port, driven through the real gRPC C++ client. Every bad input must get its precise
// status code and leave the server up; cancelled and abandoned streams must return the KV
// cache to its baseline; SIGTERM must end the server with exit code 0.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tests/integration/server_process.h"

#ifndef DEFT_CLI_BINARY
#error "DEFT_CLI_BINARY must name the deft-cli binary"
#endif

namespace deft::testing {
namespace {

namespace v1 = deft::v1;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Limits of the shared server, small so the limit tests are cheap.
constexpr int kKvPages = 1024;
constexpr int kMaxPromptTokens = 256;
constexpr int kMaxTextBytes = 4096;
const std::vector<std::string> kServerArgs = {"--kv-pages",
                                              std::to_string(kKvPages),
                                              "--max-prompt-tokens",
                                              std::to_string(kMaxPromptTokens),
                                              "--max-text-bytes",
                                              std::to_string(kMaxTextBytes),
                                              "--max-tree-tokens",
                                              "32768",
                                              "--shutdown-grace-seconds",
                                              "5"};

struct Branch {
  std::vector<int32_t> ids;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  int messages_after_finish = 0;
};

struct GenerateResult {
  grpc::Status status;
  std::map<int32_t, Branch> branches;
  int32_t prompt_tokens = -1;
};

GenerateResult generate(v1::Deft::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  auto reader = stub.Generate(&context, request);
  GenerateResult result;
  v1::GenerateResponse response;
  bool first = true;
  while (reader->Read(&response)) {
    if (first) result.prompt_tokens = response.prompt_tokens();
    first = false;
    Branch& branch = result.branches[response.branch()];
    if (branch.finish != v1::FINISH_REASON_UNSPECIFIED) ++branch.messages_after_finish;
    branch.ids.insert(branch.ids.end(), response.delta().ids().begin(),
                      response.delta().ids().end());
    branch.text += response.delta().text();
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      branch.finish = response.finish_reason();
    }
  }
  result.status = reader->Finish();
  return result;
}

v1::GenerateRequest token_request(std::vector<int32_t> prompt, int n, int max_tokens) {
  v1::GenerateRequest request;
  // The default model is trained and often ends early; long jobs must not.
  request.mutable_sampling()->set_ignore_eos(max_tokens >= 200);
  request.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(), prompt.end());
  request.set_n(n);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  return request;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new ServerProcess(kServerArgs); }

  static void TearDownTestSuite() {
    if (server_->running()) {
      // Whatever the tests did, the server is still up and serving, and stops cleanly.
      EXPECT_TRUE(server_->serving()) << server_->log();
      EXPECT_EQ(server_->stop(SIGTERM), 0) << server_->log();
    }
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override { ASSERT_TRUE(server_->running()); }

  void TearDown() override {
    // Every test leaves the engine idle and no KV referenced (finished requests' KV may stay as
    // cached prefixes: deft_kv_pages_cached).
    EXPECT_EQ(server_->wait_metric("deft_live_jobs", 0), 0);
    EXPECT_EQ(server_->wait_metric("deft_kv_pages_used", 0), 0);
    EXPECT_TRUE(server_->serving());
  }

  static ServerProcess* server_;
};

ServerProcess* ServerTest::server_ = nullptr;

void expect_status(const grpc::Status& status, grpc::StatusCode code, const std::string& mention) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(mention), std::string::npos)
      << "message '" << status.error_message() << "' does not mention '" << mention << "'";
}

// ---- Health, model, tokenizer -------------------------------------------------------------

TEST_F(ServerTest, HealthServingForServerAndService) {
  EXPECT_TRUE(server_->serving(""));
  EXPECT_TRUE(server_->serving("deft.v1.Deft"));
  auto health = grpc::health::v1::Health::NewStub(server_->channel());
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("no.such.Service");
  grpc::health::v1::HealthCheckResponse response;
  EXPECT_EQ(health->Check(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, ModelInfoDescribesTheEmbeddedModel) {
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  ASSERT_TRUE(server_->stub()->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.num_layers(), 4);
  EXPECT_EQ(info.hidden_size(), 128);
  EXPECT_EQ(info.num_q_heads(), 4);
  EXPECT_EQ(info.num_kv_heads(), 2);
  EXPECT_EQ(info.max_context(), 4096);
  // backend auto: the CUDA runner on a machine with a GPU (and a CUDA build), else the CPU one.
  EXPECT_TRUE(info.backend() == "cpu" || info.backend() == "cuda") << info.backend();
  EXPECT_EQ(info.attention(), "deft_flatten");
  EXPECT_EQ(info.kv_capacity_tokens(), int64_t{kKvPages} * 16);
  EXPECT_EQ(info.bos_token_id(), 1);
  ASSERT_EQ(info.eos_token_ids_size(), 1);
  EXPECT_EQ(info.eos_token_ids(0), 2);
  EXPECT_EQ(info.max_prompt_tokens(), kMaxPromptTokens);
}

TEST_F(ServerTest, TokenizeDetokenizeRoundTrip) {
  auto stub = server_->stub();
  const std::string text = "Once upon a time there was a tree.";
  v1::TokenizeRequest request;
  request.set_text(text);
  v1::TokenizeResponse plain, with_bos;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Tokenize(&context, request, &plain).ok());
  }
  request.set_add_bos(true);
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Tokenize(&context, request, &with_bos).ok());
  }
  ASSERT_GT(plain.ids_size(), 0);
  ASSERT_EQ(with_bos.ids_size(), plain.ids_size() + 1);
  EXPECT_EQ(with_bos.ids(0), 1);
  v1::DetokenizeRequest back;
  back.mutable_ids()->CopyFrom(plain.ids());
  v1::DetokenizeResponse decoded;
  grpc::ClientContext context;
  ASSERT_TRUE(stub->Detokenize(&context, back, &decoded).ok());
  EXPECT_EQ(decoded.text(), text);
}

TEST_F(ServerTest, TokenizeBadInputs) {
  auto stub = server_->stub();
  v1::TokenizeRequest request;
  request.set_text(std::string(kMaxTextBytes + 1, 'a'));
  v1::TokenizeResponse response;
  grpc::ClientContext context;
  expect_status(stub->Tokenize(&context, request, &response), grpc::StatusCode::INVALID_ARGUMENT,
                std::to_string(kMaxTextBytes + 1));
  // Exactly at the limit is fine.
  request.set_text(std::string(kMaxTextBytes, 'a'));
  grpc::ClientContext at_limit;
  EXPECT_TRUE(stub->Tokenize(&at_limit, request, &response).ok());
}

TEST_F(ServerTest, MalformedMessagesAreRefusedByTheFramework) {
  // A proto3 string that is not UTF-8 fails to parse on the server; gRPC answers INTERNAL
  // before any handler runs.
  auto stub = server_->stub();
  v1::TokenizeRequest request;
  request.set_text("ab\xff\xfe");
  v1::TokenizeResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub->Tokenize(&context, request, &response).error_code(), grpc::StatusCode::INTERNAL);
  v1::GenerateRequest generate_request;
  generate_request.mutable_prompt()->set_text("\xc3");
  EXPECT_EQ(generate(*stub, generate_request).status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_TRUE(server_->serving());
}

TEST_F(ServerTest, MessagesOverTheSizeLimitAreRefusedBeforeParsing) {
  // The limit follows the server's limits (server_config.h, max_request_bytes): here about
  // 1.2 MB. gRPC answers RESOURCE_EXHAUSTED without parsing the message; the server goes on.
  auto stub = server_->stub();
  v1::GenerateRequest request;
  request.mutable_prompt()->set_text(std::string(3 << 20, 'a'));
  EXPECT_EQ(generate(*stub, request).status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  v1::TokenizeRequest small;
  small.set_text("still serving");
  v1::TokenizeResponse response;
  grpc::ClientContext context;
  EXPECT_TRUE(stub->Tokenize(&context, small, &response).ok());
  EXPECT_TRUE(server_->serving());
}

TEST_F(ServerTest, DetokenizeRejectsIdsOutsideTheVocabulary) {
  auto stub = server_->stub();
  for (const int32_t bad : {512, -1, 1 << 30}) {
    v1::DetokenizeRequest request;
    request.add_ids(5);
    request.add_ids(bad);
    v1::DetokenizeResponse response;
    grpc::ClientContext context;
    expect_status(stub->Detokenize(&context, request, &response),
                  grpc::StatusCode::INVALID_ARGUMENT, "ids[1] = " + std::to_string(bad));
  }
}

// ---- Generate -----------------------------------------------------------------------------

TEST_F(ServerTest, GenerateStreamsEveryBranchToItsEnd) {
  auto stub = server_->stub();
  v1::GenerateRequest request;
  request.mutable_prompt()->set_text("Once upon a time");
  request.set_n(4);
  request.mutable_sampling()->set_max_tokens(12);
  request.mutable_sampling()->set_top_logprobs(3);
  const GenerateResult result = generate(*stub, request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_GT(result.prompt_tokens, 1);
  ASSERT_EQ(result.branches.size(), 4u);
  for (const auto& [index, branch] : result.branches) {
    SCOPED_TRACE(index);
    EXPECT_NE(branch.finish, v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_EQ(branch.messages_after_finish, 0);
    if (branch.finish == v1::FINISH_REASON_LENGTH) {
      EXPECT_EQ(branch.ids.size(), 12u);
    }
    if (branch.finish == v1::FINISH_REASON_EOS) {
      EXPECT_EQ(branch.ids.back(), 2);
    }
  }
  // Greedy with n > 1: branch i starts with the i-th most likely token, then argmax; branch 0
  // is the plain greedy continuation.
  std::set<int32_t> first_tokens;
  for (const auto& [index, branch] : result.branches) first_tokens.insert(branch.ids.at(0));
  EXPECT_EQ(first_tokens.size(), 4u);
  request.set_n(1);
  const GenerateResult alone = generate(*stub, request);
  ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
  EXPECT_EQ(alone.branches.at(0).ids, result.branches.at(0).ids);
}

TEST_F(ServerTest, GenerateIsReproducibleWithASeed) {
  auto stub = server_->stub();
  v1::GenerateRequest request = token_request({1, 40, 41, 42, 43}, 3, 16);
  request.mutable_sampling()->set_temperature(1.0f);
  request.mutable_sampling()->set_seed(1234);
  const GenerateResult first = generate(*stub, request);
  const GenerateResult second = generate(*stub, request);
  ASSERT_TRUE(first.status.ok());
  ASSERT_TRUE(second.status.ok());
  ASSERT_EQ(first.branches.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(first.branches.at(i).ids, second.branches.at(i).ids);
  // Branches draw from their own seeds.
  EXPECT_NE(first.branches.at(0).ids, first.branches.at(1).ids);
}

TEST_F(ServerTest, GenerateStopTokenEndsABranch) {
  auto stub = server_->stub();
  v1::GenerateRequest request = token_request({1, 10, 20, 30}, 1, 8);
  const GenerateResult free_run = generate(*stub, request);
  ASSERT_TRUE(free_run.status.ok());
  ASSERT_GE(free_run.branches.at(0).ids.size(), 3u);
  const int32_t third = free_run.branches.at(0).ids[2];
  request.mutable_sampling()->add_stop_token_ids(third);
  const GenerateResult stopped = generate(*stub, request);
  ASSERT_TRUE(stopped.status.ok());
  const Branch& branch = stopped.branches.at(0);
  EXPECT_EQ(branch.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(branch.ids.back(), third);
  EXPECT_LE(branch.ids.size(), 3u);
}

TEST_F(ServerTest, GenerateStopStringCutsTheText) {
  auto stub = server_->stub();
  v1::GenerateRequest request;
  request.mutable_prompt()->set_text("Once upon a time");
  request.mutable_sampling()->set_max_tokens(40);
  request.mutable_sampling()->set_ignore_eos(true);
  const GenerateResult free_run = generate(*stub, request);
  ASSERT_TRUE(free_run.status.ok());
  const std::string text = free_run.branches.at(0).text;
  ASSERT_GE(text.size(), 12u) << text;
  // A stop string taken from the middle of the free run's text: the stopped run streams exactly
  // the text before its first occurrence, never a held-back prefix of it.
  const std::string stop = text.substr(text.size() / 2, 4);
  request.mutable_sampling()->add_stop(stop);
  const GenerateResult stopped = generate(*stub, request);
  ASSERT_TRUE(stopped.status.ok());
  EXPECT_EQ(stopped.branches.at(0).finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.branches.at(0).text, text.substr(0, text.find(stop)));
}

TEST_F(ServerTest, IgnoreEosRunsEveryBranchToMaxTokens) {
  auto stub = server_->stub();
  v1::GenerateRequest request = token_request({1, 11, 12}, 2, 120);
  request.mutable_sampling()->set_ignore_eos(true);
  request.mutable_sampling()->set_temperature(1.0f);
  const GenerateResult result = generate(*stub, request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  for (const auto& [index, branch] : result.branches) {
    EXPECT_EQ(branch.finish, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(branch.ids.size(), 120u);
  }
}

TEST_F(ServerTest, GenerateBadInputsGetInvalidArgument) {
  auto stub = server_->stub();
  struct Case {
    const char* name;
    v1::GenerateRequest request;
    grpc::StatusCode code;
    std::string mention;
  };
  std::vector<Case> cases;
  const auto base = [] { return token_request({1, 5, 6}, 1, 4); };
  cases.push_back(
      {"no prompt", v1::GenerateRequest(), grpc::StatusCode::INVALID_ARGUMENT, "prompt is empty"});
  {
    v1::GenerateRequest r = base();
    r.mutable_prompt()->mutable_tokens()->clear_ids();
    cases.push_back({"empty token prompt", r, grpc::StatusCode::INVALID_ARGUMENT, "no tokens"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_prompt()->mutable_tokens()->add_ids(999);
    cases.push_back({"token outside vocab", r, grpc::StatusCode::INVALID_ARGUMENT,
                     "prompt.tokens.ids[3] = 999"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_prompt()->mutable_tokens()->add_ids(-7);
    cases.push_back({"negative token", r, grpc::StatusCode::INVALID_ARGUMENT, "= -7"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_prompt()->set_text(std::string(kMaxTextBytes + 1, 'x'));
    cases.push_back({"oversized text", r, grpc::StatusCode::INVALID_ARGUMENT, "bytes"});
  }
  {
    v1::GenerateRequest r = token_request(std::vector<int32_t>(kMaxPromptTokens + 1, 7), 1, 4);
    cases.push_back(
        {"prompt over limit", r, grpc::StatusCode::INVALID_ARGUMENT, "max_prompt_tokens"});
  }
  {
    v1::GenerateRequest r = base();
    for (int i = 0; i < 33; ++i) r.mutable_sampling()->add_stop("s" + std::to_string(i));
    cases.push_back({"too many stop strings", r, grpc::StatusCode::INVALID_ARGUMENT,
                     "33 stop strings and 0 stop token ids; the limit is 32"});
  }
  {
    v1::GenerateRequest r = base();
    for (int i = 0; i < 40; ++i) r.mutable_sampling()->add_stop_token_ids(3);
    cases.push_back(
        {"too many stop token ids", r, grpc::StatusCode::INVALID_ARGUMENT, "max_stop_sequences"});
  }
  for (int n : {-1, 65}) {
    v1::GenerateRequest r = base();
    r.set_n(n);
    cases.push_back({"bad n", r, grpc::StatusCode::INVALID_ARGUMENT, "n = " + std::to_string(n)});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_temperature(-0.5f);
    cases.push_back({"negative temperature", r, grpc::StatusCode::INVALID_ARGUMENT, "temperature"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_top_p(1.5f);
    cases.push_back({"top_p > 1", r, grpc::StatusCode::INVALID_ARGUMENT, "top_p"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_top_k(-2);
    cases.push_back({"negative top_k", r, grpc::StatusCode::INVALID_ARGUMENT, "top_k"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_top_logprobs(21);
    cases.push_back(
        {"too many top_logprobs", r, grpc::StatusCode::INVALID_ARGUMENT, "top_logprobs"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_max_tokens(-3);
    cases.push_back(
        {"negative max_tokens", r, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens = -3"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_max_tokens(5000);
    cases.push_back({"over the context", r, grpc::StatusCode::INVALID_ARGUMENT, "context"});
  }
  {
    v1::GenerateRequest r = token_request({1, 2}, 64, 1000);
    cases.push_back(
        {"tree over max_tree_tokens", r, grpc::StatusCode::INVALID_ARGUMENT, "max_tree_tokens"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->add_stop_token_ids(100000);
    cases.push_back({"stop token outside vocab", r, grpc::StatusCode::INVALID_ARGUMENT, "100000"});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->add_stop("ok");
    r.mutable_sampling()->add_stop("");
    cases.push_back(
        {"empty stop string", r, grpc::StatusCode::INVALID_ARGUMENT, "sampling.stop[1]"});
  }
  {
    // Fits every request limit but could never fit the KV pool: 64 x 256 tokens = 1024 pages
    // plus the prompt's page.
    v1::GenerateRequest r = token_request({1, 2, 3}, 64, 256);
    cases.push_back(
        {"larger than the KV pool", r, grpc::StatusCode::RESOURCE_EXHAUSTED, "KV pool"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const GenerateResult result = generate(*stub, c.request);
    expect_status(result.status, c.code, c.mention);
    EXPECT_TRUE(result.branches.empty());
  }
  EXPECT_TRUE(server_->serving());
}

TEST_F(ServerTest, CancelMidStreamFreesKv) {
  auto stub = server_->stub();
  const v1::GenerateRequest request = token_request({1, 9, 8, 7}, 4, 3000);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(server_->metrics()["deft_live_jobs"], 1);
  EXPECT_GT(server_->metrics()["deft_kv_pages_used"], 0);
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // TearDown checks that the job is gone and its pages are back.
}

TEST_F(ServerTest, AbruptClientDisconnectFreesKv) {
  // deft-cli streams a long generation; SIGKILL it mid-stream (no cancel, no goodbye).
  const std::filesystem::path log =
      std::filesystem::temp_directory_path() / ("deft-cli-" + std::to_string(getpid()) + ".log");
  // --ignore-eos: the default model ends its story after ~200 tokens, sometimes before the
  // checks below ran.
  const pid_t cli = spawn({DEFT_CLI_BINARY, "--server", server_->address(), "generate", "--n", "2",
                           "--max-tokens", "3000", "--ignore-eos", "Once upon a time"},
                          log);
  ASSERT_GT(cli, 0);
  EXPECT_EQ(server_->wait_metric("deft_live_jobs", 1), 1);
  // The job is live before its prefill has taken pages.
  const auto deadline = std::chrono::steady_clock::now() + seconds(10);
  while (server_->metrics()["deft_kv_pages_used"] == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_GT(server_->metrics()["deft_kv_pages_used"], 0);
  kill(cli, SIGKILL);
  EXPECT_EQ(wait_exit(cli, seconds(10)), -1);
  std::filesystem::remove(log);
}

TEST_F(ServerTest, SixteenConcurrentJobsEqualEachAlone) {
  constexpr int kJobs = 16;
  std::vector<v1::GenerateRequest> requests;
  for (int j = 0; j < kJobs; ++j) {
    std::vector<int32_t> prompt = {1};
    for (int t = 0; t < 3 + j % 5; ++t) prompt.push_back(3 + (j * 31 + t * 17) % 500);
    requests.push_back(token_request(prompt, 1 + j % 3, 24));
  }
  auto stub = server_->stub();
  std::vector<GenerateResult> alone;
  for (const v1::GenerateRequest& request : requests) alone.push_back(generate(*stub, request));

  std::vector<GenerateResult> together(kJobs);
  std::vector<std::thread> threads;
  for (int j = 0; j < kJobs; ++j) {
    threads.emplace_back([&, j] {
      auto own_stub = server_->stub();
      together[j] = generate(*own_stub, requests[j]);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int j = 0; j < kJobs; ++j) {
    SCOPED_TRACE(j);
    ASSERT_TRUE(alone[j].status.ok()) << alone[j].status.error_message();
    ASSERT_TRUE(together[j].status.ok()) << together[j].status.error_message();
    ASSERT_EQ(alone[j].branches.size(), together[j].branches.size());
    for (const auto& [index, branch] : alone[j].branches) {
      EXPECT_EQ(branch.ids, together[j].branches.at(index).ids);
    }
  }
}

TEST_F(ServerTest, DeftCliCommands) {
  const std::string address = server_->address();
  const ProgramResult health = run_program({DEFT_CLI_BINARY, "--server", address, "health"});
  EXPECT_EQ(health.exit_code, 0) << health.output;
  EXPECT_NE(health.output.find("SERVING"), std::string::npos) << health.output;
  const ProgramResult info = run_program({DEFT_CLI_BINARY, "--server", address, "info"});
  EXPECT_EQ(info.exit_code, 0) << info.output;
  EXPECT_NE(info.output.find("vocab_size: 512"), std::string::npos) << info.output;
  const ProgramResult tokens =
      run_program({DEFT_CLI_BINARY, "--server", address, "tokenize", "--bos", "a tree"});
  EXPECT_EQ(tokens.exit_code, 0) << tokens.output;
  EXPECT_EQ(tokens.output.rfind("1 ", 0), 0u) << tokens.output;
  const ProgramResult generated = run_program(
      {DEFT_CLI_BINARY, "--server", address, "generate", "--n", "2", "--max-tokens", "5", "Once"});
  EXPECT_EQ(generated.exit_code, 0) << generated.output;
  EXPECT_NE(generated.output.find("[branch 1, "), std::string::npos) << generated.output;
  // A refused request: exit 1 with the server's code and message.
  const ProgramResult refused =
      run_program({DEFT_CLI_BINARY, "--server", address, "detokenize", "7", "100000"});
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("ids[1] = 100000"), std::string::npos) << refused.output;
  const ProgramResult usage = run_program({DEFT_CLI_BINARY, "frobnicate"});
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
}

// ---- Separate servers: admission queue, shutdown, configuration ---------------------------

TEST(ServerAdmission, FullQueueIsResourceExhaustedAndTheQueueDrains) {
  // 256 pages: a job of 3900 tokens (245 pages at worst) leaves no room for a second one
  // under worst-case admission (the queue's limits are the same under step admission).
  ServerProcess server(
      {"--kv-pages", "256", "--max-queued-jobs", "1", "--kv-admission", "worst_case"});
  ASSERT_TRUE(server.running());
  auto stub = server.stub();
  grpc::ClientContext big_context;
  auto big = stub->Generate(&big_context, token_request({1, 3, 4}, 1, 3900));
  v1::GenerateResponse response;
  ASSERT_TRUE(big->Read(&response));  // admitted and decoding

  // The second waits in the queue (its worst case does not fit beside the first) ...
  GenerateResult second;
  std::thread waiter([&] {
    auto own = server.stub();
    second = generate(*own, token_request({1, 5}, 1, 200));
  });
  EXPECT_EQ(server.wait_metric("deft_queue_depth", 1), 1);
  // ... so the third finds the queue full.
  const GenerateResult third = generate(*stub, token_request({1, 6}, 1, 8));
  expect_status(third.status, grpc::StatusCode::RESOURCE_EXHAUSTED, "max_queued_jobs");

  big_context.TryCancel();
  while (big->Read(&response)) {
  }
  EXPECT_EQ(big->Finish().error_code(), grpc::StatusCode::CANCELLED);
  waiter.join();  // admitted once the first job's pages came back
  EXPECT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.branches.size(), 1u);
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0), 0);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// Step admission on a 32-page pool: eight concurrent jobs whose worst cases add up to 7 times
// the pool all finish, some preempted on the way (deft_preemptions_total), each with the
// tokens it gives alone, and the pool ends with no referenced KV.
TEST(ServerAdmission, PreemptedJobsFinishWithTheTokensTheyGiveAlone) {
  ServerProcess server({"--kv-pages", "32", "--page-tokens", "16"});
  ASSERT_TRUE(server.running());
  constexpr int kJobs = 8;
  const auto request = [](int job) {
    return token_request({1, 3 + job, 4 + job, 5}, 2, 220);  // 1 + 2 x 14 pages at worst
  };
  std::vector<GenerateResult> crowd(kJobs);
  std::vector<std::thread> clients;
  for (int job = 0; job < kJobs; ++job) {
    clients.emplace_back([&, job] {
      auto stub = server.stub();
      crowd[job] = generate(*stub, request(job));
    });
  }
  for (std::thread& client : clients) client.join();
  const std::map<std::string, double> metrics = server.metrics();
  EXPECT_GT(metrics.at("deft_preemptions_total"), 0);
  auto stub = server.stub();
  for (int job = 0; job < kJobs; ++job) {
    SCOPED_TRACE(job);
    ASSERT_TRUE(crowd[job].status.ok()) << crowd[job].status.error_message();
    const GenerateResult alone = generate(*stub, request(job));
    ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
    ASSERT_EQ(crowd[job].branches.size(), 2u);
    for (const auto& [index, branch] : alone.branches) {
      EXPECT_EQ(crowd[job].branches.at(index).ids, branch.ids) << "branch " << index;
    }
  }
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0), 0);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST(ServerShutdown, SigtermCancelsLiveJobsAfterTheGraceAndExitsZero) {
  ServerProcess server({"--shutdown-grace-seconds", "0.5"});
  ASSERT_TRUE(server.running());
  auto stub = server.stub();
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, token_request({1, 3, 4}, 2, 4000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  std::atomic<bool> stopped{false};
  std::optional<int> exit_code;
  std::thread stopper([&] {
    exit_code = server.stop(SIGTERM, seconds(30));
    stopped = true;
  });
  std::map<int32_t, v1::FinishReason> finish;
  while (reader->Read(&response)) {
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finish[response.branch()] = response.finish_reason();
    }
  }
  const grpc::Status status = reader->Finish();
  stopper.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_EQ(finish.size(), 2u);
  for (const auto& [branch, reason] : finish) EXPECT_EQ(reason, v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(exit_code, 0) << server.log();
  EXPECT_NE(server.log().find("SIGTERM received"), std::string::npos) << server.log();
}

TEST(ServerShutdown, ASecondSignalCancelsAtOnce) {
  ServerProcess server({"--shutdown-grace-seconds", "60"});
  ASSERT_TRUE(server.running());
  auto stub = server.stub();
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, token_request({1, 3, 4}, 1, 4000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  server.signal(SIGTERM);
  // Draining: new work is refused while the live job may still finish.
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_FALSE(server.serving());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(server.stop(SIGTERM, seconds(20)), 0) << server.log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(10));
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(server.log().find("second signal"), std::string::npos) << server.log();
}

TEST(ServerShutdown, SigintOnAnIdleServerExitsZero) {
  ServerProcess server;
  ASSERT_TRUE(server.running());
  EXPECT_EQ(server.stop(SIGINT), 0) << server.log();
}

// A model that loads for as long as the test wants: its config.json is a FIFO that the test
// feeds, the other files link to the embedded model. While it loads the server listens, its
// health service reports NOT_SERVING (a readiness probe keeps traffic away) and every RPC answers
// UNAVAILABLE; once fed, it loads and reports SERVING.
TEST(ServerStartup, NotServingWhileTheModelLoads) {
  const std::filesystem::path source = std::filesystem::path(DEFT_SOURCE_DIR) / "models/default";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("deft-slow-model-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const auto& entry : std::filesystem::directory_iterator(source)) {
    if (entry.path().filename() != "config.json") {
      std::filesystem::create_symlink(entry.path(), dir / entry.path().filename());
    }
  }
  const std::filesystem::path fifo = dir / "config.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::string config_text;
  {
    std::ifstream file(source / "config.json");
    config_text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }

  ServerProcess server({"--model", dir.string()}, /*wait_serving=*/false);
  ASSERT_TRUE(server.running());
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_FALSE(server.serving());
  EXPECT_FALSE(server.serving("deft.v1.Deft"));
  {
    grpc::ClientContext context;
    v1::ModelInfoResponse info;
    const grpc::Status status = server.stub()->ModelInfo(&context, {}, &info);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(status.error_message().find("loading"), std::string::npos) << status.error_message();
  }
  // Feed config.json to every reader until the server serves.
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  while (!server.serving() && std::chrono::steady_clock::now() < deadline) {
    const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // fails while no reader waits
    if (fd >= 0) {
      EXPECT_EQ(write(fd, config_text.data(), config_text.size()),
                static_cast<ssize_t>(config_text.size()));
      close(fd);
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(server.serving()) << server.log();
  EXPECT_TRUE(server.serving("deft.v1.Deft"));
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  EXPECT_TRUE(server.stub()->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.name(), dir.filename().string());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  std::filesystem::remove_all(dir);
}

// gRPC would share a busy port (SO_REUSEPORT) and split new connections between two servers;
// the second must fail to start instead, before it loads its model.
TEST(ServerStartup, ABusyPortFailsTheStart) {
  ServerProcess first;
  ASSERT_TRUE(first.running());
  const ProgramResult second =
      run_program({DEFT_SERVER_BINARY, "--listen", first.address(), "--metrics-listen", ""});
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_NE(second.output.find("cannot listen on " + first.address()), std::string::npos)
      << second.output;
  EXPECT_EQ(second.output.find("loaded in"), std::string::npos) << second.output;
  EXPECT_TRUE(first.serving());
}

TEST(ServerConfig, HelpListsEveryOptionWithItsDefault) {
  const ProgramResult result = run_program({DEFT_SERVER_BINARY, "--help"});
  EXPECT_EQ(result.exit_code, 0);
  for (const char* option :
       {"--config", "--model", "--listen", "--metrics-listen", "--kv-pages", "--page-tokens",
        "--max-queued-jobs", "--max-tree-tokens", "--max-prompt-tokens", "--plan", "--log-level",
        "--first-node-id", "--device", "--prefix-cache-pages", "--no-prefix-cache",
        "(default \"127.0.0.1:50051\")", "(default 2048)"}) {
    EXPECT_NE(result.output.find(option), std::string::npos) << option << "\n" << result.output;
  }
}

TEST(ServerConfig, BadOptionsAndFieldsExitTwoNamingThem) {
  const std::filesystem::path config =
      std::filesystem::temp_directory_path() / ("deft-bad-" + std::to_string(getpid()) + ".json");
  const auto write = [&](const std::string& text) { std::ofstream(config) << text; };
  struct Case {
    std::vector<std::string> args;
    std::string mention;
  };
  write("{\"kv_pages\": 8, \"kv_pagez\": 3}");
  std::vector<Case> cases = {
      {{"--no-such-option"}, "--no-such-option"},
      {{"--kv-pages", "many"}, "--kv-pages"},
      {{"--kv-pages"}, "needs a value"},
      {{"--kv-pages", "0"}, "kv_pages"},
      {{"--plan", "magic"}, "magic"},
      {{"--log-level", "loud"}, "loud"},
      {{"--log-format", "xml"}, "log_format"},
      {{"--stream-stall-seconds", "-1"}, "stream_stall_seconds"},
      {{"--auth-reflection", "true"}, "auth_reflection"},
      {{"--device", "-1"}, "device"},
      {{"--first-node-id", "0"}, "first_node_id"},
      {{"--first-node-id", "4611686018427387905"}, "first_node_id"},    // 2^62 + 1
      {{"--first-node-id", "9223372036854775808"}, "--first-node-id"},  // 2^63: not an int64
      {{"--config", config.string()}, "kv_pagez"},
      {{"--config", "/nonexistent/deft.json"}, "/nonexistent/deft.json"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {DEFT_SERVER_BINARY};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const ProgramResult result = run_program(argv);
    SCOPED_TRACE(c.args.front());
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_NE(result.output.find(c.mention), std::string::npos) << result.output;
  }
  write("{\"page_tokens\": \"16\"}");
  const ProgramResult typed = run_program({DEFT_SERVER_BINARY, "--config", config.string()});
  EXPECT_EQ(typed.exit_code, 2);
  EXPECT_NE(typed.output.find("page_tokens"), std::string::npos) << typed.output;
  std::filesystem::remove(config);
}

// The CPU backend has no device to pick: a --device says so in the log and changes nothing.
TEST(ServerConfig, DeviceIsNotUsedByTheCpuBackend) {
  ServerProcess server({"--backend", "cpu", "--device", "3", "--kv-pages", "64"});
  ASSERT_TRUE(server.running());
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  ASSERT_TRUE(server.stub()->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  EXPECT_NE(server.log().find("device 3 is not used: the model runs on the CPU backend"),
            std::string::npos)
      << server.log();
}

// The per-step counters give means over any window: rows per step, host planning and forward
// time per step.
TEST(ServerMetrics, StepCountersAddUp) {
  ServerProcess server;
  ASSERT_TRUE(server.running());
  grpc::ClientContext context;
  auto reader = server.stub()->Generate(&context, token_request({1, 3, 4, 5, 6}, 3, 12));
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  ASSERT_TRUE(reader->Finish().ok());
  std::map<std::string, double> m = server.metrics();
  const double steps = m["deft_engine_steps_total"];
  EXPECT_GT(steps, 1);
  EXPECT_GE(m["deft_step_rows_total"], steps);
  EXPECT_GE(m["deft_step_rows_total"], m["deft_step_logit_rows_total"]);
  EXPECT_GE(m["deft_step_logit_rows_total"], steps);
  EXPECT_GT(m["deft_step_forward_seconds_total"], 0);
  EXPECT_GT(m["deft_step_plan_seconds_total"], 0);
  EXPECT_GE(m["deft_step_seconds_total"], m["deft_step_forward_seconds_total"]);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

// The prefix cache on /metrics: a finished job's KV stays cached, the same prompt again reuses
// its whole pages (and decodes the same), and a job that needs the pages evicts it. With
// --no-prefix-cache nothing is cached or reused.
TEST(ServerMetrics, PrefixCacheHitsAndEvictionsAreExported) {
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 40; ++i) prompt.push_back(3 + (i * 7) % 500);
  v1::GenerateRequest request = token_request(prompt, 1, 20);
  request.mutable_sampling()->set_ignore_eos(true);
  {
    // 8 pages of 16 tokens: one job's worst case (3 prompt pages + 2) fits, two do not.
    ServerProcess server({"--kv-pages", "8"});
    ASSERT_TRUE(server.running());
    const GenerateResult cold = generate(*server.stub(), request);
    ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
    EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0), 0);
    std::map<std::string, double> m = server.metrics();
    EXPECT_EQ(m["deft_kv_pages_cached"], 5) << "3 prompt pages, 2 of the branch";
    EXPECT_EQ(m["deft_kv_pages_used"] + m["deft_kv_pages_free"] + m["deft_kv_pages_cached"], 8);
    EXPECT_EQ(m["deft_prefix_cache_hit_tokens_total"], 0);
    const GenerateResult warm = generate(*server.stub(), request);
    ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
    EXPECT_EQ(warm.branches.at(0).ids, cold.branches.at(0).ids);
    m = server.metrics();
    EXPECT_EQ(m["deft_prefix_cache_hit_tokens_total"], 32) << "the 2 whole pages before the last";
    EXPECT_EQ(m["deft_prefix_cache_evicted_pages_total"], 0);
    // Another prompt of the same size needs 5 pages at worst; 3 are free.
    std::vector<int32_t> other = prompt;
    for (int32_t& id : other) id = 3 + (id + 11) % 500;
    v1::GenerateRequest other_request = token_request(other, 1, 20);
    other_request.mutable_sampling()->set_ignore_eos(true);
    const GenerateResult evicting = generate(*server.stub(), other_request);
    ASSERT_TRUE(evicting.status.ok()) << evicting.status.error_message();
    EXPECT_GT(server.metrics()["deft_prefix_cache_evicted_pages_total"], 0);
    EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  }
  {
    ServerProcess server({"--kv-pages", "8", "--no-prefix-cache"});
    ASSERT_TRUE(server.running());
    ASSERT_TRUE(generate(*server.stub(), request).status.ok());
    ASSERT_TRUE(generate(*server.stub(), request).status.ok());
    EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0), 0);
    std::map<std::string, double> m = server.metrics();
    EXPECT_EQ(m["deft_kv_pages_cached"], 0);
    EXPECT_EQ(m["deft_kv_pages_free"], 8);
    EXPECT_EQ(m["deft_prefix_cache_hit_tokens_total"], 0);
    EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  }
}

TEST(ServerConfig, TheShippedDefaultConfigStartsAndCommandLineOverridesIt) {
  ServerProcess server({"--config", DEFT_SOURCE_DIR "/configs/default.json", "--listen",
                        "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--http-listen",
                        "127.0.0.1:0", "--kv-pages", "100"});
  ASSERT_TRUE(server.running());
  grpc::ClientContext context;
  v1::ModelInfoResponse info;
  ASSERT_TRUE(server.stub()->ModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.kv_capacity_tokens(), 1600);
  EXPECT_EQ(server.metrics()["deft_kv_pages_free"], 100);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

}  // namespace
}  // namespace deft::testing
