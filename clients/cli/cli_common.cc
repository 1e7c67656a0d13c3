#include "clients/cli/cli_common.h"

#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace deft::cli {

const char kUsage[] =
    "usage: deft-cli [--server HOST:PORT] [TLS] [--api-key KEY] COMMAND [ARGS]\n"
    "  --server HOST:PORT   deft-server address (default: $DEFT_SERVER, else 127.0.0.1:50051)\n"
    "  --tls                TLS, trusting the system's CA certificates\n"
    "  --tls-ca FILE        TLS, trusting the PEM CA certificates in FILE\n"
    "  --tls-cert FILE --tls-key FILE\n"
    "                       TLS with this PEM client certificate and key (mutual TLS)\n"
    "  --api-key KEY        sent as 'authorization: Bearer KEY' (default: $DEFT_API_KEY)\n"
    "commands:\n"
    "  info                 the model and the server's limits (ModelInfo)\n"
    "  health               the grpc.health.v1 status\n"
    "  tokenize [--bos] TEXT\n"
    "  detokenize ID...\n"
    "  generate [SAMPLING] [--n N] [--speculative static|dynamic|ngram [--tree-tokens T]\n"
    "           [--depth D]] PROMPT\n"
    "           n samples from one prompt; each branch's text streams as it is decoded and\n"
    "           is printed whole at the end; --speculative: the server drafts token trees\n"
    "           (static and dynamic need its --draft-model) and verifies them, same tokens\n"
    "  tree [SAMPLING] [--branch-factor K] [--every-tokens N | --delimiter STR |\n"
    "       --step-end-token ID] [--max-depth D] [--score cumulative|mean] [--keep-best W]\n"
    "       [--quiet] PROMPT\n"
    "           a server-side tree job (RunTree): prints each event (created, tokens, pruned),\n"
    "           defaults: --branch-factor 2, --every-tokens 16, --max-depth 2 (a tree);\n"
    "           then every node of the final tree and the best path; --max-tokens counts the\n"
    "           new tokens of a root-to-leaf path; --quiet prints only the final tree\n"
    "  session [SCRIPT]\n"
    "           scripts a TreeSession from SCRIPT (or stdin when absent or -), one command a\n"
    "           line, each answered before the next is sent; every response is printed:\n"
    "             create TEXT | create --ids 1,2,3        a root node holding the prompt\n"
    "             extend NODE TEXT | extend NODE --ids ..  append to a leaf (no BOS)\n"
    "             decode NODE[,NODE...] MAX_TOKENS [SAMPLING]\n"
    "             branch NODE K                           K empty children\n"
    "             prune NODE                              drop a subtree\n"
    "             score NODE TEXT | score NODE --ids ...  logprob of a continuation\n"
    "             verify NODE --tokens ... --parents ... [DRAFT] [SAMPLING]\n"
    "             close\n"
    "           NODE is a node id or $K, the K-th node id the session returned to this\n"
    "           script (created nodes, branch children, verify leaves; $0 the first);\n"
    "           blank lines and lines starting with # are skipped; TEXT is the rest of the\n"
    "           line after one space; exit 1 when any command got an error\n"
    "  verify --tokens ID,... --parents P,... [DRAFT] [SAMPLING] PROMPT\n"
    "           creates a session holding PROMPT, verifies the drafted token tree under it\n"
    "           (parents[i]: the entry token i hangs under, -1 = the prompt), prints the\n"
    "           accepted tokens and the bonus token, and closes the session\n"
    "DRAFT: what the draft knew (README, Verify); without it the target samples each level\n"
    "  --draft-probs P,...             each drafted token's probability (exact for\n"
    "                                  deterministic drafts only)\n"
    "  --draft-dist ENTRY:TOKEN=P,...  the distribution the children of ENTRY (-1: the\n"
    "                                  anchor) were sampled from; one flag per node\n"
    "  --draft-sampling with|without   how: with or without replacement (needed with\n"
    "                                  --draft-dist)\n"
    "PROMPT: TEXT (the server tokenizes it and adds BOS) or --prompt-ids ID,ID,...\n"
    "SAMPLING: [--max-tokens M] [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
    "          [--top-logprobs N] [--stop STR]... [--stop-token ID]... [--ignore-eos]\n"
    "          (temperature 0, the default, is greedy)\n"
    "TEXT and STR understand C escapes (\\n, \\t, \\x20, \\\\); \"quoted\" text keeps its spaces.\n"
    "Exit 0 on success, 1 when the server answers with an error (its code and message\n"
    "printed), 2 on a usage error.\n";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "deft-cli: %s\n%s", message.c_str(), kUsage);
  return 2;
}

