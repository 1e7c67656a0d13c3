// Fault injection on the real deft-server (embedded model, CPU backend) with real gRPC clients:
//   - SIGTERM under load drains: health NOT_SERVING, new work UNAVAILABLE, every stream in
//     flight (Generate, RunTree, a session's decode) finishes whole, exit 0;
//   - a storm of abrupt disconnects (cancels mid-stream, deft-cli processes SIGKILLed) returns
//     every KV page and leaves the server serving;
//   - a slow reader: its job pauses once its answers back up (the engine stops stepping it) and
//     it still gets every token when it reads again; a reader that stops for good is cut after
//     --stream-stall-seconds and its KV freed.
// No test asserts on timings: waits are polls with generous limits.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <thread>

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
using Clock = std::chrono::steady_clock;

void set_ids(google::protobuf::RepeatedField<int32_t>* ids, std::initializer_list<int32_t> values) {
  ids->Add(values.begin(), values.end());
}

// A greedy Generate that runs to max_tokens (EOS ignored); `top_logprobs` makes messages larger.
v1::GenerateRequest long_generate(int32_t first_token, int n, int max_tokens,
                                  int top_logprobs = 0) {
  v1::GenerateRequest request;
  set_ids(request.mutable_prompt()->mutable_tokens()->mutable_ids(), {1, first_token, 9, 8});
  request.set_n(n);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  request.mutable_sampling()->set_ignore_eos(true);
  request.mutable_sampling()->set_top_logprobs(top_logprobs);
  return request;
}

v1::RunTreeRequest long_tree(int max_tokens) {
  v1::RunTreeRequest request;
  set_ids(request.mutable_prompt()->mutable_tokens()->mutable_ids(), {1, 4, 5, 6});
  request.mutable_policy()->set_branch_factor(2);
  request.mutable_policy()->set_every_tokens(64);
  request.mutable_policy()->set_max_depth(2);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  request.mutable_sampling()->set_ignore_eos(true);
  return request;
}

// Polls until `done()` or `limit` passes; whether it became true.
template <typename Predicate>
bool eventually(Predicate done, std::chrono::milliseconds limit = seconds(60)) {
  const auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return true;
}

// A channel whose HTTP/2 window stays at gRPC's default 64 KB (no BDP probing, which on
// loopback grows it to megabytes): a client that stops reading fills it after a few hundred
// messages, as over a real network.
std::shared_ptr<grpc::Channel> small_window_channel(const ServerProcess& server) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), arguments);
}

size_t count(const std::string& text, const std::string& part) {
  size_t found = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++found;
  }
  return found;
}

// ---- SIGTERM under load -------------------------------------------------------------------

