#include "server/openai_request.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/sampler.h"

namespace deft::server {
namespace {

using json = nlohmann::json;

// A parse failure that names its field.
struct Refusal {
  std::string param;
  std::string message;
  std::string code;
};

std::string type_name(const json& value) { return value.type_name(); }

Refusal wrong_type(const std::string& field, const char* expected, const json& value) {
  return {field, absl::StrCat(field, " must be ", expected, ", got ", type_name(value))};
}

// Optional fields: absent and null mean "the default".
const json* field(const json& body, const char* name) {
  const auto found = body.find(name);
  if (found == body.end() || found->is_null()) return nullptr;
  return &*found;
}

std::optional<Refusal> get_int(const json& body, const char* name, int64_t minimum, int64_t maximum,
                               int64_t* out) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number_integer()) return wrong_type(name, "an integer", *value);
  const int64_t number =
      value->is_number_unsigned()
          ? static_cast<int64_t>(std::min<uint64_t>(value->get<uint64_t>(), INT64_MAX))
          : value->get<int64_t>();
  if (number < minimum || number > maximum) {
    return Refusal{name,
                   absl::StrCat(name, " = ", number, " must be in [", minimum, ", ", maximum, "]")};
  }
  *out = number;
  return std::nullopt;
}

std::optional<Refusal> get_number(const json& body, const char* name, double minimum,
                                  double maximum, double* out) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) return wrong_type(name, "a number", *value);
  const double number = value->get<double>();
  if (!std::isfinite(number) || number < minimum || number > maximum) {
    return Refusal{name,
                   absl::StrCat(name, " = ", number, " must be in [", minimum, ", ", maximum, "]")};
  }
  *out = number;
  return std::nullopt;
}

std::optional<Refusal> get_bool(const json& body, const char* name, bool* out) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) return wrong_type(name, "true or false", *value);
  *out = value->get<bool>();
  return std::nullopt;
}

Refusal unsupported(const std::string& name, const std::string& why) {
  return {name,
          absl::StrCat(name, " is not supported by this server", why.empty() ? "" : ": ", why),
          "unsupported_parameter"};
}

// Fields of OpenAI's API this server does not implement: refused unless given their neutral
// value, so a client never silently gets something other than it asked for.
std::optional<Refusal> check_unsupported(const json& body, int64_t n) {
  if (const json* echo = field(body, "echo"); echo != nullptr && *echo != json(false)) {
    return unsupported("echo", "");
  }
  if (field(body, "suffix") != nullptr) return unsupported("suffix", "");
  if (const json* best_of = field(body, "best_of");
      best_of != nullptr && !(best_of->is_number_integer() && best_of->get<int64_t>() == n)) {
    return unsupported("best_of", "use n");
  }
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    if (const json* value = field(body, penalty);
        value != nullptr && !(value->is_number() && value->get<double>() == 0.0)) {
      return unsupported(penalty, "only 0");
    }
  }
  if (const json* bias = field(body, "logit_bias"); bias != nullptr && !bias->empty()) {
    return unsupported("logit_bias", "");
  }
  for (const char* name : {"tools", "functions", "tool_choice", "function_call"}) {
    if (const json* value = field(body, name); value != nullptr && !value->empty()) {
      return unsupported(name, "no tool calling");
    }
  }
  if (const json* format = field(body, "response_format")) {
    // Compared as JSON: a "type" of another JSON type is refused, never converted.
    const json* type = format->is_object() ? field(*format, "type") : nullptr;
    if (!format->is_object() || (type != nullptr && *type != "text")) {
      return unsupported("response_format", "only {\"type\": \"text\"}");
    }
  }
  return std::nullopt;
}

