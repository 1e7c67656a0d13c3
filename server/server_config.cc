#include "server/server_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "engine/attention_planner.h"
#include "engine/forest.h"
#include "nlohmann/json.hpp"

namespace deft::server {
namespace {

using Member = std::variant<std::string ServerConfig::*, int32_t ServerConfig::*,
                            int64_t ServerConfig::*, double ServerConfig::*, bool ServerConfig::*>;

// One configurable field: its JSON key; its option is the key with '-' for '_'.
struct Field {
  const char* key;
  Member member;
  const char* help;
};

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      {"model", &ServerConfig::model,
       "Hugging Face model dir (config.json, *.safetensors, tokenizer); empty: the embedded "
       "default model"},
      {"listen", &ServerConfig::listen, "gRPC address host:port (port 0: any free port)"},
      {"metrics_listen", &ServerConfig::metrics_listen,
       "Prometheus /metrics address host:port (port 0: any free port); empty: no metrics"},
      {"http_listen", &ServerConfig::http_listen,
       "OpenAI-compatible HTTP API address host:port (/v1/completions, /v1/chat/completions, "
       "/v1/models, /health; port 0: any free port); empty: off"},
      {"chat_template", &ServerConfig::chat_template,
       "chat template of /v1/chat/completions: auto (llama3 when the tokenizer has its header "
       "tokens, else llama2) | llama3 | llama2"},
      {"http_threads", &ServerConfig::http_threads,
       "HTTP API connections served at once (each holds a thread while open; more wait)"},
      {"kv_pages", &ServerConfig::kv_pages, "KV cache pool size in pages"},
      {"page_tokens", &ServerConfig::page_tokens, "tokens per KV page"},
      {"prefix_cache_pages", &ServerConfig::prefix_cache_pages,
       "most KV pages finished requests' prompts and outputs keep cached for reuse by later "
       "prompts (least recently used evicted first, whenever pages are needed); -1: the whole "
       "pool; 0: no prefix cache (as --no-prefix-cache)"},
      {"max_queued_jobs", &ServerConfig::max_queued_jobs,
       "jobs waiting for admission before RESOURCE_EXHAUSTED"},
      {"max_tree_tokens", &ServerConfig::max_tree_tokens,
       "most tokens of one job: prompt + every branch"},
      {"max_prompt_tokens", &ServerConfig::max_prompt_tokens, "most tokens of one prompt"},
      {"max_branches", &ServerConfig::max_branches, "most branches (n) of one request"},
      {"default_max_tokens", &ServerConfig::default_max_tokens,
       "tokens per branch when a request's max_tokens is 0"},
      {"max_step_tokens", &ServerConfig::max_step_tokens,
       "token budget of one engine step (prefill + decode rows)"},
      {"max_prefill_tokens", &ServerConfig::max_prefill_tokens,
       "most prompt rows of one engine step, so running branches always get the rest of its "
       "budget; 0: half of max_step_tokens"},
      {"kv_admission", &ServerConfig::kv_admission,
       "step (admit for a job's next steps; when a step runs short of KV the newest job is "
       "preempted and recomputes later) | worst_case (reserve max_tokens on every branch)"},
      {"max_text_bytes", &ServerConfig::max_text_bytes,
       "most bytes of text in one request (prompt, Tokenize text, stop strings, delimiter)"},
      {"max_stop_sequences", &ServerConfig::max_stop_sequences,
       "most stop strings, and most stop token ids, of one request"},
      {"max_sessions", &ServerConfig::max_sessions, "most open TreeSessions"},
      {"max_session_nodes", &ServerConfig::max_session_nodes,
       "most nodes one TreeSession holds (each keeps its next-token logits)"},
      {"max_verify_entries", &ServerConfig::max_verify_entries,
       "most drafted tokens in one Verify"},
      {"max_verify_distribution_tokens", &ServerConfig::max_verify_distribution_tokens,
       "most (token, prob) pairs in one Verify's draft_distributions, all nodes together"},
      {"first_node_id", &ServerConfig::first_node_id,
       "node ids (TreeSession, Verify) start here, up to 2^62; a high start (e.g. 4294967296) "
       "checks that clients handle 64-bit ids"},
      {"backend", &ServerConfig::backend,
       "auto (CUDA when built with it and a GPU is visible, else CPU) | cpu | cuda"},
      {"device", &ServerConfig::device,
       "CUDA device of the cuda backend, as CUDA numbers them (after CUDA_VISIBLE_DEVICES); "
       "not used by the CPU backend"},
      {"tensor_parallel", &ServerConfig::tensor_parallel,
       "ranks of tensor parallelism, one per GPU (NCCL; the model's KV heads must divide by it); "
       "1: one GPU"},
      {"devices", &ServerConfig::devices,
       "CUDA devices of the tensor-parallel ranks, comma-separated (\"0,1\"); empty: "
       "0..tensor_parallel-1"},
      {"draft_model", &ServerConfig::draft_model,
       "draft model dir for server-side speculative decoding (a small model with the model's "
       "tokenizer; same backend); empty: none (the ngram policy needs none)"},
      {"speculative_tree", &ServerConfig::speculative_tree,
       "JSON file of the static speculation tree (a list of rank paths, most useful first); "
       "empty: the built-in default (configs/speculative_tree.json)"},
      {"draft_kv_pages", &ServerConfig::draft_kv_pages,
       "the draft model's KV pool in pages; 0: kv_pages"},
      {"max_speculative_tokens", &ServerConfig::max_speculative_tokens,
       "most drafted tokens a speculative request verifies per step (its tree_tokens)"},
      {"speculative_max_batch", &ServerConfig::speculative_max_batch,
       "speculation pauses in steps of more than this many requests (they decode plainly, the "
       "same tokens); 0: never"},
      {"plan", &ServerConfig::plan,
       "attention plan: deft_flatten | deft_node | deft_node_chunk | sequence | dense_mask"},
      {"chunk_tokens", &ServerConfig::chunk_tokens,
       "attention planner chunk size B; 0: chosen per tree (engine/attention_planner.h)"},
      {"min_prefill_run", &ServerConfig::min_prefill_run,
       "a run of at least this many new tokens of one node (a prompt, an extension) is attended by "
       "the tiled prefill kernel; 0: every row by the DeFT kernel"},
      {"deterministic", &ServerConfig::deterministic,
       "true: a request's tokens and logprobs are the same bits whatever other requests share its "
       "steps (batch-invariant GEMMs and attention; CUDA: compute 9.0 GPUs; min_prefill_run "
       "and plan are then ignored; slower, see the README); --deterministic alone means true"},
      {"shutdown_grace_seconds", &ServerConfig::shutdown_grace_seconds,
       "on SIGTERM/SIGINT, live jobs may finish this long before they are cancelled"},
      {"log_level", &ServerConfig::log_level, "trace | debug | info | warn | error | off"},
      {"log_format", &ServerConfig::log_format,
       "text | json (one JSON object a line; a request's line carries its id, peer, key id, "
       "RPC, status and duration)"},
      {"stream_stall_seconds", &ServerConfig::stream_stall_seconds,
       "a stream whose client has read no response for this long is cut and its KV freed (its "
       "work pauses once 256 answers wait); 0: never cut"},
      {"port_file", &ServerConfig::port_file,
       "write 'grpc=PORT', 'metrics=PORT' and 'http=PORT' lines here once listening (for tests)"},
      {"tls_cert", &ServerConfig::tls_cert,
       "PEM certificate (chain) of the gRPC port: TLS with tls_key; empty: plaintext"},
      {"tls_key", &ServerConfig::tls_key, "PEM private key of tls_cert"},
      {"tls_client_ca", &ServerConfig::tls_client_ca,
       "PEM CA certificates: mutual TLS, clients without a certificate signed by one are refused"},
      {"api_keys", &ServerConfig::api_keys,
       "file of API keys (KEY or ID:KEY a line, # comments); every call needs 'authorization: "
       "Bearer KEY'; reread on SIGHUP; empty: no keys"},
      {"auth_health", &ServerConfig::auth_health,
       "true: grpc.health.v1 needs an API key too (false: open, for probes)"},
      {"auth_reflection", &ServerConfig::auth_reflection,
       "true: server reflection needs an API key too (false: open; it describes only the "
       "public API)"},
      {"max_concurrent_per_key", &ServerConfig::max_concurrent_per_key,
       "most Generate, RunTree and TreeSession streams open at once per API key; 0: no limit"},
      {"max_queued_jobs_per_key", &ServerConfig::max_queued_jobs_per_key,
       "most Generate and RunTree jobs per API key submitted and not yet answering; 0: no limit"},
      {"max_tokens_per_minute_per_key", &ServerConfig::max_tokens_per_minute_per_key,
       "new requests and session decodes of an API key are refused while it generated this many "
       "tokens in the last 60 s; 0: no limit"},
  };
  return table;
}

