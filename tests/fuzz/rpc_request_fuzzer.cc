// libFuzzer harness: request validation of every deft.v1.Deft RPC (server/deft_service.h) on
// requests decoded from the fuzz input. The validation lives in the service's handlers, so the
// harness runs the real service: the embedded default model on the CPU backend behind an
// in-process gRPC server (no socket), with limits small enough that an accepted request runs in
// milliseconds (small_limits()).
//
// Input: one byte picks the RPC; for a unary or server-streaming RPC the rest is the request's
// protobuf encoding; for TreeSession it is up to 8 length-prefixed SessionRequest encodings
// (tests/fuzz/fuzz_input.h take_bytes), sent in order on one stream, then a half-close. Bytes
// that do not parse as the request are skipped (Debian has no libprotobuf-mutator; libFuzzer's
// byte mutations of the committed encodings still reach every field). Half of the mutations are
// structural (LLVMFuzzerCustomMutator, tests/fuzz/proto_mutator.h): the request, or one command
// of a session, is decoded, one of its fields gets an edge value, and it is encoded again.
//
// Contracts checked (DESIGN.md "Bad input and faults"): every call ends with OK or a client-error
// status (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED),
// never INTERNAL, UNKNOWN, UNAVAILABLE or a missed deadline; every `error` a session answers
// carries such a code; and the service keeps answering.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "deft/v1/deft.grpc.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "models/default_model.h"
#include "models/llama_cpu.h"
#include "models/model_config.h"
#include "server/auth.h"
#include "server/deft_service.h"
#include "server/engine_thread.h"
#include "server/server_config.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/proto_mutator.h"
#include "tests/testing/client_error_codes.h"

namespace {

namespace v1 = deft::v1;
using deft::testing::client_error_or_ok;

// A call that takes longer is a hang: an accepted request under these limits needs well under
// a second even under ASan.
constexpr std::chrono::seconds kCallDeadline{20};
constexpr size_t kMaxSessionRequests = 8;
constexpr size_t kMaxSessionRequestBytes = 4096;

// Prompts of a few dozen tokens and outputs of a few: the CPU forward pass under ASan and the
// fuzzer's instrumentation costs milliseconds per token, and the limits' edges are what the
// validation is about.
deft::server::ServerConfig small_limits() {
  deft::server::ServerConfig config;
  config.kv_pages = 64;
  config.page_tokens = 16;
  config.max_queued_jobs = 4;
  config.max_tree_tokens = 96;
  config.max_prompt_tokens = 24;
  config.max_branches = 3;
  config.default_max_tokens = 2;
  config.max_step_tokens = 96;
  config.max_text_bytes = 512;
  config.max_stop_sequences = 3;
  config.max_sessions = 4;
  config.max_session_nodes = 16;
  config.max_verify_entries = 8;
  return config;
}

// The service and everything it runs on, made once per process.
struct Harness {
  deft::server::ServerConfig config = small_limits();
  deft::server::Authenticator auth;  // no keys: every caller is let in
  std::unique_ptr<deft::engine::Tokenizer> tokenizer;
  std::unique_ptr<deft::server::EngineThread> engine;
  std::unique_ptr<deft::server::DeftService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Deft::Stub> stub;