// Token ids of a completions `prompt`: a string, a list of ids, or a list holding one of those.
std::optional<Refusal> completion_prompt(const json& body, const OpenAiLimits& limits,
                                         std::vector<engine::TokenId>* ids) {
  const json* prompt = field(body, "prompt");
  if (prompt == nullptr) return Refusal{"prompt", "prompt is required"};
  const json* one = prompt;
  if (prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_number()) {
    if (prompt->size() != 1) {
      return unsupported("prompt", absl::StrCat("one prompt per request (got ", prompt->size(),
                                                "); send several requests"));
    }
    one = &(*prompt)[0];
  }
  if (one->is_string()) {
    const std::string& text = one->get_ref<const std::string&>();
    if (text.size() > static_cast<size_t>(limits.config->max_text_bytes)) {
      return Refusal{"prompt", absl::StrCat("prompt has ", text.size(), " bytes; the limit is ",
                                            limits.config->max_text_bytes, " (max_text_bytes)")};
    }
    // Client text is untrusted: special-token strings in it stay text.
    absl::StatusOr<std::vector<engine::TokenId>> encoded =
        limits.tokenizer->encode(text, /*add_bos=*/true, /*parse_special=*/false);
    if (!encoded.ok())
      return Refusal{"prompt", absl::StrCat("prompt: ", encoded.status().message())};
    *ids = std::move(*encoded);
  } else if (one->is_array()) {
    if (one->size() > static_cast<size_t>(limits.config->max_prompt_tokens)) {
      return Refusal{"prompt",
                     absl::StrCat("prompt has ", one->size(), " tokens; the limit is ",
                                  limits.config->max_prompt_tokens, " (max_prompt_tokens)")};
    }
    for (size_t i = 0; i < one->size(); ++i) {
      const json& id = (*one)[i];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= limits.vocab_size) {
        return Refusal{"prompt",
                       absl::StrCat("prompt[", i, "] = ", id.dump(), " is not a token id in [0, ",
                                    limits.vocab_size, ")")};
      }
      ids->push_back(static_cast<engine::TokenId>(id.get<int64_t>()));
    }
  } else {
    return wrong_type("prompt", "a string, a list of token ids, or a list of one of those", *one);
  }
  return std::nullopt;
}

// The prompt of a chat `messages` list under the server's chat template.
std::optional<Refusal> chat_prompt(const json& body, const OpenAiLimits& limits,
                                   std::vector<engine::TokenId>* ids) {
  const json* messages = field(body, "messages");
  if (messages == nullptr) return Refusal{"messages", "messages is required"};
  if (!messages->is_array()) return wrong_type("messages", "a list of messages", *messages);
  std::vector<engine::ChatMessage> turns;
  size_t text_bytes = 0;
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& message = (*messages)[i];
    const std::string name = absl::StrCat("messages[", i, "]");
    if (!message.is_object()) return wrong_type(name, "an object", message);
    const json* role = field(message, "role");
    if (role == nullptr || !role->is_string()) {
      return Refusal{name + ".role", name + ".role must be a string"};
    }
    engine::ChatMessage turn{.role = role->get<std::string>()};
    if (turn.role == "developer") turn.role = "system";  // OpenAI's newer name for it
    const json* content = field(message, "content");
    if (content == nullptr) {
      return Refusal{name + ".content", name + ".content is required"};
    } else if (content->is_string()) {
      turn.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t p = 0; p < content->size(); ++p) {
        const json& part = (*content)[p];
        const std::string part_name = absl::StrCat(name, ".content[", p, "]");
        const json* type = part.is_object() ? field(part, "type") : nullptr;
        const json* text = part.is_object() ? field(part, "text") : nullptr;
        if (type == nullptr || *type != "text" || text == nullptr || !text->is_string()) {
          return unsupported(part_name, "only {\"type\": \"text\", \"text\": ...} parts");
        }
        turn.content += text->get_ref<const std::string&>();
      }
    } else {
      return wrong_type(name + ".content", "a string or a list of text parts", *content);
    }
    text_bytes += turn.role.size() + turn.content.size();
    turns.push_back(std::move(turn));
  }
  if (text_bytes > static_cast<size_t>(limits.config->max_text_bytes)) {
    return Refusal{"messages",
                   absl::StrCat("messages have ", text_bytes, " bytes of text; the limit is ",
                                limits.config->max_text_bytes, " (max_text_bytes)")};
  }
  absl::StatusOr<std::vector<engine::TokenId>> encoded =
      apply_chat_template(limits.chat_template, *limits.tokenizer, turns);
  if (!encoded.ok()) return Refusal{"messages", std::string(encoded.status().message())};
  *ids = std::move(*encoded);
  return std::nullopt;
}

