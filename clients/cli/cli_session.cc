#include "clients/cli/cli_session.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "clients/cli/cli_common.h"
#include "clients/cli/cli_verify.h"

namespace deft::cli {

SessionStream::SessionStream(v1::Deft::Stub& stub) : stream_(stub.TreeSession(&context_)) {}

bool SessionStream::call(v1::SessionRequest request,
                         const std::function<void(const v1::SessionResponse&)>& on_response) {
  request.set_request_id(next_request_id_++);
  if (writes_done_ || !stream_->Write(request)) return false;
  std::set<int64_t> decoding;
  if (request.has_decode())
    decoding.insert(request.decode().nodes().begin(), request.decode().nodes().end());
  v1::SessionResponse response;
  while (stream_->Read(&response)) {
    if (session_id_ == 0) session_id_ = response.session_id();
    // A response that answers no command (e.g. one that only announces the session id).
    if (response.request_id() != request.request_id()) continue;
    on_response(response);
    if (!response.has_decoded()) return true;
    if (response.decoded().finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      decoding.erase(response.decoded().node());
      if (decoding.empty()) return true;
    }
  }
  return false;
}

grpc::Status SessionStream::finish() {
  if (!writes_done_) {
    stream_->WritesDone();
    writes_done_ = true;
  }
  v1::SessionResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  return stream_->Finish();
}

void print_session_response(const v1::SessionResponse& response, uint64_t session_id) {
  switch (response.result_case()) {
    case v1::SessionResponse::kCreatedNode:
      std::printf("session %llu: created node %lld\n", static_cast<unsigned long long>(session_id),
                  static_cast<long long>(response.created_node()));
      break;
    case v1::SessionResponse::kDecoded: {
      const v1::NodeTokens& decoded = response.decoded();
      std::printf("decoded node %lld +%d %s%s%s\n", static_cast<long long>(decoded.node()),
                  decoded.delta().ids_size(), quoted(decoded.delta().text()).c_str(),
                  decoded.finish_reason() == v1::FINISH_REASON_UNSPECIFIED ? "" : " finish=",
                  decoded.finish_reason() == v1::FINISH_REASON_UNSPECIFIED
                      ? ""
                      : finish_name(decoded.finish_reason()));
      break;
    }
    case v1::SessionResponse::kBranched:
      std::printf("branched children %s\n",
                  absl::StrJoin(response.branched().children(), " ").c_str());
      break;
    case v1::SessionResponse::kPruned:
      std::printf("pruned node %lld\n", static_cast<long long>(response.pruned()));
      break;
    case v1::SessionResponse::kScored:
      std::printf(
          "scored logprob %.6f tokens %s\n", response.scored().logprob(),
          absl::StrJoin(response.scored().token_logprobs(), " ", [](std::string* out, float value) {
            absl::StrAppend(out, absl::SixDigits(value));
          }).c_str());
      break;
    case v1::SessionResponse::kClosed:
      std::printf("closed\n");
      break;
    case v1::SessionResponse::kError:
      std::printf("error %s (%d): %s\n", code_name(response.error().code()),
                  response.error().code(), response.error().message().c_str());
      break;
    case v1::SessionResponse::kVerified:
      print_verified(response.verified());
      break;
    case v1::SessionResponse::kExtended:
      std::printf("extended node %lld length %d\n",
                  static_cast<long long>(response.extended().node()), response.extended().length());
      break;
    case v1::SessionResponse::RESULT_NOT_SET:
      std::printf("(empty response to request %llu)\n",
                  static_cast<unsigned long long>(response.request_id()));
      break;
  }
}

namespace {

// Node ids the session returned so far ($0, $1, ...: created nodes, branch children and verify
// leaves in the order they came back); null while only the syntax is checked.
using NodeRefs = std::vector<int64_t>;

// "NODE" (an id) or "$K" (the K-th returned node) -> node id.
bool parse_node(const std::string& text, const NodeRefs* refs, int64_t* node) {
  if (!text.empty() && text[0] == '$') {
    size_t index = 0;
    if (!absl::SimpleAtoi(text.substr(1), &index)) return false;
    if (refs == nullptr) {
      *node = 0;
      return true;
    }
    if (index >= refs->size()) return false;
    *node = (*refs)[index];
    return true;
  }
  return absl::SimpleAtoi(text, node);
}

// "NODE,NODE,..." -> node ids.
std::optional<std::vector<int64_t>> parse_nodes(const std::string& text, const NodeRefs* refs) {
  std::vector<int64_t> nodes;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t node = 0;
    if (!parse_node(std::string(part), refs, &node)) return std::nullopt;
    nodes.push_back(node);
  }
  return nodes;
}

// TEXT or --ids 1,2,3 -> a Prompt.
std::optional<v1::Prompt> parse_content(const std::string& rest, std::string* error) {
  v1::Prompt prompt;
  if (rest.rfind("--ids ", 0) == 0) {
    const std::optional<std::vector<int32_t>> ids = parse_ids(rest.substr(6));
    if (!ids) {
      *error = absl::StrCat("bad id list '", rest.substr(6), "'");
      return std::nullopt;
    }
    prompt.mutable_tokens()->mutable_ids()->Add(ids->begin(), ids->end());
    return prompt;
  }
  const std::optional<std::string> text = unescape(rest);
  if (!text) {
    *error = absl::StrCat("bad escape in '", rest, "'");
    return std::nullopt;
  }
  prompt.set_text(*text);
  return prompt;
}

// The first word of `line` and the rest after one separating space.
std::pair<std::string, std::string> split_first(const std::string& line) {
  const size_t space = line.find(' ');
  if (space == std::string::npos) return {line, ""};
  return {line.substr(0, space), line.substr(space + 1)};
}

// One script line -> a request; the error message when malformed.
std::optional<v1::SessionRequest> parse_line(const std::string& line, const NodeRefs* refs,
                                             std::string* error) {
  v1::SessionRequest request;
  const auto [word, rest] = split_first(line);
  int64_t node = 0;
  if (word == "create") {
    std::optional<v1::Prompt> prompt = parse_content(rest, error);
    if (!prompt) return std::nullopt;
    *request.mutable_create()->mutable_prompt() = std::move(*prompt);
    return request;
  }
  if (word == "close") {
    request.mutable_close();
    return request;
  }
  if (word == "extend" || word == "score") {
    const auto [node_text, content] = split_first(rest);
    if (!parse_node(node_text, refs, &node)) {
      *error = absl::StrCat("bad NODE '", node_text, "'");
      return std::nullopt;
    }
    std::optional<v1::Prompt> prompt = parse_content(content, error);
    if (!prompt) return std::nullopt;
    if (word == "extend") {
      request.mutable_extend()->set_node(node);
      *request.mutable_extend()->mutable_content() = std::move(*prompt);
    } else {
      request.mutable_score()->set_node(node);
      *request.mutable_score()->mutable_continuation() = std::move(*prompt);
    }
    return request;
  }
  const std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (word == "branch" || word == "prune") {
    const size_t wanted = word == "branch" ? 3 : 2;
    int32_t k = 0;
    if (words.size() != wanted || !parse_node(words[1], refs, &node) ||
        (word == "branch" && !absl::SimpleAtoi(words[2], &k))) {
      *error = word == "branch" ? "expected: branch NODE K" : "expected: prune NODE";
      return std::nullopt;
    }
    if (word == "branch") {
      request.mutable_branch()->set_node(node);
      request.mutable_branch()->set_k(k);
    } else {
      request.mutable_prune()->set_node(node);
    }
    return request;
  }
  if (word == "decode") {
    int32_t max_tokens = 0;
    const std::optional<std::vector<int64_t>> nodes =
        words.size() >= 3 ? parse_nodes(words[1], refs) : std::nullopt;
    if (!nodes || !absl::SimpleAtoi(words[2], &max_tokens)) {
      *error = "expected: decode NODE[,NODE...] MAX_TOKENS [SAMPLING]";
      return std::nullopt;
    }
    v1::DecodeCommand* decode = request.mutable_decode();
    decode->mutable_nodes()->Add(nodes->begin(), nodes->end());
    decode->mutable_sampling()->set_max_tokens(max_tokens);
    for (size_t i = 3; i < words.size(); ++i) {
      if (parse_sampling_flag(words, &i, decode->mutable_sampling()) != FlagParse::kParsed) {
        *error = absl::StrCat("decode: bad option '", words[i], "'");
        return std::nullopt;
      }
    }
    return request;
  }
  if (word == "verify") {
    if (words.size() < 2 || !parse_node(words[1], refs, &node)) {
      *error = "expected: verify NODE --tokens ... --parents ...";
      return std::nullopt;
    }
    request.mutable_verify()->set_node(node);
    *error = parse_verify_args(words, 2, request.mutable_verify(), nullptr);
    if (!error->empty()) return std::nullopt;
    return request;
  }
  *error = absl::StrCat("unknown command '", word, "'");
  return std::nullopt;
}

}  // namespace

