// The OpenAI API's request bodies (/v1/completions, /v1/chat/completions) as engine jobs, and
// its error shape. Pure functions of JSON, the tokenizer and the limits: no HTTP here.
//
// Accepted (OpenAI's names and defaults, except max_tokens: the server's default_max_tokens):
//   model (required; the served model's id), prompt (a string, token ids, or a list holding one
//   of those) | messages (role + content: a string or a list of {"type": "text"} parts), n,
//   max_tokens / max_completion_tokens, temperature, top_p, stop (a string or a list), seed,
//   logprobs (completions: a count of top entries 0..20; chat: true/false with top_logprobs),
//   stream, stream_options.include_usage, user (ignored), and the vLLM-style extras top_k,
//   ignore_eos, stop_token_ids.
// Refused with 400 naming the field: echo, suffix, best_of other than n, non-zero
// presence_penalty / frequency_penalty, logit_bias, tools / functions / response_format other
// than text, several prompts in one request.
// Extension: "deft": {"tree": {...}} runs a RunTree job (one best path; no streaming, n 1):
//   branch_factor (2), every_tokens (16) | delimiter | step_end_token, max_depth (2),
//   keep_best (0: all), score ("cumulative" | "mean").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/branch_controller.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/generate_work.h"
#include "nlohmann/json.hpp"
#include "server/chat_template.h"
#include "server/server_config.h"
#include "server/speculative_request.h"

namespace deft::server {

// What a request needs to know of the server to be parsed and checked.
struct OpenAiLimits {
  const ServerConfig* config = nullptr;
  const engine::Tokenizer* tokenizer = nullptr;
  std::string model_id;
  int32_t vocab_size = 0;
  int64_t max_context = 0;
  ChatTemplate chat_template = ChatTemplate::kLlama2;
  SpeculationOffer speculation;  // "deft": {"speculative": ...}
};

struct OpenAiRequest {
  bool chat = false;
  engine::GenerateJob job;  // prompt, n, max_tokens, sampling, limits
  bool stream = false;
  bool include_usage = false;                       // stream_options.include_usage
  bool logprobs = false;                            // report the sampled tokens' logprobs
  int32_t top_logprobs = 0;                         // and this many alternatives each
  std::optional<engine::BranchPolicyOptions> tree;  // "deft": {"tree": ...}
};

// An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct OpenAiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field; empty: null
  std::string code;   // empty: null

  nlohmann::json to_json() const;
};

// The HTTP status and type of an engine or server status (INVALID_ARGUMENT: 400,
// UNAUTHENTICATED: 401, NOT_FOUND: 404, RESOURCE_EXHAUSTED: 429, UNAVAILABLE: 503, else 500).
OpenAiError to_openai_error(const absl::Status& status, std::string param = "");

// Parses and checks a request body; `chat` picks /v1/chat/completions. On error, `error`
// names the field (param) and the value or limit in the message.
bool parse_openai_request(const std::string& body, bool chat, const OpenAiLimits& limits,
                          OpenAiRequest* request, OpenAiError* error);

}  // namespace deft::server