std::optional<Refusal> stop_strings(const json& body, const OpenAiLimits& limits,
                                    engine::StreamLimits* stream_limits) {
  const json* stop = field(body, "stop");
  if (stop == nullptr) return std::nullopt;
  std::vector<std::string> strings;
  if (stop->is_string()) {
    strings.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (const json& entry : *stop) {
      if (!entry.is_string()) return wrong_type("stop", "a string or a list of strings", entry);
      strings.push_back(entry.get<std::string>());
    }
  } else {
    return wrong_type("stop", "a string or a list of strings", *stop);
  }
  if (strings.size() > static_cast<size_t>(limits.config->max_stop_sequences)) {
    return Refusal{"stop",
                   absl::StrCat("stop lists ", strings.size(), " strings; the limit is ",
                                limits.config->max_stop_sequences, " (max_stop_sequences)")};
  }
  size_t bytes = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    if (strings[i].empty()) return Refusal{"stop", absl::StrCat("stop[", i, "] is empty")};
    bytes += strings[i].size();
  }
  if (bytes > static_cast<size_t>(limits.config->max_text_bytes)) {
    return Refusal{"stop", absl::StrCat("stop has ", bytes, " bytes; the limit is ",
                                        limits.config->max_text_bytes, " (max_text_bytes)")};
  }
  stream_limits->stop = std::move(strings);
  return std::nullopt;
}

// "deft": {"speculative": {"policy": "static" | "dynamic" | "ngram" | "off", "tree_tokens",
// "depth", "top_k"}}: GenerateRequest.speculative, with the same defaults and checks.
std::optional<Refusal> speculative(const json& deft, const OpenAiLimits& limits,
                                   engine::GenerateJob* job) {
  const json* spec = field(deft, "speculative");
  if (spec == nullptr) return std::nullopt;
  if (!spec->is_object()) return wrong_type("deft.speculative", "an object", *spec);
  deft::v1::SpeculativeOptions options;
  for (const auto& [key, value] : spec->items()) {
    const std::string param = "deft.speculative." + key;
    if (key == "policy") {
      if (!value.is_string()) return wrong_type(param, "a string", value);
      absl::StatusOr<deft::v1::SpeculativeOptions::Policy> policy =
          policy_by_name(value.get<std::string>());
      if (!policy.ok()) return Refusal{param, std::string(policy.status().message())};
      options.set_policy(*policy);
    } else if (key == "tree_tokens" || key == "depth" || key == "top_k") {
      if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
          value.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return wrong_type(param, "a non-negative integer", value);
      }
      const auto number = value.get<int32_t>();
      if (key == "tree_tokens") options.set_tree_tokens(number);
      if (key == "depth") options.set_depth(number);
      if (key == "top_k") options.set_top_k(number);
    } else {
      return Refusal{param, absl::StrCat(param,
                                         " is not a field (policy, tree_tokens, depth, "
                                         "top_k)")};
    }
  }
  absl::StatusOr<std::shared_ptr<const engine::SpeculativeOptions>> converted =
      speculative_options(options, limits.speculation, "deft.speculative");
  if (!converted.ok())
    return Refusal{"deft.speculative", std::string(converted.status().message())};
  job->speculative = std::move(*converted);
  return std::nullopt;
}