int session_command(v1::Deft::Stub& stub, const std::vector<std::string>& args) {
  if (args.size() > 1) return usage_error("session takes at most one SCRIPT argument");
  std::ifstream file;
  std::istream* input = &std::cin;
  if (!args.empty() && args[0] != "-") {
    file.open(args[0]);
    if (!file) return usage_error(absl::StrCat("session: cannot read '", args[0], "'"));
    input = &file;
  }
  // The whole script is parsed first: a malformed line is a usage error before any RPC.
  std::vector<std::string> lines;
  int line_number = 0;
  for (std::string line; std::getline(*input, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::string error;
    if (!parse_line(line, nullptr, &error)) {
      return usage_error(absl::StrCat("session line ", line_number, ": ", error));
    }
    lines.push_back(line);
  }

  SessionStream stream(stub);
  NodeRefs refs;
  bool failed = false;
  bool closed = false;
  for (const std::string& line : lines) {
    std::printf("> %s\n", line.c_str());
    std::fflush(stdout);
    std::string error;
    std::optional<v1::SessionRequest> command = parse_line(line, &refs, &error);
    if (!command) {  // a $K that no earlier command returned
      std::printf("error (not sent): %s; returned so far: %s\n", error.c_str(),
                  absl::StrJoin(refs, " ").c_str());
      failed = true;
      continue;
    }
    std::map<int64_t, std::pair<std::string, int32_t>> decoded;  // node -> text, tokens
    std::map<int64_t, v1::FinishReason> finish;
    const bool answered = stream.call(*command, [&](const v1::SessionResponse& response) {
      print_session_response(response, stream.session_id());
      std::fflush(stdout);
      if (response.has_error()) failed = true;
      if (response.has_closed()) closed = true;
      if (response.has_created_node()) refs.push_back(response.created_node());
      if (response.has_verified()) refs.push_back(response.verified().node());
      if (response.has_branched()) {
        refs.insert(refs.end(), response.branched().children().begin(),
                    response.branched().children().end());
      }
      if (response.has_decoded()) {
        auto& [text, tokens] = decoded[response.decoded().node()];
        text += response.decoded().delta().text();
        tokens += response.decoded().delta().ids_size();
        if (response.decoded().finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
          finish[response.decoded().node()] = response.decoded().finish_reason();
        }
      }
    });
    for (const auto& [node, text_tokens] : decoded) {
      std::printf("node %lld: %s [%d tokens, %s]\n", static_cast<long long>(node),
                  quoted(text_tokens.first).c_str(), text_tokens.second, finish_name(finish[node]));
    }
    if (!answered || closed) break;
  }
  const grpc::Status status = stream.finish();
  if (!status.ok()) return rpc_error("TreeSession", status);
  return failed ? 1 : 0;
}

}  // namespace deft::cli
