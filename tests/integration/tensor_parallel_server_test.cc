// deft-server with --tensor-parallel: the options' checks, and a server at TP 2 answering Generate
// with the greedy tokens a TP 1 server gives: on the CPU backend (the CPU twin of tensor
// parallelism, models/tensor_parallel.h: ranks on threads), or with DEFT_TP_TEST_BACKEND=cuda
// on two GPUs (NCCL ranks; the GPU machine runs it so, CI on the CPU).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/integration/server_process.h"

namespace deft::testing {
namespace {

// A greedy Generate's tokens per branch (speculating with `policy` when set).
std::vector<std::vector<int32_t>> greedy_branches(
    ServerProcess& server,
    v1::SpeculativeOptions::Policy policy = v1::SpeculativeOptions::POLICY_OFF) {
  v1::GenerateRequest request;
  if (policy != v1::SpeculativeOptions::POLICY_OFF) {
    request.mutable_speculative()->set_policy(policy);
  }
  for (int32_t id : {1, 40, 41, 42, 43, 7}) request.mutable_prompt()->mutable_tokens()->add_ids(id);
  request.set_n(3);
  request.mutable_sampling()->set_temperature(0.0f);
  request.mutable_sampling()->set_max_tokens(24);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = server.stub()->Generate(&context, request);
  std::vector<std::vector<int32_t>> branches(3);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    EXPECT_LT(response.branch(), 3);
    if (response.branch() >= 3) continue;
    std::vector<int32_t>& ids = branches[static_cast<size_t>(response.branch())];
    ids.insert(ids.end(), response.delta().ids().begin(), response.delta().ids().end());
  }
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  return branches;
}

std::string backend() {
  const char* backend = std::getenv("DEFT_TP_TEST_BACKEND");
  return backend != nullptr ? backend : "cpu";
}

TEST(TensorParallelServer, TwoRanksGenerateWhatOneRankDoes) {
  ServerProcess whole({"--backend", backend(), "--kv-pages", "64"});
  ServerProcess sharded({"--backend", backend(), "--kv-pages", "64", "--tensor-parallel", "2"});
  ASSERT_TRUE(whole.running());
  ASSERT_TRUE(sharded.running());
  const std::vector<std::vector<int32_t>> expected = greedy_branches(whole);
  EXPECT_FALSE(expected[0].empty());
  EXPECT_EQ(greedy_branches(sharded), expected);
  EXPECT_NE(sharded.log().find("tensor parallel"), std::string::npos) << sharded.log();
  EXPECT_EQ(sharded.stop(SIGTERM), 0) << sharded.log();
  EXPECT_EQ(whole.stop(SIGTERM), 0) << whole.log();
}

// The draft model runs whole on the first rank's device beside a sharded model: speculative
// greedy output equals the plain output of the same server, with tokens accepted from drafts.
TEST(TensorParallelServer, TwoRanksSpeculateWithADraftOnTheFirstDevice) {
  ServerProcess sharded({"--backend", backend(), "--kv-pages", "256", "--tensor-parallel", "2",
                         "--draft-model", DEFT_SOURCE_DIR "/models/default-draft"});
  ASSERT_TRUE(sharded.running());
  const std::vector<std::vector<int32_t>> plain = greedy_branches(sharded);
  EXPECT_FALSE(plain[0].empty());
  EXPECT_EQ(greedy_branches(sharded, v1::SpeculativeOptions::POLICY_STATIC_TREE), plain);
  EXPECT_EQ(greedy_branches(sharded, v1::SpeculativeOptions::POLICY_DYNAMIC_TREE), plain);
  EXPECT_GT(sharded.metrics()["deft_speculative_accepted_tokens_total"], 0) << sharded.log();
  EXPECT_NE(sharded.log().find("draft model: "), std::string::npos) << sharded.log();
  EXPECT_EQ(sharded.stop(SIGTERM), 0) << sharded.log();
}

// Deterministic mode with tensor parallelism: the server starts (the residual all-reduce sums in
// rank order at any step size) and gives the greedy tokens of a deterministic server at TP 1.
TEST(TensorParallelServer, TwoRanksRunInDeterministicMode) {
  if (backend() == "cuda") {
    GTEST_SKIP() << "the default model's head_dim 32 has no deterministic CUDA path; "
                    "tests/gpu's CudaDeterministicTp covers TP 2 on the GPUs";
  }
  ServerProcess whole({"--backend", backend(), "--kv-pages", "64", "--deterministic"});
  ServerProcess sharded(
      {"--backend", backend(), "--kv-pages", "64", "--deterministic", "--tensor-parallel", "2"});
  ASSERT_TRUE(whole.running());
  ASSERT_TRUE(sharded.running());
  EXPECT_EQ(greedy_branches(sharded), greedy_branches(whole));
  EXPECT_NE(sharded.log().find("deterministic mode"), std::string::npos) << sharded.log();
  EXPECT_EQ(sharded.stop(SIGTERM), 0) << sharded.log();
  EXPECT_EQ(whole.stop(SIGTERM), 0) << whole.log();
}

TEST(TensorParallelServer, BadOptionsExitTwoNamingThem) {
  struct Case {
    std::vector<std::string> args;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {{"--tensor-parallel", "0"}, "tensor_parallel"},
      {{"--tensor-parallel", "2", "--devices", "0"}, "names 1 devices but tensor_parallel = 2"},
      {{"--tensor-parallel", "2", "--devices", "1,1"}, "names device 1 twice"},
      {{"--tensor-parallel", "2", "--devices", "0,x"}, "is not a CUDA device number"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {DEFT_SERVER_BINARY};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const ProgramResult result = run_program(argv);
    SCOPED_TRACE(c.mention);
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_NE(result.output.find(c.mention), std::string::npos) << result.output;
  }
}

// The default model has 2 KV heads: 3 ranks cannot hold whole heads, and the start says so.
TEST(TensorParallelServer, KvHeadsThatDoNotSplitEndTheStart) {
  const ProgramResult result =
      run_program({DEFT_SERVER_BINARY, "--backend", "cpu", "--kv-pages", "64", "--tensor-parallel",
                   "3", "--listen", "127.0.0.1:0", "--metrics-listen", ""});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("2 KV heads do not split over 3 ranks"), std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace deft::testing
