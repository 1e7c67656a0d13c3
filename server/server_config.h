// The server's configuration: a JSON file (configs/default.json) with command-line overrides.
// Every field has a default, so an empty file (or none) is a valid configuration; an unknown
// or malformed field or option is an error that names it (deft-server then exits with 2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::server {

struct ServerConfig {
  std::string model;  // Hugging Face model dir; empty: the embedded default
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus /metrics; empty: off
  // OpenAI-compatible HTTP API (server/openai_api.h); empty: off. configs/default.json turns
  // it on at 127.0.0.1:8000; the built-in default is off so that servers started without a
  // config (tests, several on one host) never contend for a fixed port.
  std::string http_listen;
  std::string chat_template = "auto";             // auto | llama3 | llama2 (server/chat_template.h)
  int32_t http_threads = 32;                      // HTTP API connections served at once
  int32_t kv_pages = 2048;                        // KV pool size in pages
  int32_t page_tokens = 16;                       // tokens per KV page (DESIGN.md §4)
  // Pages finished requests' KV may keep as a prefix cache (engine/prefix_cache.h); -1: the
  // whole pool (cached KV is evicted when pages are needed); 0: off (--no-prefix-cache).
  int32_t prefix_cache_pages = -1;
  int32_t max_queued_jobs = 64;    // jobs waiting for admission; more: RESOURCE_EXHAUSTED
  int32_t max_tree_tokens = 8192;  // prompt + every branch's tokens of one job
  int32_t max_prompt_tokens = 2048;
  int32_t max_branches = 64;           // n of Generate
  int32_t default_max_tokens = 64;     // per branch when a request leaves max_tokens at 0
  int32_t max_step_tokens = 2048;      // token budget of one engine step (prefills + decodes)
  int32_t max_prefill_tokens = 0;      // of which prompt chunks; 0: half of max_step_tokens
  // What admission keeps free for a live job (engine/scheduler.h): "step" (its next steps;
  // a step short of KV preempts the newest job, which recomputes later) | "worst_case"
  // (max_tokens on every branch; nothing is preempted).
  std::string kv_admission = "step";
  int32_t max_text_bytes = 1 << 20;    // Tokenize text, prompt text, stop strings together
  int32_t max_stop_sequences = 32;     // stop strings, and stop token ids, of one request each
  int32_t max_sessions = 64;           // open TreeSessions
  int32_t max_session_nodes = 1024;    // nodes one session holds (each keeps a logits row)
  int32_t max_verify_entries = 256;    // drafted tokens of one Verify
  // (token, prob) pairs of one Verify's draft distributions, all nodes together: 64 nodes of a
  // top-256 draft; 128 KiB of engine memory per queued Verify.
  int32_t max_verify_distribution_tokens = 16384;
  int64_t first_node_id = 1;           // node ids start here (<= 2^62; high: test 64-bit clients)
  std::string backend = "auto";        // auto (CUDA when built with it and a GPU is seen) | cpu | cuda
  int32_t device = 0;                  // CUDA device of the cuda backend
  // Tensor parallelism (models/tensor_parallel.h): ranks, one per GPU, and their CUDA devices
  // ("0,1"; empty: 0..tensor_parallel-1). The CPU backend runs the same sharding on threads.
  int32_t tensor_parallel = 1;
  std::string devices;
  // Server-side speculative decoding (engine/speculation/): the draft model's dir (same
  // tokenizer as the model; empty: none, the ngram policy still works), the static tree's rank
  // paths (a JSON file; empty: the built-in default, configs/speculative_tree.json), the draft's
  // KV pool (0: kv_pages) and the largest tree a request may ask for.
  std::string draft_model;
  std::string speculative_tree;
  int32_t draft_kv_pages = 0;
  int32_t max_speculative_tokens = 128;
  int32_t speculative_max_batch = 0;   // engine::SchedulerOptions::speculative_max_batch
  std::string plan = "deft_flatten";   // attention plan kind (engine/attention_planner.h)
  int32_t chunk_tokens = 0;            // planner chunk size B; 0: adaptive
  int32_t min_prefill_run = 64;        // runs of >= this many new tokens use the prefill kernel; 0: off
  // A request's tokens and logprobs do not depend on which other requests share its steps
  // (engine::PlannerOptions::deterministic, models::LlamaCudaOptions::deterministic); the
  // README's "Deterministic mode" says what is promised and what it costs.
  bool deterministic = false;
  double shutdown_grace_seconds = 10;  // SIGTERM: live jobs may finish this long, then cancel
  std::string log_level = "info";      // trace | debug | info | warn | error | off
  std::string log_format = "text";     // text | json (JSON lines: server/log_format.h)
  // A stream whose client has accepted no response for this long is cut and its KV freed
  // (server/stream_watchdog.h); 0: never (the work stays paused for its reader).
  double stream_stall_seconds = 60;
  std::string port_file;               // when set: the bound ports are written there
  // Security (README "Security"): TLS, mutual TLS, API keys, per-key limits (0: no limit).
  std::string tls_cert;                       // PEM certificate chain; empty: plaintext
  std::string tls_key;                        // PEM private key of tls_cert
  std::string tls_client_ca;                  // PEM CAs of client certificates: mutual TLS
  std::string api_keys;                       // key file (server/auth.h); empty: no keys
  bool auth_health = false;                   // grpc.health.v1 needs a key too
  bool auth_reflection = false;               // server reflection needs a key too
  int32_t max_concurrent_per_key = 0;         // Generate + RunTree + TreeSession streams
  int32_t max_queued_jobs_per_key = 0;        // jobs submitted, not yet answering
  int64_t max_tokens_per_minute_per_key = 0;  // generated tokens in the last 60 s
};

// What parse_command_line() asks main to do.
struct CommandLine {
  ServerConfig config;
  bool help = false;
};

// Parses a config file's JSON text into `config` (fields not in the text keep their values).
// INVALID_ARGUMENT names the unknown field or the field with a wrong type or value.
absl::Status apply_config_json(const std::string& json_text, const std::string& source,
                               ServerConfig& config);

// Defaults, then the --config file (when given), then the other options in order.
// INVALID_ARGUMENT names the unknown or malformed option.
absl::StatusOr<CommandLine> parse_command_line(const std::vector<std::string>& args);

// Range checks across fields (positive sizes, a known plan kind, a known log level, ...).
absl::Status validate_config(const ServerConfig& config);

// The largest request message the gRPC port accepts (ServerBuilder::SetMaxReceiveMessageSize):
// max_text_bytes, 16 bytes per token the limits allow (a token id, a verify parent and a draft
// probability take at most 14 on the wire; a draft distribution's token and prob at most 9) and
// 1 MiB for everything else. gRPC refuses a larger
// message with RESOURCE_EXHAUSTED before parsing it, so one request's memory is bounded by the
// limits rather than by gRPC's 4 MiB default.
int64_t max_request_bytes(const ServerConfig& config);

// The CUDA devices of the tensor-parallel ranks: `devices` parsed, or 0..tensor_parallel-1.
// INVALID_ARGUMENT for a malformed list, a negative or repeated device, or a count other than
// tensor_parallel.
absl::StatusOr<std::vector<int>> tensor_parallel_devices(const ServerConfig& config);

// The --help text: every option with its default.
std::string usage_text();

// One line: the effective configuration, for the startup log.
std::string describe_config(const ServerConfig& config);

}  // namespace deft::server
