#include "clients/cli/cli_verify.h"

#include <cstdio>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "clients/cli/cli_session.h"

namespace deft::cli {
namespace {

// --draft-dist ENTRY:TOKEN=PROB,TOKEN=PROB,... (ENTRY -1: the anchor node).
std::optional<v1::DraftDistribution> parse_draft_distribution(const std::string& text) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) return std::nullopt;
  v1::DraftDistribution distribution;
  int32_t entry = 0;
  if (!absl::SimpleAtoi(text.substr(0, colon), &entry)) return std::nullopt;
  distribution.set_entry(entry);
  for (absl::string_view pair : absl::StrSplit(text.substr(colon + 1), ',')) {
    const std::vector<absl::string_view> parts = absl::StrSplit(pair, '=');
    int32_t token = 0;
    float prob = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &token) ||
        !absl::SimpleAtof(parts[1], &prob)) {
      return std::nullopt;
    }
    distribution.add_tokens(token);
    distribution.add_probs(prob);
  }
  return distribution;
}

}  // namespace

std::string parse_verify_args(const std::vector<std::string>& args, size_t start,
                              v1::VerifyCommand* request, PromptArgs* positional) {
  for (size_t i = start; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const FlagParse sampling = parse_sampling_flag(args, &i, request->mutable_sampling());
    if (sampling == FlagParse::kParsed) continue;
    if (sampling == FlagParse::kBadValue) return absl::StrCat("bad or missing value for ", arg);
    if (positional != nullptr) {
      std::string error;
      if (parse_prompt_ids_flag(args, &i, positional, &error)) {
        if (!error.empty()) return error;
        continue;
      }
    }
    if (arg == "--tokens" || arg == "--parents") {
      if (i + 1 >= args.size()) return absl::StrCat(arg, " needs a value");
      const std::optional<std::vector<int32_t>> ids = parse_ids(args[++i]);
      if (!ids) return absl::StrCat("bad value for ", arg, ": '", args[i], "'");
      auto* field = arg == "--tokens" ? request->mutable_tokens() : request->mutable_parents();
      field->Add(ids->begin(), ids->end());
    } else if (arg == "--draft-probs") {
      if (i + 1 >= args.size()) return "--draft-probs needs a value";
      const std::optional<std::vector<float>> probs = parse_floats(args[++i]);
      if (!probs) return absl::StrCat("bad value for --draft-probs: '", args[i], "'");
      request->mutable_draft_probs()->Add(probs->begin(), probs->end());
    } else if (arg == "--draft-dist") {
      if (i + 1 >= args.size()) return "--draft-dist needs a value";
      std::optional<v1::DraftDistribution> distribution = parse_draft_distribution(args[++i]);
      if (!distribution) {
        return absl::StrCat("bad value for --draft-dist: '", args[i],
                            "' (want ENTRY:TOKEN=PROB,TOKEN=PROB,...)");
      }
      *request->add_draft_distributions() = std::move(*distribution);
    } else if (arg == "--draft-sampling") {
      if (i + 1 >= args.size()) return "--draft-sampling needs a value";
      const std::string& value = args[++i];
      if (value == "with") {
        request->set_draft_sampling(v1::DRAFT_SAMPLING_WITH_REPLACEMENT);
      } else if (value == "without") {
        request->set_draft_sampling(v1::DRAFT_SAMPLING_WITHOUT_REPLACEMENT);
      } else {
        return absl::StrCat("bad value for --draft-sampling: '", value, "' (with or without)");
      }
    } else if (positional != nullptr && arg.rfind("--", 0) != 0) {
      positional->text.push_back(arg);
    } else {
      return absl::StrCat("unknown option ", arg);
    }
  }
  return "";
}

void print_verified(const v1::VerifyResponse& verified) {
  std::printf("accepted %s (entries %s)\n", absl::StrJoin(verified.accepted(), " ").c_str(),
              absl::StrJoin(verified.accepted_entries(), " ").c_str());
  std::printf("bonus %d\n", verified.bonus_token());
  std::printf("node %lld\n", static_cast<long long>(verified.node()));
}

int verify_command(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  v1::SessionRequest verify;
  PromptArgs prompt_args;
  const std::string error = parse_verify_args(args, 0, verify.mutable_verify(), &prompt_args);
  if (!error.empty()) return usage_error("verify: " + error);
  std::string prompt_error;
  std::optional<v1::Prompt> prompt = make_prompt(prompt_args, &prompt_error);
  if (!prompt) return usage_error("verify: " + prompt_error);

  // A session on the prompt, the verify under its node, then close: one stream.
  SessionStream stream(stub);
  const auto call = [&stream](v1::SessionRequest request, v1::SessionResponse* answer) {
    const bool answered =
        stream.call(std::move(request), [answer](const v1::SessionResponse& r) { *answer = r; });
    if (answered && answer->has_error()) {
      std::fprintf(stderr, "deft-cli: %s (%d): %s\n", code_name(answer->error().code()),
                   answer->error().code(), answer->error().message().c_str());
    }
    return answered;
  };
  v1::SessionRequest create;
  *create.mutable_create()->mutable_prompt() = std::move(*prompt);
  v1::SessionResponse created;
  if (!call(std::move(create), &created)) return rpc_error("TreeSession", stream.finish());
  int result = created.has_error() ? 1 : 0;
  if (result == 0) {
    std::printf("session %llu: created node %lld\n",
                static_cast<unsigned long long>(stream.session_id()),
                static_cast<long long>(created.created_node()));
    verify.mutable_verify()->set_node(created.created_node());
    v1::SessionResponse verified;
    if (!call(std::move(verify), &verified)) return rpc_error("TreeSession", stream.finish());
    if (verified.has_error()) {
      result = 1;
    } else {
      print_verified(verified.verified());
      // The committed text, for reading (a failure here does not fail the verify).
      v1::DetokenizeRequest detokenize;
      detokenize.mutable_ids()->CopyFrom(verified.verified().accepted());
      detokenize.add_ids(verified.verified().bonus_token());
      grpc::ClientContext text_context;
      v1::DetokenizeResponse text;
      if (stub.Detokenize(&text_context, detokenize, &text).ok()) {
        std::printf("text %s\n", quoted(text.text()).c_str());
      }
    }
  }
  v1::SessionRequest close;
  close.mutable_close();
  stream.call(close, [](const v1::SessionResponse&) {});
  const grpc::Status status = stream.finish();
  if (!status.ok() && result == 0) return rpc_error("TreeSession", status);
  return result;
}

}  // namespace deft::cli