TEST(FaultInjection, SigtermUnderLoadDrainsInFlightWorkAndExitsZero) {
  // A grace far longer than the work needs, even under the sanitizers.
  ServerProcess server({"--shutdown-grace-seconds", "300"});
  ASSERT_TRUE(server.running());
  constexpr int kGenerates = 6;
  constexpr int kTokens = 300;
  std::atomic<int> started{0};
  std::vector<std::thread> clients;

  std::vector<GenerateRun> generated(kGenerates);
  for (int i = 0; i < kGenerates; ++i) {
    clients.emplace_back([&, i] {
      auto stub = server.stub();
      grpc::ClientContext context;
      auto reader = stub->Generate(&context, long_generate(10 + i, 2, kTokens));
      v1::GenerateResponse response;
      bool first = true;
      while (reader->Read(&response)) {
        generated[i].branches[response.branch()].add(response.delta(), response.finish_reason());
        if (first) ++started;
        first = false;
      }
      generated[i].status = reader->Finish();
    });
  }

  TreeRun tree;
  clients.emplace_back([&] {
    auto stub = server.stub();
    grpc::ClientContext context;
    auto reader = stub->RunTree(&context, long_tree(kTokens));
    v1::TreeEvent event;
    bool first = true;
    while (reader->Read(&event)) {
      tree.events.push_back(event);
      if (event.has_finished()) ++tree.finished_events;
      if (first) ++started;
      first = false;
    }
    tree.status = reader->Finish();
  });

  // A session: create and a long decode, pipelined; the decode is in flight at the signal.
  std::map<int64_t, StreamedTokens> decoded;
  grpc::Status session_status;
  clients.emplace_back([&] {
    auto stub = server.stub();
    grpc::ClientContext context;
    auto stream = stub->TreeSession(&context);
    v1::SessionRequest create;
    create.set_request_id(1);
    set_ids(create.mutable_create()->mutable_prompt()->mutable_tokens()->mutable_ids(), {1, 7, 7});
    ASSERT_TRUE(stream->Write(create));
    v1::SessionResponse response;
    ASSERT_TRUE(stream->Read(&response));
    ASSERT_TRUE(response.has_created_node()) << response.DebugString();
    v1::SessionRequest decode;
    decode.set_request_id(2);
    decode.mutable_decode()->add_nodes(response.created_node());
    decode.mutable_decode()->mutable_sampling()->set_max_tokens(kTokens);
    decode.mutable_decode()->mutable_sampling()->set_ignore_eos(true);
    ASSERT_TRUE(stream->Write(decode));
    bool first = true;
    while (stream->Read(&response)) {
      if (response.has_decoded()) {
        decoded[response.decoded().node()].add(response.decoded().delta(),
                                               response.decoded().finish_reason());
        if (first) ++started;
        first = false;
      }
    }
    session_status = stream->Finish();
  });

  const int in_flight = kGenerates + 2;
  EXPECT_TRUE(eventually([&] { return started.load() == in_flight; })) << server.log();
  server.signal(SIGTERM);

  // Draining: not ready, and new work is refused (the engine stops admitting before health
  // turns NOT_SERVING, so this holds as soon as the probe sees it).
  EXPECT_TRUE(eventually([&] { return !server.serving(); })) << server.log();
  {
    auto stub = server.stub();
    const GenerateRun refused = run_generate(*stub, greedy_request({1, 3}, 4));
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << refused.status.error_message();
    grpc::ClientContext context;
    auto stream = stub->TreeSession(&context);
    stream->WritesDone();
    v1::SessionResponse response;
    EXPECT_FALSE(stream->Read(&response)) << response.DebugString();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }

  for (std::thread& client : clients) client.join();
  // Every stream in flight at the signal finished whole.
  for (int i = 0; i < kGenerates; ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(generated[i].status.ok()) << generated[i].status.error_message();
    ASSERT_EQ(generated[i].branches.size(), 2u);
    for (const auto& [index, branch] : generated[i].branches) {
      EXPECT_EQ(branch.ids.size(), static_cast<size_t>(kTokens));
      EXPECT_EQ(branch.finish, v1::FINISH_REASON_LENGTH);
    }
  }
  EXPECT_TRUE(tree.status.ok()) << tree.status.error_message();
  EXPECT_EQ(tree.finished_events, 1);
  ASSERT_EQ(decoded.size(), 1u);
  EXPECT_EQ(decoded.begin()->second.ids.size(), static_cast<size_t>(kTokens));
  EXPECT_EQ(decoded.begin()->second.finish, v1::FINISH_REASON_LENGTH);
  // The session itself (open, idle after its decode) ends with the server.
  EXPECT_EQ(session_status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << session_status.error_message();

  EXPECT_EQ(server.wait(seconds(60)), 0) << server.log();
  const std::string log = server.log();
  EXPECT_NE(log.find("SIGTERM received"), std::string::npos) << log;
  EXPECT_EQ(log.find("second signal: cancelling"), std::string::npos) << log;
  EXPECT_EQ(log.find("shut down before the request finished"), std::string::npos) << log;
}

// ---- A storm of abrupt disconnects --------------------------------------------------------

TEST(FaultInjection, AStormOfAbruptDisconnectsFreesEveryKvPage) {
  // Room for every job at its worst case at once.
  ServerProcess server({"--kv-pages", "4096"});
  ASSERT_TRUE(server.running());
  constexpr int kGenerates = 8;
  constexpr int kTrees = 4;
  constexpr int kSessions = 4;
  constexpr int kCliProcesses = 6;
  // No stream ends by itself before the storm: the in-process clients stop reading after a few
  // messages on a 64 KB window, so their jobs pause long before their end; the CLIs read on.
  constexpr int kLong = 1000;
  constexpr int kCliTokens = 3000;
  std::atomic<int> streaming{0};
  std::atomic<bool> storm{false};
  std::vector<std::thread> clients;
  std::vector<grpc::StatusCode> codes(kGenerates + kTrees + kSessions, grpc::StatusCode::OK);

  // Each client reads a few messages, then waits for the storm and cancels mid-stream.
  const auto wait_for_storm = [&] {
    ++streaming;
    while (!storm.load()) std::this_thread::sleep_for(milliseconds(5));
  };
  for (int i = 0; i < kGenerates; ++i) {
    clients.emplace_back([&, i] {
      auto stub = v1::Deft::NewStub(small_window_channel(server));
      grpc::ClientContext context;
      auto reader = stub->Generate(&context, long_generate(20 + i, 2, kLong, 8));
      v1::GenerateResponse response;
      for (int m = 0; m < 4; ++m) ASSERT_TRUE(reader->Read(&response));
      wait_for_storm();
      context.TryCancel();
      while (reader->Read(&response)) {
      }
      codes[i] = reader->Finish().error_code();
    });
  }
  for (int i = 0; i < kTrees; ++i) {
    clients.emplace_back([&, i] {
      auto stub = v1::Deft::NewStub(small_window_channel(server));
      grpc::ClientContext context;
      auto reader = stub->RunTree(&context, long_tree(kLong));
      v1::TreeEvent event;
      for (int m = 0; m < 4; ++m) ASSERT_TRUE(reader->Read(&event));
      wait_for_storm();
      context.TryCancel();
      while (reader->Read(&event)) {
      }
      codes[kGenerates + i] = reader->Finish().error_code();
    });
  }
  for (int i = 0; i < kSessions; ++i) {
    clients.emplace_back([&, i] {
      auto stub = server.stub();
      TestSession session(*stub);
      const int64_t root = session.create({1, 30 + i, 31}).created_node();
      const v1::SessionResponse children = session.branch(root, 2);
      ASSERT_EQ(children.branched().children_size(), 2) << children.DebugString();
      // A second session with a long decode in flight.
      auto stub2 = v1::Deft::NewStub(small_window_channel(server));
      grpc::ClientContext context;
      auto stream = stub2->TreeSession(&context);
      v1::SessionRequest create;
      create.set_request_id(1);
      set_ids(create.mutable_create()->mutable_prompt()->mutable_tokens()->mutable_ids(),
              {1, 40 + i});
      ASSERT_TRUE(stream->Write(create));
      v1::SessionResponse response;
      ASSERT_TRUE(stream->Read(&response));
      v1::SessionRequest decode;
      decode.set_request_id(2);
      decode.mutable_decode()->add_nodes(response.created_node());
      decode.mutable_decode()->mutable_sampling()->set_max_tokens(kLong);
      decode.mutable_decode()->mutable_sampling()->set_top_logprobs(20);
      decode.mutable_decode()->mutable_sampling()->set_ignore_eos(true);
      ASSERT_TRUE(stream->Write(decode));
      for (int m = 0; m < 4; ++m) ASSERT_TRUE(stream->Read(&response));
      wait_for_storm();
      // Two sessions cut at once: the one mid-decode and the idle one holding two branches.
      context.TryCancel();
      session.context().TryCancel();
      while (stream->Read(&response)) {
      }
      codes[kGenerates + kTrees + i] = stream->Finish().error_code();
    });
  }
  // deft-cli processes streaming long generations, to be SIGKILLed (no cancel, no goodbye).
  std::vector<pid_t> cli;
  std::vector<std::filesystem::path> cli_logs;
  for (int i = 0; i < kCliProcesses; ++i) {
    cli_logs.push_back(std::filesystem::temp_directory_path() /
                       ("deft-storm-" + std::to_string(getpid()) + "-" + std::to_string(i)));
    cli.push_back(spawn(
        {DEFT_CLI_BINARY, "--server", server.address(), "generate", "--n", "1", "--max-tokens",
         std::to_string(kCliTokens), "--ignore-eos", "Once upon a time " + std::to_string(i)},
        cli_logs.back()));
    EXPECT_GT(cli.back(), 0);
  }

  const int in_process = kGenerates + kTrees + kSessions;
  EXPECT_TRUE(eventually([&] { return streaming.load() == in_process; })) << server.log();
  // Every CLI's job is live: Generate and RunTree jobs, the session decodes, the CLIs'.
  EXPECT_TRUE(eventually([&] {
    return server.metrics()["deft_live_jobs"] >= in_process + kCliProcesses;
  })) << server.metrics()["deft_live_jobs"];
  EXPECT_GT(server.metrics()["deft_kv_pages_used"], 0);

  storm = true;
  for (pid_t pid : cli) {
    if (pid > 0) kill(pid, SIGKILL);
  }
  for (std::thread& client : clients) client.join();
  for (pid_t pid : cli) EXPECT_EQ(wait_exit(pid, seconds(10)), -1);
  for (const auto& log : cli_logs) std::filesystem::remove(log);
  for (grpc::StatusCode code : codes) EXPECT_EQ(code, grpc::StatusCode::CANCELLED);

  // Every page back, nothing live, and the server serves as before.
  EXPECT_EQ(server.wait_metric("deft_live_jobs", 0, seconds(60)), 0);
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0, seconds(60)), 0);
  EXPECT_EQ(server.metrics()["deft_queue_depth"], 0);
  EXPECT_TRUE(server.serving());
  auto stub = server.stub();
  const GenerateRun after = run_generate(*stub, greedy_request({1, 3, 4}, 16));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
  const std::string log = server.log();
  EXPECT_EQ(count(log, " error "), 0u) << log;
  EXPECT_EQ(count(log, " critical "), 0u) << log;
}