std::optional<Refusal> tree_policy(const json& deft, const OpenAiLimits& limits,
                                   std::optional<engine::BranchPolicyOptions>* tree) {
  if (!deft.is_object()) return wrong_type("deft", "an object", deft);
  const json* spec = field(deft, "tree");
  if (spec == nullptr) return std::nullopt;
  if (!spec->is_object()) return wrong_type("deft.tree", "an object", *spec);
  for (const auto& [key, value] : spec->items()) {
    static const char* const kKnown[] = {"branch_factor",  "every_tokens", "delimiter",
                                         "step_end_token", "max_depth",    "keep_best",
                                         "score"};
    // A copy: clang does not let a lambda capture a structured binding before C++20's P1091.
    const std::string& name = key;
    if (std::find_if(std::begin(kKnown), std::end(kKnown),
                     [&](const char* known) { return name == known; }) == std::end(kKnown)) {
      return Refusal{"deft.tree." + key, absl::StrCat("deft.tree.", key, " is not a field (",
                                                      "branch_factor, every_tokens, delimiter, "
                                                      "step_end_token, max_depth, keep_best, "
                                                      "score)")};
    }
  }
  engine::BranchPolicyOptions policy;
  int64_t number = 0;
  const auto integer = [&](const char* name, int32_t* out) -> std::optional<Refusal> {
    number = *out;
    if (auto refusal = get_int(*spec, name, INT32_MIN, INT32_MAX, &number)) {
      refusal->param = absl::StrCat("deft.tree.", refusal->param);
      refusal->message = absl::StrCat("deft.tree.", refusal->message);
      return refusal;
    }
    *out = static_cast<int32_t>(number);
    return std::nullopt;
  };
  for (auto [name, out] :
       {std::pair{"branch_factor", &policy.branch_factor},
        std::pair{"max_depth", &policy.max_depth}, std::pair{"keep_best", &policy.keep_best}}) {
    if (auto refusal = integer(name, out)) return refusal;
  }
  const int triggers = (field(*spec, "every_tokens") != nullptr) +
                       (field(*spec, "delimiter") != nullptr) +
                       (field(*spec, "step_end_token") != nullptr);
  if (triggers > 1) {
    return Refusal{"deft.tree",
                   "deft.tree takes one of every_tokens, delimiter and step_end_token"};
  }
  if (field(*spec, "delimiter") != nullptr) {
    const json& delimiter = (*spec)["delimiter"];
    if (!delimiter.is_string()) return wrong_type("deft.tree.delimiter", "a string", delimiter);
    if (delimiter.get_ref<const std::string&>().size() >
        static_cast<size_t>(limits.config->max_text_bytes)) {
      return Refusal{"deft.tree.delimiter", "deft.tree.delimiter is longer than max_text_bytes"};
    }
    policy.trigger = engine::BranchPolicyOptions::Trigger::kDelimiter;
    policy.delimiter = delimiter.get<std::string>();
  } else if (field(*spec, "step_end_token") != nullptr) {
    policy.trigger = engine::BranchPolicyOptions::Trigger::kStepEndToken;
    if (auto refusal = integer("step_end_token", &policy.step_end_token)) return refusal;
  } else {
    policy.trigger = engine::BranchPolicyOptions::Trigger::kEveryTokens;
    if (auto refusal = integer("every_tokens", &policy.every_tokens)) return refusal;
  }
  if (const json* score = field(*spec, "score")) {
    if (*score == "cumulative") {
      policy.score = engine::BranchPolicyOptions::Score::kCumulativeLogprob;
    } else if (*score == "mean") {
      policy.score = engine::BranchPolicyOptions::Score::kMeanLogprob;
    } else {
      return Refusal{"deft.tree.score", absl::StrCat("deft.tree.score = ", score->dump(),
                                                     " must be \"cumulative\" or \"mean\"")};
    }
  }
  if (absl::Status status =
          engine::validate_branch_policy(policy, limits.vocab_size, limits.config->max_branches);
      !status.ok()) {
    return Refusal{"deft.tree", absl::StrCat("deft.tree: ", status.message())};
  }
  *tree = std::move(policy);
  return std::nullopt;
}