  Harness() {
    spdlog::set_level(spdlog::level::off);
    const std::filesystem::path dir = deft::models::default_model_dir();
    absl::StatusOr<deft::models::ModelConfig> model = deft::models::load_model_config(dir);
    FUZZ_CHECK(model.ok(), model.status().ToString());
    absl::StatusOr<std::unique_ptr<deft::engine::Tokenizer>> loaded =
        deft::engine::load_tokenizer(dir.string());
    FUZZ_CHECK(loaded.ok(), loaded.status().ToString());
    tokenizer = std::move(*loaded);
    if (tokenizer->eos_ids().empty()) tokenizer->set_eos_ids(model->eos_token_ids);
    absl::StatusOr<std::unique_ptr<deft::models::LlamaCpuRunner>> runner =
        deft::models::LlamaCpuRunner::load(dir, int64_t{config.kv_pages} * config.page_tokens);
    FUZZ_CHECK(runner.ok(), runner.status().ToString());
    deft::engine::SchedulerOptions options{
        .page_tokens = config.page_tokens,
        .kv_pages = config.kv_pages,
        .max_queued_works = config.max_queued_jobs,
        .max_step_tokens = config.max_step_tokens,
        .first_node_id = config.first_node_id,
        .sessions = {.max_sessions = config.max_sessions,
                     .max_nodes = config.max_session_nodes,
                     .max_branches = config.max_branches,
                     .max_verify_entries = config.max_verify_entries,
                     .max_context = model->max_position_embeddings},
    };
    options.planner.min_prefill_run = config.min_prefill_run;
    absl::StatusOr<std::unique_ptr<deft::server::EngineThread>> started =
        deft::server::EngineThread::start(options, std::move(*runner), *tokenizer, nullptr);
    FUZZ_CHECK(started.ok(), started.status().ToString());
    engine = std::move(*started);
    service = std::make_unique<deft::server::DeftService>(config, auth, nullptr);
    service->attach({.name = "default",
                     .architecture = model->architecture,
                     .vocab_size = model->vocab_size,
                     .max_context = model->max_position_embeddings,
                     .num_layers = model->num_hidden_layers,
                     .hidden_size = model->hidden_size,
                     .num_q_heads = model->num_attention_heads,
                     .num_kv_heads = model->num_key_value_heads,
                     .dtype = "bf16",
                     .backend = "cpu"},
                    *tokenizer, *engine);
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    FUZZ_CHECK(server != nullptr, "in-process gRPC server did not start");
    stub = v1::Deft::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  }
};

Harness& harness() {
  static Harness* instance = new Harness();  // never destroyed: libFuzzer exits from anywhere
  return *instance;
}

void check_status(const char* rpc, const grpc::Status& status) {
  FUZZ_CHECK(client_error_or_ok(status.error_code()),
             absl::StrCat(rpc, " answered code ", static_cast<int>(status.error_code()), ": ",
                          status.error_message()));
}

constexpr int kRpcs = 7;  // the first byte's choice, in LLVMFuzzerTestOneInput's order
constexpr int kTreeSessionRpc = 2;

// A message of the request type of RPC `rpc` (not TreeSession).
std::unique_ptr<google::protobuf::Message> request_of(int rpc) {
  switch (rpc) {
    case 0:
      return std::make_unique<v1::GenerateRequest>();
    case 1:
      return std::make_unique<v1::RunTreeRequest>();
    case 3:
      return std::make_unique<v1::VerifyRequest>();
    case 4:
      return std::make_unique<v1::TokenizeRequest>();
    case 5:
      return std::make_unique<v1::DetokenizeRequest>();
    default:
      return std::make_unique<v1::ModelInfoRequest>();
  }
}

// A session command's length as FuzzInput::take_bytes(kMaxSessionRequestBytes) reads it back:
// two bytes, high first.
void append_session_request(const std::string& bytes, std::string* out) {
  out->push_back(static_cast<char>(bytes.size() >> 8));
  out->push_back(static_cast<char>(bytes.size() & 0xff));
  *out += bytes;
}

void set_deadline(grpc::ClientContext& context) {
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
}

template <typename Request>
bool parse(const std::string& bytes, Request& request) {
  return request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
}

template <typename Request, typename Response, typename Call>
void server_streaming(const char* rpc, const std::string& bytes, Call call) {
  Request request;
  if (!parse(bytes, request)) return;
  grpc::ClientContext context;
  set_deadline(context);
  std::unique_ptr<grpc::ClientReader<Response>> reader = call(&context, request);
  Response response;
  while (reader->Read(&response)) {
  }
  check_status(rpc, reader->Finish());
}

template <typename Request, typename Response, typename Call>
void unary(const char* rpc, const std::string& bytes, Call call) {
  Request request;
  if (!parse(bytes, request)) return;
  grpc::ClientContext context;
  set_deadline(context);
  Response response;
  check_status(rpc, call(&context, request, &response));
}

void tree_session(deft::fuzz::FuzzInput& input, v1::Deft::Stub& stub) {
  std::vector<v1::SessionRequest> requests;
  while (!input.empty() && requests.size() < kMaxSessionRequests) {
    v1::SessionRequest request;
    if (parse(input.take_bytes(kMaxSessionRequestBytes), request)) requests.push_back(request);
  }
  grpc::ClientContext context;
  set_deadline(context);
  auto stream = stub.TreeSession(&context);
  // Nothing after a `close`: the server reads no further (deft.proto), and the in-process
  // transport buffers nothing, so a write it never reads would block this thread, which reads
  // the answers only after writing, while the server blocks writing them: a deadlock of the
  // harness's making, not of the server's (a real client's writes fail once the call ends).
  for (const v1::SessionRequest& request : requests) {
    if (!stream->Write(request) || request.has_close()) break;
  }
  stream->WritesDone();
  v1::SessionResponse response;
  while (stream->Read(&response)) {
    if (response.has_error()) {
      FUZZ_CHECK(client_error_or_ok(static_cast<grpc::StatusCode>(response.error().code())) &&
                     response.error().code() != 0,
                 absl::StrCat("session error code ", response.error().code(), ": ",
                              response.error().message()));
    }
  }
  check_status("TreeSession", stream->Finish());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  harness();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Deft::Stub& stub = *harness().stub;
  deft::fuzz::FuzzInput input(data, size);
  switch (input.take_index(kRpcs)) {
    case 0:
      server_streaming<v1::GenerateRequest, v1::GenerateResponse>(
          "Generate", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::GenerateRequest& request) {
            return stub.Generate(context, request);
          });
      break;
    case 1:
      server_streaming<v1::RunTreeRequest, v1::TreeEvent>(
          "RunTree", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::RunTreeRequest& request) {
            return stub.RunTree(context, request);
          });
      break;
    case kTreeSessionRpc:
      tree_session(input, stub);
      break;
    case 3:
      unary<v1::VerifyRequest, v1::VerifyResponse>(
          "Verify", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::VerifyRequest& request,
              v1::VerifyResponse* response) { return stub.Verify(context, request, response); });
      break;
    case 4:
      unary<v1::TokenizeRequest, v1::TokenizeResponse>(
          "Tokenize", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::TokenizeRequest& request,
              v1::TokenizeResponse* response) {
            return stub.Tokenize(context, request, response);
          });
      break;
    case 5:
      unary<v1::DetokenizeRequest, v1::DetokenizeResponse>(
          "Detokenize", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::DetokenizeRequest& request,
              v1::DetokenizeResponse* response) {
            return stub.Detokenize(context, request, response);
          });
      break;
    case 6:
      unary<v1::ModelInfoRequest, v1::ModelInfoResponse>(
          "ModelInfo", input.take_rest(),
          [&](grpc::ClientContext* context, const v1::ModelInfoRequest& request,
              v1::ModelInfoResponse* response) {
            return stub.ModelInfo(context, request, response);
          });
      break;
  }
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  std::mt19937 rng(seed);
  if (size == 0 || rng() % 2 == 0) return LLVMFuzzerMutate(data, size, max_size);
  deft::fuzz::FuzzInput input(data, size);
  const auto rpc = static_cast<int>(input.take_index(kRpcs));
  std::string out(1, static_cast<char>(data[0]));
  if (rpc == kTreeSessionRpc) {
    std::vector<std::string> commands;
    while (!input.empty() && commands.size() < kMaxSessionRequests) {
      commands.push_back(input.take_bytes(kMaxSessionRequestBytes));
    }
    if (commands.empty()) commands.emplace_back();
    std::string& command = commands[rng() % commands.size()];
    v1::SessionRequest request;
    if (!request.ParseFromString(command)) return LLVMFuzzerMutate(data, size, max_size);
    switch (rng() % 4) {
      case 0:  // one more command: a copy of this one, mutated
        deft::fuzz::mutate_message(request, rng);
        if (commands.size() < kMaxSessionRequests) commands.push_back(request.SerializeAsString());
        break;
      case 1:  // one command fewer
        if (commands.size() > 1) commands.erase(commands.begin() + (&command - commands.data()));
        break;
      default:
        deft::fuzz::mutate_message(request, rng);
        command = request.SerializeAsString();
    }
    for (const std::string& bytes : commands) {
      if (bytes.size() > kMaxSessionRequestBytes) return LLVMFuzzerMutate(data, size, max_size);
      append_session_request(bytes, &out);
    }
  } else {
    std::unique_ptr<google::protobuf::Message> request = request_of(rpc);
    if (!request->ParseFromString(input.take_rest())) {
      return LLVMFuzzerMutate(data, size, max_size);
    }
    deft::fuzz::mutate_message(*request, rng);
    out += request->SerializeAsString();
  }
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}