// ---- Slow readers -------------------------------------------------------------------------

// The engine's step counter, once it has held still for half a second (the job is paused);
// nullopt when it kept moving for a minute.
std::optional<double> steps_when_paused(const ServerProcess& server) {
  double last = -1;
  const auto deadline = Clock::now() + seconds(60);
  while (Clock::now() < deadline) {
    const double steps = server.metrics()["deft_engine_steps_total"];
    if (steps == last) return steps;
    last = steps;
    std::this_thread::sleep_for(milliseconds(500));
  }
  return std::nullopt;
}

TEST(FaultInjection, ASlowReaderPausesItsJobAndStillGetsEveryToken) {
  ServerProcess server({"--stream-stall-seconds", "600"});
  ASSERT_TRUE(server.running());
  constexpr int kBranches = 4;
  constexpr int kTokens = 800;  // 3200 messages of ~100 bytes: far past a 64 KB window
  auto stub = v1::Deft::NewStub(small_window_channel(server));
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, long_generate(3, kBranches, kTokens, /*top_logprobs=*/8));
  GenerateRun run;
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  run.branches[response.branch()].add(response.delta(), response.finish_reason());

  // The client reads nothing now: the job must stop being stepped, unfinished, with its KV.
  const std::optional<double> paused = steps_when_paused(server);
  ASSERT_TRUE(paused.has_value()) << "the engine kept stepping a job nobody reads";
  std::map<std::string, double> metrics = server.metrics();
  EXPECT_EQ(metrics["deft_live_jobs"], 1);
  EXPECT_GT(metrics["deft_kv_pages_used"], 0);
  EXPECT_LT(metrics["deft_generated_tokens_total"], kBranches * kTokens);

  // Reading again resumes it: every token arrives, in order, and the stream ends OK.
  while (reader->Read(&response)) {
    run.branches[response.branch()].add(response.delta(), response.finish_reason());
  }
  run.status = reader->Finish();
  EXPECT_TRUE(run.status.ok()) << run.status.error_message();
  ASSERT_EQ(run.branches.size(), static_cast<size_t>(kBranches));
  for (const auto& [index, branch] : run.branches) {
    EXPECT_EQ(branch.ids.size(), static_cast<size_t>(kTokens)) << index;
    EXPECT_EQ(branch.finish, v1::FINISH_REASON_LENGTH) << index;
  }
  EXPECT_GT(server.metrics()["deft_engine_steps_total"], *paused);
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0), 0);
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

