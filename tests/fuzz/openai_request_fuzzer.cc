// libFuzzer harness: the OpenAI API's request bodies (server/openai_request.h,
// parse_openai_request), with the embedded default model's tokenizer and small server limits.
//
// Input: one byte of options (bit 0: /v1/chat/completions rather than /v1/completions; bit 1:
// the server has a draft model), then the request body. In the committed corpus that byte is an
// ASCII digit '0'-'3', so the files stay readable JSON after it. Mutations are JSON-aware half
// of the time (tests/fuzz/json_mutator.h): a field's value becomes another type or an edge value.
//
// Contracts checked:
//   - the parser never throws or crashes, whatever the JSON's types;
//   - a refusal is a 400 (404 only for an unknown model) with a message, and its OpenAI error
//     body carries that message;
//   - an accepted request is one the engine can run within the server's limits: n in
//     [1, max_branches]; a prompt of 1..max_prompt_tokens token ids inside the vocabulary;
//     max_tokens >= 1 with prompt + max_tokens within the context; sampling parameters the
//     engine validates; stop strings and stop token ids within their limits; top logprobs in
//     range and only with logprobs; a tree policy the engine validates, with n 1, no stream and
//     no speculation; otherwise the whole tree (prompt + n x max_tokens) within max_tree_tokens.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/branch_controller.h"
#include "engine/sampler.h"
#include "engine/speculation/static_tree.h"
#include "engine/tokenizer/tokenizer.h"
#include "models/default_model.h"
#include "models/model_config.h"
#include "server/chat_template.h"
#include "server/openai_request.h"
#include "server/server_config.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/json_mutator.h"

namespace {

using deft::server::OpenAiError;
using deft::server::OpenAiLimits;
using deft::server::OpenAiRequest;

// Limits small enough that a limit's edge is a few bytes of mutation away.
deft::server::ServerConfig small_limits() {
  deft::server::ServerConfig config;
  config.max_tree_tokens = 160;
  config.max_prompt_tokens = 64;  // a short chat under the template's tokens
  config.max_branches = 3;
  config.default_max_tokens = 2;
  config.max_text_bytes = 512;
  config.max_stop_sequences = 3;
  return config;
}

// The tokenizer and limits, made once per process (never destroyed: libFuzzer exits from
// anywhere).
struct Harness {
  deft::server::ServerConfig config = small_limits();
  std::unique_ptr<deft::engine::Tokenizer> tokenizer;
  OpenAiLimits limits;

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
    absl::StatusOr<deft::server::ChatTemplate> chat_template =
        deft::server::choose_chat_template("auto", *tokenizer);
    FUZZ_CHECK(chat_template.ok(), chat_template.status().ToString());
    limits = OpenAiLimits{
        .config = &config,
        .tokenizer = tokenizer.get(),
        .model_id = "default",
        .vocab_size = model->vocab_size,
        // Small, so that the context check is reachable too.
        .max_context = 128,
        .chat_template = *chat_template,
        .speculation = {.tree = std::make_shared<const deft::engine::StaticTree>(
                            deft::engine::default_static_tree(63, 6))},
    };
  }
};

Harness& harness() {
  static Harness* instance = new Harness();
  return *instance;
}

void check_refusal(const OpenAiError& error) {
  FUZZ_CHECK(
      error.http_status == 400 || (error.http_status == 404 && error.code == "model_not_found"),
      absl::StrCat("HTTP ", error.http_status, " (", error.code, "): ", error.message));
  FUZZ_CHECK(!error.message.empty(), "a refusal without a message");
  const nlohmann::json body = error.to_json();
  FUZZ_CHECK(body.contains("error") && body["error"].value("message", "") == error.message,
             body.dump());
}

void check_accepted(const OpenAiRequest& request, const Harness& h) {
  const deft::server::ServerConfig& config = h.config;
  const deft::engine::GenerateJob& job = request.job;
  FUZZ_CHECK(job.n >= 1 && job.n <= config.max_branches, absl::StrCat("n ", job.n));
  const auto prompt = static_cast<int64_t>(job.prompt.size());
  FUZZ_CHECK(prompt >= 1 && prompt <= config.max_prompt_tokens,
             absl::StrCat("a prompt of ", prompt, " tokens"));
  for (deft::engine::TokenId id : job.prompt) {
    FUZZ_CHECK(id >= 0 && id < h.limits.vocab_size, absl::StrCat("prompt token ", id));
  }
  FUZZ_CHECK(job.max_tokens >= 1 && prompt + job.max_tokens <= h.limits.max_context,
             absl::StrCat("max_tokens ", job.max_tokens, " after a prompt of ", prompt));
  const absl::Status sampling =
      deft::engine::validate_sampling_params(job.sampling, h.limits.vocab_size);
  FUZZ_CHECK(sampling.ok(), sampling.ToString());
  FUZZ_CHECK(job.limits.stop.size() <= static_cast<size_t>(config.max_stop_sequences),
             absl::StrCat(job.limits.stop.size(), " stop strings"));
  size_t stop_bytes = 0;
  for (const std::string& stop : job.limits.stop) {
    FUZZ_CHECK(!stop.empty(), "an empty stop string");
    stop_bytes += stop.size();
  }
  FUZZ_CHECK(stop_bytes <= static_cast<size_t>(config.max_text_bytes),
             absl::StrCat(stop_bytes, " bytes of stop strings"));
  // The chat template adds its end-of-turn ids to the client's.
  FUZZ_CHECK(job.sampling.stop_token_ids.size() <=
                 static_cast<size_t>(config.max_stop_sequences) + (request.chat ? 4 : 0),
             absl::StrCat(job.sampling.stop_token_ids.size(), " stop token ids"));
  FUZZ_CHECK(request.top_logprobs >= 0 && request.top_logprobs <= deft::engine::kMaxTopLogprobs,
             absl::StrCat("top_logprobs ", request.top_logprobs));
  FUZZ_CHECK(request.top_logprobs == 0 || request.logprobs, "top logprobs without logprobs");
  FUZZ_CHECK(!request.include_usage || request.stream, "include_usage without stream");
  if (job.speculative != nullptr) {
    FUZZ_CHECK(!request.tree.has_value(), "speculation with a tree policy");
  }
  if (request.tree.has_value()) {
    const absl::Status policy = deft::engine::validate_branch_policy(
        *request.tree, h.limits.vocab_size, config.max_branches);
    FUZZ_CHECK(policy.ok(), policy.ToString());
    FUZZ_CHECK(job.n == 1 && !request.stream, "a tree with n > 1 or streamed");
    FUZZ_CHECK(request.tree->delimiter.size() <= static_cast<size_t>(config.max_text_bytes),
               absl::StrCat("a delimiter of ", request.tree->delimiter.size(), " bytes"));
  } else {
    FUZZ_CHECK(prompt + int64_t{job.n} * job.max_tokens <= config.max_tree_tokens,
               absl::StrCat("prompt ", prompt, " + n ", job.n, " x ", job.max_tokens));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness& h = harness();
  deft::fuzz::FuzzInput input(data, size);
  const int64_t options = input.take_int(0, 3);
  const bool chat = (options & 1) != 0;
  const std::string body = input.take_rest();
  OpenAiLimits limits = h.limits;
  limits.speculation.draft_model = (options & 2) != 0;
  OpenAiRequest request;
  OpenAiError error;
  if (deft::server::parse_openai_request(body, chat, limits, &request, &error)) {
    check_accepted(request, h);
  } else {
    check_refusal(error);
  }
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return deft::fuzz::mutate_json(data, size, max_size, seed, /*prefix_bytes=*/1);
}
