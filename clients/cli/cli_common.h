// Shared pieces of deft-cli's subcommands: error reporting, option values, sampling flags,
// prompts, and printing of the proto types. deft-cli is a client only: proto stubs, no engine.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"

namespace deft::cli {

namespace v1 = deft::v1;

// The whole usage text (deft-cli --help).
extern const char kUsage[];

// Prints "deft-cli: MESSAGE" and the usage to stderr; returns 2 (usage error).
int usage_error(const std::string& message);
// Prints the failed RPC's code and message to stderr; returns 1.
int rpc_error(const char* rpc, const grpc::Status& status);

const char* finish_name(v1::FinishReason reason);
// google.rpc.Code name ("NOT_FOUND") of a status code number.
const char* code_name(int code);

// Text as given on the command line or in a script: C escapes (\n, \t, \", \\, \x20) are
// understood; a value in double quotes keeps its leading and trailing spaces.
std::optional<std::string> unescape(const std::string& text);
// "1,2,3" -> {1, 2, 3}; nullopt on a malformed list.
std::optional<std::vector<int32_t>> parse_ids(const std::string& text);
std::optional<std::vector<float>> parse_floats(const std::string& text);

// Parses the sampling option at args[*index] (--max-tokens, --temperature, --top-k, --top-p,
// --seed, --top-logprobs, --stop STR, --stop-token ID, --ignore-eos) into `sampling` and moves
// *index to its last argument. kNotSampling: args[*index] is some other argument.
enum class FlagParse { kParsed, kNotSampling, kBadValue };
FlagParse parse_sampling_flag(const std::vector<std::string>& args, size_t* index,
                              v1::SamplingParams* sampling);

// A prompt from a positional TEXT (unescaped; the server adds BOS) or --prompt-ids 1,2,3.
struct PromptArgs {
  std::vector<std::string> text;
  std::optional<std::vector<int32_t>> ids;
};
// Consumes --prompt-ids at args[*index]; false when args[*index] is not that option.
bool parse_prompt_ids_flag(const std::vector<std::string>& args, size_t* index, PromptArgs* prompt,
                           std::string* error);
// The Prompt message, or an error message.
std::optional<v1::Prompt> make_prompt(const PromptArgs& args, std::string* error);

// "\"escaped text\"" for one-line output.
std::string quoted(const std::string& text);

}  // namespace deft::cli