std::string option_name(const Field& field) {
  return absl::StrCat("--", absl::StrReplaceAll(field.key, {{"_", "-"}}));
}

std::string value_text(const ServerConfig& config, const Field& field) {
  return std::visit(
      [&](auto member) -> std::string {
        const auto& value = config.*member;
        if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
          return absl::StrCat("\"", value, "\"");
        } else if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
          return value ? "true" : "false";
        } else {
          return absl::StrCat(value);
        }
      },
      field.member);
}

// Sets `field` from command-line text.
absl::Status set_from_text(ServerConfig& config, const Field& field, const std::string& text) {
  const std::string name = option_name(field);
  if (auto* member = std::get_if<std::string ServerConfig::*>(&field.member)) {
    config.** member = text;
  } else if (auto* member = std::get_if<int32_t ServerConfig::*>(&field.member)) {
    if (!absl::SimpleAtoi(text, &(config.**member))) {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, ": '", text, "' is not a 32-bit integer"));
    }
  } else if (auto* member = std::get_if<int64_t ServerConfig::*>(&field.member)) {
    if (!absl::SimpleAtoi(text, &(config.**member))) {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, ": '", text, "' is not a 64-bit integer"));
    }
  } else if (auto* member = std::get_if<bool ServerConfig::*>(&field.member)) {
    if (text == "true" || text == "1") {
      config.** member = true;
    } else if (text == "false" || text == "0") {
      config.** member = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, ": '", text, "' is not true or false"));
    }
  } else {
    const auto real = std::get<double ServerConfig::*>(field.member);
    if (!absl::SimpleAtod(text, &(config.*real)) || !std::isfinite(config.*real)) {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, ": '", text, "' is not a finite number"));
    }
  }
  return absl::OkStatus();
}