std::optional<Refusal> parse(const json& body, bool chat, const OpenAiLimits& limits,
                             OpenAiRequest* request) {
  const ServerConfig& config = *limits.config;
  request->chat = chat;
  const json* model = field(body, "model");
  if (model == nullptr || !model->is_string()) {
    return Refusal{"model",
                   absl::StrCat("model is required: \"", limits.model_id, "\" (GET /v1/models)")};
  }
  if (model->get_ref<const std::string&>() != limits.model_id) {
    return Refusal{"model",
                   absl::StrCat("the model \"", model->get<std::string>(),
                                "\" does not exist; this server serves \"", limits.model_id, "\""),
                   "model_not_found"};
  }

  int64_t n = 1;
  if (auto refusal = get_int(body, "n", 1, config.max_branches, &n)) return refusal;
  request->job.n = static_cast<int32_t>(n);
  if (auto refusal = check_unsupported(body, n)) return refusal;

  engine::GenerateJob& job = request->job;
  if (auto refusal = chat ? chat_prompt(body, limits, &job.prompt)
                          : completion_prompt(body, limits, &job.prompt)) {
    return refusal;
  }
  if (job.prompt.empty()) return Refusal{chat ? "messages" : "prompt", "the prompt has no tokens"};
  if (static_cast<int64_t>(job.prompt.size()) > config.max_prompt_tokens) {
    return Refusal{chat ? "messages" : "prompt",
                   absl::StrCat("the prompt has ", job.prompt.size(), " tokens; the limit is ",
                                config.max_prompt_tokens, " (max_prompt_tokens)")};
  }

  int64_t max_tokens = config.default_max_tokens;
  const char* max_tokens_name = chat && field(body, "max_completion_tokens") != nullptr
                                    ? "max_completion_tokens"
                                    : "max_tokens";
  if (auto refusal = get_int(body, max_tokens_name, 1, INT32_MAX, &max_tokens)) return refusal;
  job.max_tokens = static_cast<int32_t>(max_tokens);

  double temperature = 1.0;
  double top_p = 1.0;
  if (auto refusal = get_number(body, "temperature", 0.0, 2.0, &temperature)) return refusal;
  if (auto refusal = get_number(body, "top_p", 0.0, 1.0, &top_p)) return refusal;
  if (top_p == 0.0) return Refusal{"top_p", "top_p must be > 0"};
  int64_t top_k = 0;
  if (auto refusal = get_int(body, "top_k", -1, INT32_MAX, &top_k)) return refusal;
  int64_t seed = 0;
  if (auto refusal = get_int(body, "seed", INT64_MIN, INT64_MAX, &seed)) return refusal;
  job.sampling.temperature = static_cast<float>(temperature);
  job.sampling.top_p = static_cast<float>(top_p);
  job.sampling.top_k = static_cast<int32_t>(std::max<int64_t>(top_k, 0));  // vLLM: -1 is off
  job.sampling.seed = static_cast<uint64_t>(seed);

  // logprobs: completions take a count (0..20: top entries), chat a bool plus top_logprobs.
  if (chat) {
    if (auto refusal = get_bool(body, "logprobs", &request->logprobs)) return refusal;
    int64_t top = 0;
    if (auto refusal = get_int(body, "top_logprobs", 0, engine::kMaxTopLogprobs, &top)) {
      return refusal;
    }
    if (top > 0 && !request->logprobs) {
      return Refusal{"top_logprobs", "top_logprobs needs logprobs: true"};
    }
    request->top_logprobs = static_cast<int32_t>(top);
  } else if (field(body, "logprobs") != nullptr) {
    int64_t top = 0;
    if (auto refusal = get_int(body, "logprobs", 0, engine::kMaxTopLogprobs, &top)) return refusal;
    request->logprobs = true;
    request->top_logprobs = static_cast<int32_t>(top);
  }
  job.sampling.top_logprobs = request->top_logprobs;
  job.limits.top_logprobs = request->top_logprobs > 0;

  if (auto refusal = stop_strings(body, limits, &job.limits)) return refusal;
  if (auto refusal = get_bool(body, "ignore_eos", &job.limits.ignore_eos)) return refusal;
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) return wrong_type("stop_token_ids", "a list of token ids", *ids);
    if (ids->size() > static_cast<size_t>(config.max_stop_sequences)) {
      return Refusal{"stop_token_ids",
                     absl::StrCat("stop_token_ids lists ", ids->size(), " ids; the limit is ",
                                  config.max_stop_sequences)};
    }
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& id = (*ids)[i];
      // Checked before the cast: 2^32 + 2 must not become token 2 (and an unsigned value past
      // INT64_MAX reads as negative).
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= limits.vocab_size) {
        return Refusal{"stop_token_ids",
                       absl::StrCat("stop_token_ids[", i, "] = ", id.dump(),
                                    " is not a token id in [0, ", limits.vocab_size, ")")};
      }
      job.sampling.stop_token_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  if (chat) {
    for (engine::TokenId id : chat_stop_token_ids(limits.chat_template, *limits.tokenizer)) {
      job.sampling.stop_token_ids.push_back(id);
    }
  }
  if (absl::Status status = engine::validate_sampling_params(job.sampling, limits.vocab_size);
      !status.ok()) {
    return Refusal{"", std::string(status.message())};
  }

  if (auto refusal = get_bool(body, "stream", &request->stream)) return refusal;
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) return wrong_type("stream_options", "an object", *options);
    if (!request->stream) {
      return Refusal{"stream_options", "stream_options needs stream: true"};
    }
    if (auto refusal = get_bool(*options, "include_usage", &request->include_usage)) {
      refusal->param = "stream_options.include_usage";
      return refusal;
    }
  }

  if (const json* deft = field(body, "deft")) {
    if (auto refusal = tree_policy(*deft, limits, &request->tree)) return refusal;
    if (request->tree && (request->stream || n != 1)) {
      return Refusal{"deft.tree", "deft.tree returns one best path: it takes n 1, no stream"};
    }
    for (const auto& [key, value] : deft->items()) {
      if (key != "tree" && key != "speculative") {
        return Refusal{"deft." + key, absl::StrCat("deft.", key,
                                                   " is not a field (tree, "
                                                   "speculative)")};
      }
    }
    if (auto refusal = speculative(*deft, limits, &job)) return refusal;
    if (request->tree && job.speculative != nullptr) {
      return Refusal{"deft.speculative", "deft.speculative applies to sampling, not to deft.tree"};
    }
  }

  const auto prompt_size = static_cast<int64_t>(job.prompt.size());
  if (prompt_size + job.max_tokens > limits.max_context) {
    return Refusal{max_tokens_name,
                   absl::StrCat("the prompt (", prompt_size, " tokens) + ", max_tokens_name, " (",
                                job.max_tokens, ") exceeds the model's context of ",
                                limits.max_context, " tokens"),
                   "context_length_exceeded"};
  }
  if (!request->tree) {
    const int64_t tree_tokens = prompt_size + int64_t{job.n} * job.max_tokens;
    if (tree_tokens > config.max_tree_tokens) {
      return Refusal{
          max_tokens_name,
          absl::StrCat("the request may hold ", tree_tokens, " tokens (prompt ", prompt_size,
                       " + n ", job.n, " x ", max_tokens_name, " ", job.max_tokens,
                       "); the limit is ", config.max_tree_tokens, " (max_tree_tokens)")};
    }
  }
  return std::nullopt;
}

}  // namespace