int rpc_error(const char* rpc, const grpc::Status& status) {
  std::fprintf(stderr, "deft-cli: %s failed: code %d (%s): %s\n", rpc,
               static_cast<int>(status.error_code()), code_name(status.error_code()),
               status.error_message().c_str());
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
      return "-";
  }
}

const char* code_name(int code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(std::size(kNames))) return "?";
  return kNames[code];
}

std::optional<std::string> unescape(const std::string& text) {
  std::string body = text;
  if (body.size() >= 2 && body.front() == '"' && body.back() == '"') {
    body = body.substr(1, body.size() - 2);
  }
  std::string out;
  if (!absl::CUnescape(body, &out)) return std::nullopt;
  return out;
}

std::optional<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) return std::nullopt;
    ids.push_back(id);
  }
  return ids;
}

std::optional<std::vector<float>> parse_floats(const std::string& text) {
  std::vector<float> values;
  if (text.empty()) return values;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    float value = 0;
    if (!absl::SimpleAtof(part, &value)) return std::nullopt;
    values.push_back(value);
  }
  return values;
}

FlagParse parse_sampling_flag(const std::vector<std::string>& args, size_t* index,
                              v1::SamplingParams* sampling) {
  const std::string& flag = args[*index];
  if (flag == "--ignore-eos") {
    sampling->set_ignore_eos(true);
    return FlagParse::kParsed;
  }
  static const char* const kValued[] = {"--max-tokens", "--temperature", "--top-k",
                                        "--top-p",      "--seed",        "--top-logprobs",
                                        "--stop",       "--stop-token"};
  bool known = false;
  for (const char* name : kValued) known = known || flag == name;
  if (!known) return FlagParse::kNotSampling;
  if (*index + 1 >= args.size()) return FlagParse::kBadValue;
  const std::string& value = args[++*index];
  bool ok = true;
  if (flag == "--max-tokens" || flag == "--top-k" || flag == "--top-logprobs" ||
      flag == "--stop-token") {
    int32_t number = 0;
    ok = absl::SimpleAtoi(value, &number);
    if (flag == "--max-tokens") sampling->set_max_tokens(number);
    if (flag == "--top-k") sampling->set_top_k(number);
    if (flag == "--top-logprobs") sampling->set_top_logprobs(number);
    if (flag == "--stop-token") sampling->add_stop_token_ids(number);
  } else if (flag == "--temperature" || flag == "--top-p") {
    float number = 0;
    ok = absl::SimpleAtof(value, &number);
    if (flag == "--temperature") sampling->set_temperature(number);
    if (flag == "--top-p") sampling->set_top_p(number);
  } else if (flag == "--seed") {
    uint64_t seed = 0;
    ok = absl::SimpleAtoi(value, &seed);
    sampling->set_seed(seed);
  } else {  // --stop
    const std::optional<std::string> stop = unescape(value);
    ok = stop.has_value();
    if (ok) sampling->add_stop(*stop);
  }
  return ok ? FlagParse::kParsed : FlagParse::kBadValue;
}

bool parse_prompt_ids_flag(const std::vector<std::string>& args, size_t* index, PromptArgs* prompt,
                           std::string* error) {
  if (args[*index] != "--prompt-ids") return false;
  if (*index + 1 >= args.size()) {
    *error = "--prompt-ids needs a value";
    return true;
  }
  prompt->ids = parse_ids(args[++*index]);
  if (!prompt->ids) *error = absl::StrCat("bad value for --prompt-ids: '", args[*index], "'");
  return true;
}

std::optional<v1::Prompt> make_prompt(const PromptArgs& args, std::string* error) {
  v1::Prompt prompt;
  if (args.ids.has_value()) {
    if (!args.text.empty()) {
      *error = "give either PROMPT text or --prompt-ids, not both";
      return std::nullopt;
    }
    prompt.mutable_tokens()->mutable_ids()->Add(args.ids->begin(), args.ids->end());
    return prompt;
  }
  if (args.text.size() != 1) {
    *error = "expected one PROMPT argument (or --prompt-ids)";
    return std::nullopt;
  }
  const std::optional<std::string> text = unescape(args.text[0]);
  if (!text) {
    *error = absl::StrCat("bad escape in PROMPT '", args.text[0], "'");
    return std::nullopt;
  }
  prompt.set_text(*text);
  return prompt;
}

std::string quoted(const std::string& text) {
  // Control characters, quotes and backslashes escaped; UTF-8 kept readable.
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(byte, absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace deft::cli
