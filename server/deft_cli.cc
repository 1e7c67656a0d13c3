// deft-cli: a command-line client of deft-server.
//
//   deft-cli [--server HOST:PORT] info
//   deft-cli [--server HOST:PORT] health
//   deft-cli [--server HOST:PORT] tokenize [--bos] TEXT
//   deft-cli [--server HOST:PORT] detokenize ID...
//   deft-cli [--server HOST:PORT] generate [--n N] [--max-tokens M] [--temperature T]
//            [--top-k K] [--top-p P] [--seed S] [--stop STR]... [--ignore-eos] PROMPT
//
// Exit 0 on success, 1 when the server answers with an error (its code and message printed),
// 2 on a usage error.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deft/v1/deft.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace {

namespace v1 = deft::v1;

const char kUsage[] =
    "usage: deft-cli [--server HOST:PORT] COMMAND [ARGS]\n"
    "  --server HOST:PORT   deft-server address (default 127.0.0.1:50051)\n"
    "commands:\n"
    "  info                 the model and the server's limits (ModelInfo)\n"
    "  health               the grpc.health.v1 status\n"
    "  tokenize [--bos] TEXT\n"
    "  detokenize ID...\n"
    "  generate [--n N] [--max-tokens M] [--temperature T] [--top-k K] [--top-p P]\n"
    "           [--seed S] [--stop STR]... [--ignore-eos] PROMPT\n"
    "           n samples from one prompt; each branch's text streams as it is decoded and\n"
    "           is printed whole at the end\n";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "deft-cli: %s\n%s", message.c_str(), kUsage);
  return 2;
}

int rpc_error(const char* rpc, const grpc::Status& status) {
  std::fprintf(stderr, "deft-cli: %s failed: code %d: %s\n", rpc,
               static_cast<int>(status.error_code()), status.error_message().c_str());
  return 1;
}

const char* finish_name(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_PRUNED:
      return "pruned";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "?";
  }
}

int info(v1::Deft::Stub& stub) {
  grpc::ClientContext context;
  v1::ModelInfoResponse response;
  const grpc::Status status = stub.ModelInfo(&context, v1::ModelInfoRequest(), &response);
  if (!status.ok()) return rpc_error("ModelInfo", status);
  std::printf("%s", response.DebugString().c_str());
  return 0;
}

int health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status =
      stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return rpc_error("Health.Check", status);
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int tokenize(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  v1::TokenizeRequest request;
  std::vector<std::string> text;
  for (const std::string& arg : args) {
    if (arg == "--bos") {
      request.set_add_bos(true);
    } else {
      text.push_back(arg);
    }
  }
  if (text.size() != 1) return usage_error("tokenize takes one TEXT argument");
  request.set_text(text[0]);
  grpc::ClientContext context;
  v1::TokenizeResponse response;
  const grpc::Status status = stub.Tokenize(&context, request, &response);
  if (!status.ok()) return rpc_error("Tokenize", status);
  std::printf("%s\n", absl::StrJoin(response.ids(), " ").c_str());
  return 0;
}

int detokenize(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  v1::DetokenizeRequest request;
  for (const std::string& arg : args) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(arg, &id)) return usage_error(absl::StrCat("bad token id '", arg, "'"));
    request.add_ids(id);
  }
  grpc::ClientContext context;
  v1::DetokenizeResponse response;
  const grpc::Status status = stub.Detokenize(&context, request, &response);
  if (!status.ok()) return rpc_error("Detokenize", status);
  std::printf("%s\n", response.text().c_str());
  return 0;
}

int generate(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  v1::GenerateRequest request;
  request.set_n(1);
  v1::SamplingParams* sampling = request.mutable_sampling();
  std::vector<std::string> prompt;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const bool has_value = i + 1 < args.size();
    bool ok = true;
    if (arg == "--n" && has_value) {
      int32_t n = 0;
      ok = absl::SimpleAtoi(args[++i], &n);
      request.set_n(n);
    } else if (arg == "--max-tokens" && has_value) {
      int32_t value = 0;
      ok = absl::SimpleAtoi(args[++i], &value);
      sampling->set_max_tokens(value);
    } else if (arg == "--temperature" && has_value) {
      float value = 0;
      ok = absl::SimpleAtof(args[++i], &value);
      sampling->set_temperature(value);
    } else if (arg == "--top-k" && has_value) {
      int32_t value = 0;
      ok = absl::SimpleAtoi(args[++i], &value);
      sampling->set_top_k(value);
    } else if (arg == "--top-p" && has_value) {
      float value = 0;
      ok = absl::SimpleAtof(args[++i], &value);
      sampling->set_top_p(value);
    } else if (arg == "--seed" && has_value) {
      uint64_t value = 0;
      ok = absl::SimpleAtoi(args[++i], &value);
      sampling->set_seed(value);
    } else if (arg == "--ignore-eos") {
      sampling->set_ignore_eos(true);
    } else if (arg == "--stop" && has_value) {
      sampling->add_stop(args[++i]);
    } else if (arg.rfind("--", 0) == 0) {
      return usage_error(absl::StrCat("generate: unknown or incomplete option ", arg));
    } else {
      prompt.push_back(arg);
    }
    if (!ok) return usage_error(absl::StrCat("generate: bad value for ", arg));
  }
  if (prompt.size() != 1) return usage_error("generate takes one PROMPT argument");
  request.mutable_prompt()->set_text(prompt[0]);

  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  std::map<int32_t, std::string> texts;
  std::map<int32_t, std::string> finish;
  std::map<int32_t, int32_t> tokens;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    texts[response.branch()] += response.delta().text();
    tokens[response.branch()] += response.delta().ids_size();
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finish[response.branch()] = finish_name(response.finish_reason());
    }
    if (request.n() == 1) {
      std::fputs(response.delta().text().c_str(), stdout);
      std::fflush(stdout);
    }
  }
  const grpc::Status status = reader->Finish();
  if (request.n() == 1) std::fputs("\n", stdout);
  if (!status.ok()) return rpc_error("Generate", status);
  for (const auto& [branch, text] : texts) {
    std::printf("[branch %d, %d tokens, %s] %s\n", branch, tokens[branch], finish[branch].c_str(),
                text.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string server = "127.0.0.1:50051";
  while (!args.empty() && args[0].rfind("--", 0) == 0) {
    if (args[0] == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (args[0] != "--server" || args.size() < 2) {
      return usage_error(absl::StrCat("unknown option ", args[0]));
    }
    server = args[1];
    args.erase(args.begin(), args.begin() + 2);
  }
  if (args.empty()) return usage_error("no command");
  const std::string command = args[0];
  args.erase(args.begin());

  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(server, grpc::InsecureChannelCredentials());
  auto stub = v1::Deft::NewStub(channel);
  if (command == "info") return info(*stub);
  if (command == "health") return health(channel);
  if (command == "tokenize") return tokenize(*stub, args);
  if (command == "detokenize") return detokenize(*stub, args);
  if (command == "generate") return generate(*stub, args);
  return usage_error(absl::StrCat("unknown command '", command, "'"));
}