TEST(FaultInjection, AReaderThatStopsForGoodIsCutAndItsKvFreed) {
  ServerProcess server({"--stream-stall-seconds", "1"});
  ASSERT_TRUE(server.running());
  constexpr int kTokens = 1500;
  const std::shared_ptr<grpc::Channel> channel = small_window_channel(server);
  auto stub = v1::Deft::NewStub(channel);

  // A Generate and a session decode whose client reads one answer, then nothing.
  grpc::ClientContext generate_context;
  auto generate = stub->Generate(&generate_context, long_generate(5, 4, kTokens, 8));
  v1::GenerateResponse generated;
  ASSERT_TRUE(generate->Read(&generated));
  grpc::ClientContext session_context;
  auto session = stub->TreeSession(&session_context);
  v1::SessionRequest create;
  create.set_request_id(1);
  set_ids(create.mutable_create()->mutable_prompt()->mutable_tokens()->mutable_ids(), {1, 6, 6});
  ASSERT_TRUE(session->Write(create));
  v1::SessionResponse answer;
  ASSERT_TRUE(session->Read(&answer));
  v1::SessionRequest decode;
  decode.set_request_id(2);
  decode.mutable_decode()->add_nodes(answer.created_node());
  decode.mutable_decode()->mutable_sampling()->set_max_tokens(kTokens);
  decode.mutable_decode()->mutable_sampling()->set_ignore_eos(true);
  decode.mutable_decode()->mutable_sampling()->set_top_logprobs(20);
  ASSERT_TRUE(session->Write(decode));

  // Both are cut once a write has waited a second, and everything they held is freed.
  EXPECT_TRUE(eventually([&] { return count(server.log(), "cut a stream") == 2; })) << server.log();
  EXPECT_EQ(server.wait_metric("deft_live_jobs", 0, seconds(60)), 0);
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", 0, seconds(60)), 0);
  const std::string log = server.log();
  EXPECT_NE(log.find("Generate: cut a stream"), std::string::npos) << log;
  EXPECT_NE(log.find("TreeSession: cut a stream"), std::string::npos) << log;

  // The clients see their calls cancelled once they read again.
  while (generate->Read(&generated)) {
  }
  EXPECT_EQ(generate->Finish().error_code(), grpc::StatusCode::CANCELLED);
  while (session->Read(&answer)) {
  }
  EXPECT_EQ(session->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(server.serving());
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

}  // namespace
}  // namespace deft::testing
