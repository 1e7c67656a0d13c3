// deft-cli: a command-line client of deft-server (`deft-cli --help` lists the commands).
//
//   deft-cli [CONNECTION] info | health | tokenize | detokenize | generate
//   CONNECTION: --server HOST:PORT (else $DEFT_SERVER), --tls, --tls-ca FILE, --tls-cert FILE
//   --tls-key FILE,
//               --api-key KEY (else $DEFT_API_KEY); cli_channel.{h,cc}
//   deft-cli [--server HOST:PORT] tree [POLICY] [SAMPLING] PROMPT      (RunTree)
//   deft-cli [--server HOST:PORT] session [SCRIPT]                     (TreeSession)
//   deft-cli [--server HOST:PORT] verify --tokens ... --parents ... PROMPT  (Verify)
//
// The tree, session and verify commands live in cli_tree.cc, cli_session.cc, cli_verify.cc;
// shared flag parsing and printing in cli_common.cc.
// Exit 0 on success, 1 when the server answers with an error (its code and message printed),
// 2 on a usage error.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "clients/cli/cli_channel.h"
#include "clients/cli/cli_common.h"
#include "clients/cli/cli_session.h"
#include "clients/cli/cli_tree.h"
#include "clients/cli/cli_verify.h"
#include "deft/v1/deft.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace {

namespace v1 = deft::v1;
namespace cli = deft::cli;
using deft::cli::finish_name;
using deft::cli::rpc_error;
using deft::cli::usage_error;

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
  cli::PromptArgs prompt_args;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    std::string error;
    const cli::FlagParse sampling = cli::parse_sampling_flag(args, &i, request.mutable_sampling());
    if (sampling == cli::FlagParse::kParsed) continue;
    if (sampling == cli::FlagParse::kBadValue) {
      return usage_error(absl::StrCat("generate: bad or missing value for ", arg));
    }
    if (cli::parse_prompt_ids_flag(args, &i, &prompt_args, &error)) {
      if (!error.empty()) return usage_error("generate: " + error);
      continue;
    }
    if (arg == "--n" && i + 1 < args.size()) {
      int32_t n = 0;
      if (!absl::SimpleAtoi(args[++i], &n)) return usage_error("generate: bad value for --n");
      request.set_n(n);
    } else if (arg == "--speculative" && i + 1 < args.size()) {
      const std::string& policy = args[++i];
      v1::SpeculativeOptions::Policy value = v1::SpeculativeOptions::POLICY_OFF;
      if (policy == "static")
        value = v1::SpeculativeOptions::POLICY_STATIC_TREE;
      else if (policy == "dynamic")
        value = v1::SpeculativeOptions::POLICY_DYNAMIC_TREE;
      else if (policy == "ngram")
        value = v1::SpeculativeOptions::POLICY_NGRAM;
      else if (policy != "off") {
        return usage_error("generate: --speculative takes static, dynamic, ngram or off");
      }
      request.mutable_speculative()->set_policy(value);
    } else if ((arg == "--tree-tokens" || arg == "--depth") && i + 1 < args.size()) {
      int32_t number = 0;
      if (!absl::SimpleAtoi(args[++i], &number)) {
        return usage_error(absl::StrCat("generate: bad value for ", arg));
      }
      if (arg == "--tree-tokens") request.mutable_speculative()->set_tree_tokens(number);
      if (arg == "--depth") request.mutable_speculative()->set_depth(number);
    } else if (arg.rfind("--", 0) == 0) {
      return usage_error(absl::StrCat("generate: unknown or incomplete option ", arg));
    } else {
      prompt_args.text.push_back(arg);
    }
  }
  std::string error;
  std::optional<v1::Prompt> prompt = cli::make_prompt(prompt_args, &error);
  if (!prompt) return usage_error("generate: " + error);
  *request.mutable_prompt() = std::move(*prompt);

  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  std::map<int32_t, std::string> texts;
  std::map<int32_t, std::string> finish;
  std::map<int32_t, int32_t> tokens;
  std::map<int32_t, v1::SpeculativeStats> speculation;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    texts[response.branch()] += response.delta().text();
    tokens[response.branch()] += response.delta().ids_size();
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finish[response.branch()] = finish_name(response.finish_reason());
      if (response.has_speculative()) speculation[response.branch()] = response.speculative();
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
    std::string spec;
    if (auto it = speculation.find(branch); it != speculation.end() && it->second.steps() > 0) {
      spec = absl::StrFormat(
          ", speculative: %d of %d drafted tokens accepted in %d steps, %.2f "
          "tokens a step",
          it->second.accepted(), it->second.drafted(), it->second.steps(),
          1.0 + static_cast<double>(it->second.accepted()) / it->second.steps());
    }
    std::printf("[branch %d, %d tokens, %s%s] %s\n", branch, tokens[branch], finish[branch].c_str(),
                spec.c_str(), text.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  cli::ChannelOptions channel_options;
  if (const char* key = std::getenv("DEFT_API_KEY"); key != nullptr) channel_options.api_key = key;
  if (const char* server = std::getenv("DEFT_SERVER"); server != nullptr && *server != '\0') {
    channel_options.server = server;  // --server still wins
  }
  size_t first = 0;
  for (; first < args.size() && args[first].rfind("--", 0) == 0; ++first) {
    if (args[first] == "--help") {
      std::fputs(cli::kUsage, stdout);
      return 0;
    }
    const cli::ChannelFlag flag = cli::parse_channel_flag(args, &first, &channel_options);
    if (flag == cli::ChannelFlag::kMissingValue) {
      return usage_error(absl::StrCat("option ", args[first], " needs a value"));
    }
    if (flag == cli::ChannelFlag::kNotChannel) {
      return usage_error(absl::StrCat("unknown option ", args[first]));
    }
  }
  args.erase(args.begin(), args.begin() + static_cast<std::ptrdiff_t>(first));
  if (args.empty()) return usage_error("no command");
  const std::string command = args[0];
  args.erase(args.begin());
  for (const std::string& arg : args) {
    if (arg == "--help") {
      std::fputs(cli::kUsage, stdout);
      return 0;
    }
  }

  std::string channel_error;
  std::shared_ptr<grpc::Channel> channel = cli::make_channel(channel_options, &channel_error);
  if (channel == nullptr) {
    std::fprintf(stderr, "deft-cli: %s\n", channel_error.c_str());
    return 2;
  }
  auto stub = v1::Deft::NewStub(channel);
  if (command == "info") return info(*stub);
  if (command == "health") return health(channel);
  if (command == "tokenize") return tokenize(*stub, args);
  if (command == "detokenize") return detokenize(*stub, args);
  if (command == "generate") return generate(*stub, args);
  if (command == "tree") return cli::tree_command(*stub, args);
  if (command == "session") return cli::session_command(*stub, args);
  if (command == "verify") return cli::verify_command(*stub, args);
  return usage_error(absl::StrCat("unknown command '", command, "'"));
}