absl::Status set_from_json(ServerConfig& config, const Field& field, const nlohmann::json& value,
                           const std::string& source) {
  const auto bad = [&](const char* wanted) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", field.key, "\" is ", value.dump(), ", not ", wanted));
  };
  if (auto* member = std::get_if<std::string ServerConfig::*>(&field.member)) {
    if (!value.is_string()) return bad("a string");
    config.** member = value.get<std::string>();
  } else if (auto* member = std::get_if<int32_t ServerConfig::*>(&field.member)) {
    if (!value.is_number_integer()) return bad("an integer");
    const int64_t number = value.get<int64_t>();
    if (number < INT32_MIN || number > INT32_MAX) return bad("a 32-bit integer");
    config.** member = static_cast<int32_t>(number);
  } else if (auto* member = std::get_if<int64_t ServerConfig::*>(&field.member)) {
    if (!value.is_number_integer()) return bad("an integer");
    if (value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX) {
      return bad("a 64-bit integer");
    }
    config.** member = value.get<int64_t>();
  } else if (auto* member = std::get_if<bool ServerConfig::*>(&field.member)) {
    if (!value.is_boolean()) return bad("true or false");
    config.** member = value.get<bool>();
  } else {
    if (!value.is_number()) return bad("a number");
    config.*std::get<double ServerConfig::*>(field.member) = value.get<double>();
  }
  return absl::OkStatus();
}

const Field* find_field_by_key(const std::string& key) {
  for (const Field& field : fields()) {
    if (key == field.key) return &field;
  }
  return nullptr;
}

const Field* find_field_by_option(const std::string& option) {
  for (const Field& field : fields()) {
    if (option == option_name(field)) return &field;
  }
  return nullptr;
}

absl::Status load_config_file(const std::string& path, ServerConfig& config) {
  std::ifstream file(path);
  if (!file) return absl::InvalidArgumentError(absl::StrCat("--config: cannot read ", path));
  std::stringstream text;
  text << file.rdbuf();
  return apply_config_json(text.str(), path, config);
}

}  // namespace