nlohmann::json OpenAiError::to_json() const {
  return json{{"error",
               {{"message", message},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

OpenAiError to_openai_error(const absl::Status& status, std::string param) {
  OpenAiError error{.message = std::string(status.message()), .param = std::move(param)};
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      error.http_status = 400;
      break;
    case absl::StatusCode::kUnauthenticated:
      error.http_status = 401;
      error.type = "authentication_error";
      error.code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:
      error.http_status = 403;
      error.type = "permission_error";
      break;
    case absl::StatusCode::kNotFound:
      error.http_status = 404;
      error.code = "not_found";
      break;
    case absl::StatusCode::kResourceExhausted:
      error.http_status = 429;
      error.type = "rate_limit_error";
      error.code = "resource_exhausted";
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
      error.http_status = 503;
      error.type = "server_error";
      error.code = "unavailable";
      break;
    default:
      error.http_status = 500;
      error.type = "server_error";
      break;
  }
  return error;
}

bool parse_openai_request(const std::string& body, bool chat, const OpenAiLimits& limits,
                          OpenAiRequest* request, OpenAiError* error) {
  // Depth-limited by nlohmann's recursion over the body, which max_body_bytes bounds; a parse
  // error is an exception here only.
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    *error = {.message = "the request body is not valid JSON", .code = "invalid_json"};
    return false;
  }
  if (!parsed.is_object()) {
    *error = {.message =
                  absl::StrCat("the request body must be a JSON object, got ", parsed.type_name())};
    return false;
  }
  if (std::optional<Refusal> refusal = parse(parsed, chat, limits, request)) {
    *error = {.message = std::move(refusal->message),
              .param = std::move(refusal->param),
              .code = std::move(refusal->code)};
    if (error->code == "model_not_found") error->http_status = 404;
    return false;
  }
  return true;
}

}  // namespace deft::server
