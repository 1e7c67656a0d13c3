#include "clients/cli/cli_tree.h"

#include <cstdio>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/cli/cli_common.h"

namespace deft::cli {
namespace {

void print_event(const v1::TreeEvent& event) {
  switch (event.event_case()) {
    case v1::TreeEvent::kNodeCreated: {
      const v1::TreeNodeInfo& node = event.node_created();
      std::printf("created node %lld (parent %lld, depth %d)\n",
                  static_cast<long long>(node.node()), static_cast<long long>(node.parent()),
                  node.depth());
      break;
    }
    case v1::TreeEvent::kTokens: {
      const v1::NodeTokens& tokens = event.tokens();
      std::printf("tokens node %lld +%d %s%s%s\n", static_cast<long long>(tokens.node()),
                  tokens.delta().ids_size(), quoted(tokens.delta().text()).c_str(),
                  tokens.finish_reason() == v1::FINISH_REASON_UNSPECIFIED ? "" : " finish=",
                  tokens.finish_reason() == v1::FINISH_REASON_UNSPECIFIED
                      ? ""
                      : finish_name(tokens.finish_reason()));
      break;
    }
    case v1::TreeEvent::kPruned:
      std::printf("pruned node %lld\n", static_cast<long long>(event.pruned()));
      break;
    case v1::TreeEvent::kFinished:
      std::printf("finished\n");
      break;
    case v1::TreeEvent::EVENT_NOT_SET:
      std::printf("(empty event)\n");
      break;
  }
}

void print_result(const v1::TreeResult& result) {
  for (const v1::TreeNodeInfo& node : result.nodes()) {
    std::printf("node %lld parent %lld depth %d score %.4f finish %s tokens %d %s\n",
                static_cast<long long>(node.node()), static_cast<long long>(node.parent()),
                node.depth(), node.score(), finish_name(node.finish_reason()),
                node.tokens().ids_size(), quoted(node.tokens().text()).c_str());
  }
  std::printf("best path: %s\n", absl::StrJoin(result.best_path(), " ").c_str());
  std::printf("best text: %s\n", quoted(result.best_text()).c_str());
}

}  // namespace

int tree_command(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  v1::RunTreeRequest request;
  v1::BranchPolicy* policy = request.mutable_policy();
  // Without flags the job still makes a tree: 2 ways, every 16 tokens, two levels deep.
  policy->set_branch_factor(2);
  policy->set_max_depth(2);
  PromptArgs prompt_args;
  bool quiet = false;
  int triggers = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    std::string error;
    const FlagParse sampling = parse_sampling_flag(args, &i, request.mutable_sampling());
    if (sampling == FlagParse::kParsed) continue;
    if (sampling == FlagParse::kBadValue) {
      return usage_error(absl::StrCat("tree: bad or missing value for ", arg));
    }
    if (parse_prompt_ids_flag(args, &i, &prompt_args, &error)) {
      if (!error.empty()) return usage_error("tree: " + error);
      continue;
    }
    if (arg == "--quiet") {
      quiet = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      prompt_args.text.push_back(arg);
      continue;
    }
    if (i + 1 >= args.size()) return usage_error(absl::StrCat("tree: ", arg, " needs a value"));
    const std::string& value = args[++i];
    int32_t number = 0;
    const bool is_number = absl::SimpleAtoi(value, &number);
    bool ok = is_number;
    if (arg == "--branch-factor") {
      policy->set_branch_factor(number);
    } else if (arg == "--every-tokens") {
      policy->set_every_tokens(number);
      ++triggers;
    } else if (arg == "--step-end-token") {
      policy->set_step_end_token(number);
      ++triggers;
    } else if (arg == "--delimiter") {
      const std::optional<std::string> delimiter = unescape(value);
      ok = delimiter.has_value();
      if (ok) policy->set_delimiter(*delimiter);
      ++triggers;
    } else if (arg == "--max-depth") {
      policy->set_max_depth(number);
    } else if (arg == "--keep-best") {
      policy->set_keep_best(number);
    } else if (arg == "--score") {
      ok = value == "cumulative" || value == "mean";
      policy->set_score(value == "mean" ? v1::BranchPolicy::SCORE_MEAN_LOGPROB
                                        : v1::BranchPolicy::SCORE_CUMULATIVE_LOGPROB);
    } else {
      return usage_error(absl::StrCat("tree: unknown option ", arg));
    }
    if (!ok) return usage_error(absl::StrCat("tree: bad value for ", arg, ": '", value, "'"));
  }
  if (triggers > 1) {
    return usage_error("tree: give one of --every-tokens, --delimiter, --step-end-token");
  }
  std::string error;
  std::optional<v1::Prompt> prompt = make_prompt(prompt_args, &error);
  if (!prompt) return usage_error("tree: " + error);
  *request.mutable_prompt() = std::move(*prompt);

  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::TreeEvent>> reader = stub.RunTree(&context, request);
  v1::TreeEvent event;
  std::optional<v1::TreeResult> result;
  while (reader->Read(&event)) {
    if (!quiet) print_event(event);
    if (event.has_finished()) result = event.finished();
    std::fflush(stdout);
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return rpc_error("RunTree", status);
  if (!result) {
    std::fprintf(stderr, "deft-cli: RunTree ended without a finished event\n");
    return 1;
  }
  print_result(*result);
  return 0;
}

}  // namespace deft::cli