absl::Status apply_config_json(const std::string& json_text, const std::string& source,
                               ServerConfig& config) {
  nlohmann::json root = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false,
                                              /*ignore_comments=*/true);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the top level must be an object"));
  }
  for (const auto& [key, value] : root.items()) {
    const Field* field = find_field_by_key(key);
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": unknown field \"", key, "\""));
    }
    if (absl::Status status = set_from_json(config, *field, value, source); !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CommandLine> parse_command_line(const std::vector<std::string>& args) {
  CommandLine result;
  // The --config file first, so the other options override it wherever they stand.
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (arg.rfind("--config=", 0) == 0) {
      if (absl::Status s = load_config_file(arg.substr(9), result.config); !s.ok()) return s;
    } else if (arg == "--config") {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError("option --config needs a value");
      if (absl::Status s = load_config_file(args[i + 1], result.config); !s.ok()) return s;
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (arg == "--help" || arg == "-h") {
      result.help = true;
      continue;
    }
    if (arg == "--no-prefix-cache") {
      result.config.prefix_cache_pages = 0;
      continue;
    }
    if (arg == "--deterministic" &&
        (i + 1 >= args.size() || (args[i + 1] != "true" && args[i + 1] != "false"))) {
      result.config.deterministic = true;  // a bare flag
      continue;
    }
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "--config") {
      if (!has_value) ++i;
      continue;
    }
    const Field* field = find_field_by_option(arg);
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", args[i], "' (see --help)"));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("option ", arg, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = set_from_text(result.config, *field, value); !s.ok()) return s;
  }
  return result;
}

int64_t max_request_bytes(const ServerConfig& config) {
  const int64_t tokens = int64_t{config.max_tree_tokens} + config.max_prompt_tokens +
                         config.max_verify_entries + config.max_verify_distribution_tokens;
  return int64_t{config.max_text_bytes} + 16 * tokens + (int64_t{1} << 20);
}

absl::StatusOr<std::vector<int>> tensor_parallel_devices(const ServerConfig& config) {
  std::vector<int> devices;
  if (config.devices.empty()) {
    for (int d = 0; d < config.tensor_parallel; ++d) devices.push_back(d);
    return devices;
  }
  for (absl::string_view part : absl::StrSplit(config.devices, ',')) {
    int device = -1;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &device) || device < 0) {
      return absl::InvalidArgumentError(absl::StrCat("config: devices = \"", config.devices,
                                                     "\": \"", part,
                                                     "\" is not a CUDA device number"));
    }
    if (std::find(devices.begin(), devices.end(), device) != devices.end()) {
      return absl::InvalidArgumentError(absl::StrCat("config: devices = \"", config.devices,
                                                     "\" names device ", device, " twice"));
    }
    devices.push_back(device);
  }
  if (static_cast<int32_t>(devices.size()) != config.tensor_parallel) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: devices = \"", config.devices, "\" names ", devices.size(),
        " devices but tensor_parallel = ", config.tensor_parallel, " (one device per rank)"));
  }
  return devices;
}

absl::Status validate_config(const ServerConfig& config) {
  const auto at_least = [](const char* key, int64_t value, int64_t minimum) {
    return value >= minimum ? absl::OkStatus()
                            : absl::InvalidArgumentError(absl::StrCat("config: ", key, " = ", value,
                                                                      " must be >= ", minimum));
  };
  for (const absl::Status& status : {
           at_least("kv_pages", config.kv_pages, 1),
           at_least("page_tokens", config.page_tokens, 1),
           at_least("prefix_cache_pages", config.prefix_cache_pages, -1),
           at_least("max_queued_jobs", config.max_queued_jobs, 0),
           at_least("max_tree_tokens", config.max_tree_tokens, 2),
           at_least("max_prompt_tokens", config.max_prompt_tokens, 1),
           at_least("max_branches", config.max_branches, 1),
           at_least("default_max_tokens", config.default_max_tokens, 1),
           at_least("max_step_tokens", config.max_step_tokens, 1),
           at_least("max_prefill_tokens", config.max_prefill_tokens, 0),
           at_least("max_text_bytes", config.max_text_bytes, 1),
           at_least("max_stop_sequences", config.max_stop_sequences, 0),
           at_least("chunk_tokens", config.chunk_tokens, 0),
           at_least("min_prefill_run", config.min_prefill_run, 0),
           at_least("max_sessions", config.max_sessions, 0),
           at_least("max_session_nodes", config.max_session_nodes, 1),
           at_least("max_verify_entries", config.max_verify_entries, 1),
           at_least("max_verify_distribution_tokens", config.max_verify_distribution_tokens, 0),
           at_least("first_node_id", config.first_node_id, 1),
           at_least("http_threads", config.http_threads, 1),
           at_least("max_concurrent_per_key", config.max_concurrent_per_key, 0),
           at_least("max_queued_jobs_per_key", config.max_queued_jobs_per_key, 0),
           at_least("max_tokens_per_minute_per_key", config.max_tokens_per_minute_per_key, 0),
           at_least("draft_kv_pages", config.draft_kv_pages, 0),
           at_least("max_speculative_tokens", config.max_speculative_tokens, 1),
           at_least("speculative_max_batch", config.speculative_max_batch, 0),
       }) {
    if (!status.ok()) return status;
  }
  if (config.first_node_id > engine::kMaxFirstNodeId) {
    return absl::InvalidArgumentError(absl::StrCat("config: first_node_id = ", config.first_node_id,
                                                   " must be <= 2^62 = ", engine::kMaxFirstNodeId,
                                                   " (ids must never run out)"));
  }
  if (config.listen.empty()) return absl::InvalidArgumentError("config: listen is empty");
  if (config.kv_admission != "step" && config.kv_admission != "worst_case") {
    return absl::InvalidArgumentError(absl::StrCat("config: kv_admission \"", config.kv_admission,
                                                   "\" is not step or worst_case"));
  }
  if (config.chat_template != "auto" && config.chat_template != "llama3" &&
      config.chat_template != "llama2") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: chat_template = \"", config.chat_template, "\" must be auto, llama3 or llama2"));
  }
  if (!(config.shutdown_grace_seconds >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: shutdown_grace_seconds = ", config.shutdown_grace_seconds, " must be >= 0"));
  }
  engine::PlanKind kind;
  if (absl::Status status = engine::parse_plan_kind(config.plan, &kind); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config: plan: ", status.message()));
  }
  if (config.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: device = ", config.device, " must be >= 0"));
  }
  if (config.tensor_parallel < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: tensor_parallel = ", config.tensor_parallel, " must be >= 1"));
  }
  if (absl::StatusOr<std::vector<int>> devices = tensor_parallel_devices(config); !devices.ok()) {
    return devices.status();
  }
  if (config.backend != "auto" && config.backend != "cpu" && config.backend != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: backend \"", config.backend, "\" is not one of auto, cpu, cuda"));
  }
  if (config.api_keys.empty()) {
    for (const auto& [key, value] :
         {std::pair<const char*, int64_t>{"max_concurrent_per_key", config.max_concurrent_per_key},
          {"max_queued_jobs_per_key", config.max_queued_jobs_per_key},
          {"max_tokens_per_minute_per_key", config.max_tokens_per_minute_per_key}}) {
      if (value != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config: ", key, " = ", value, " limits API keys: it needs api_keys (a key file)"));
      }
    }
    if (config.auth_health) {
      return absl::InvalidArgumentError("config: auth_health = true needs api_keys (a key file)");
    }
    if (config.auth_reflection) {
      return absl::InvalidArgumentError(
          "config: auth_reflection = true needs api_keys (a key file)");
    }
  }
  static const char* const kLevels[] = {"trace", "debug", "info", "warn", "error", "off"};
  bool known_level = false;
  for (const char* level : kLevels) known_level |= config.log_level == level;
  if (!known_level) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: log_level \"", config.log_level,
                     "\" is not one of trace, debug, info, warn, error, off"));
  }
  if (config.log_format != "text" && config.log_format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("config: log_format \"", config.log_format, "\" is not one of text, json"));
  }
  if (!(config.stream_stall_seconds >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: stream_stall_seconds = ", config.stream_stall_seconds, " must be >= 0"));
  }
  return absl::OkStatus();
}

std::string usage_text() {
  const ServerConfig defaults;
  std::string text =
      "usage: deft-server [--config FILE.json] [options]\n"
      "DeFT Server: tree-structured LLM decoding over gRPC (deft.v1.Deft), with the\n"
      "grpc.health.v1 health service, server reflection and Prometheus metrics.\n"
      "Options override the config file's fields of the same name (option --kv-pages is\n"
      "field \"kv_pages\"); both default as below.\n\n"
      "  --config FILE               JSON config file (see configs/default.json)\n";
  for (const Field& field : fields()) {
    absl::StrAppend(&text, "  ", option_name(field), " VALUE\n      ", field.help, " (default ",
                    value_text(defaults, field), ")\n");
  }
  absl::StrAppend(&text,
                  "  --no-prefix-cache           finished requests' KV is freed at once "
                  "(--prefix-cache-pages 0)\n"
                  "  --help                      this text\n");
  return text;
}

std::string describe_config(const ServerConfig& config) {
  std::string text;
  for (const Field& field : fields()) {
    absl::StrAppend(&text, text.empty() ? "" : " ", field.key, "=", value_text(config, field));
  }
  return text;
}

}  // namespace deft::server
