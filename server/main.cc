// deft-server: loads the configuration and the model, starts the engine thread, the gRPC
// service (with the grpc.health.v1 health service and server reflection; plaintext, TLS or
// mutual TLS; API keys when configured) and the Prometheus exposer, and runs until SIGTERM or
// SIGINT: then it stops admitting, lets live jobs finish for shutdown_grace_seconds, cancels the
// rest, and exits 0. SIGHUP rereads the API key file. Exit 2: bad configuration (also an
// unreadable or invalid TLS or key file); exit 1: the model or a listening address could not be
// set up.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/speculation/static_tree.h"
#include "engine/tokenizer/tokenizer.h"
#include "models/default_model.h"
#include "models/dtype.h"
#include "models/llama_cpu.h"
#ifdef DEFT_HAVE_CUDA
#include "models/llama_cuda.h"
#endif
#include "models/model_config.h"
#include "server/auth.h"
#include "server/chat_template.h"
#include "server/deft_service.h"
#include "server/engine_thread.h"
#include "server/health_service.h"
#include "server/log_format.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/protobuf_log.h"
#include "server/reflection_service.h"
#include "server/server_config.h"
#include "server/tls.h"
#include "spdlog/spdlog.h"

namespace {

using deft::server::ServerConfig;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::filesystem::path model_dir(const ServerConfig& config) {
  if (!config.model.empty()) return config.model;
  return deft::models::default_model_dir();
}

// Writes the bound ports for a supervisor or a test, atomically (write, then rename).
bool write_port_file(const std::string& path, int grpc_port, int metrics_port, int http_port) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream file(temporary);
    file << "grpc=" << grpc_port << "\nmetrics=" << metrics_port << "\n";
    if (http_port > 0) file << "http=" << http_port << "\n";
    if (!file) return false;
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  return !error;
}

int fail(int code, const std::string& message) {
  spdlog::critical("{}", message);
  return code;
}

// SIGHUP: the key file is reread; a bad file keeps the keys in use.
void reload_keys(deft::server::Authenticator& auth) {
  if (!auth.enabled()) {
    spdlog::info("SIGHUP received: no api_keys file to reload");
    return;
  }
  const absl::StatusOr<size_t> loaded = auth.reload();
  if (loaded.ok()) {
    spdlog::info("SIGHUP received: {} API keys loaded", *loaded);
  } else {
    spdlog::error("SIGHUP received: {}; the keys in use stay",
                  std::string(loaded.status().message()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<deft::server::CommandLine> command_line = deft::server::parse_command_line(args);
  if (!command_line.ok()) {
    std::fprintf(stderr, "deft-server: %s\n", std::string(command_line.status().message()).c_str());
    return 2;
  }
  if (command_line->help) {
    std::fputs(deft::server::usage_text().c_str(), stdout);
    return 0;
  }
  const ServerConfig config = command_line->config;
  if (absl::Status status = deft::server::validate_config(config); !status.ok()) {
    std::fprintf(stderr, "deft-server: %s\n", std::string(status.message()).c_str());
    return 2;
  }

  deft::server::configure_logging(config.log_format, config.log_level);
  spdlog::info("deft-server: config {}", deft::server::describe_config(config));
  deft::server::route_protobuf_logs();

  // Signals are taken by sigwait() below; block them before any thread starts (gRPC starts
  // its own when the first credentials are made) so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Credentials and keys before anything listens: a bad file is a bad configuration.
  const deft::server::TlsFiles tls_files{
      .cert = config.tls_cert, .key = config.tls_key, .client_ca = config.tls_client_ca};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      deft::server::server_credentials(tls_files);
  if (!credentials.ok()) return fail(2, std::string(credentials.status().message()));
  std::unique_ptr<deft::server::Authenticator> auth =
      std::make_unique<deft::server::Authenticator>();
  if (!config.api_keys.empty()) {
    absl::StatusOr<std::unique_ptr<deft::server::Authenticator>> loaded =
        deft::server::Authenticator::from_file(config.api_keys);
    if (!loaded.ok()) return fail(2, std::string(loaded.status().message()));
    auth = std::move(*loaded);
  }

  // ---- Metrics and gRPC first, NOT_SERVING until the model is loaded ----
  // A supervisor sees the process listening at once (a large model loads for minutes): liveness
  // probes pass, readiness probes and the health service say NOT_SERVING, and every RPC answers
  // UNAVAILABLE until the engine runs. A busy port fails the start before the load.
  // Declared before the engine: the engine reports to it until it stops.
  deft::server::ServerMetrics metrics;
  int metrics_port = 0;
  if (!config.metrics_listen.empty()) {
    std::string error;
    metrics_port = metrics.listen(config.metrics_listen, &error);
    if (metrics_port < 0) return fail(1, error);
    spdlog::info("metrics: http://{}/metrics (port {})", config.metrics_listen, metrics_port);
  }
  deft::server::DeftService service(config, *auth, &metrics);
  // Starts NOT_SERVING; our own services (not gRPC's default ones) so that they can require a
  // key.
  deft::server::HealthService health(*auth, config.auth_health);
  deft::server::ReflectionService reflection(
      *auth, config.auth_reflection,
      {"deft.v1.Deft", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"});
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and the
  // kernel would split new connections between the two (sessions then seem to vanish).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  const int64_t request_bytes = deft::server::max_request_bytes(config);
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(request_bytes, std::numeric_limits<int>::max())));
  // Keepalive: ping a connection idle for a minute and drop it when 20 s pass without an
  // answer, so a half-open connection (a client host gone without a FIN) frees its sessions'
  // KV; accept clients' own pings down to every 10 s, also without calls in flight.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  spdlog::info("gRPC: requests up to {} bytes; keepalive ping after 60 s idle", request_bytes);
  int grpc_port = 0;
  builder.AddListeningPort(config.listen, *credentials, &grpc_port);
  builder.RegisterService(&service);
  builder.RegisterService(&health);
  builder.RegisterService(&reflection);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    return fail(1, absl::StrCat("gRPC: cannot listen on ", config.listen,
                                " (in use, or not an address of this machine)"));
  }
  // The OpenAI-compatible HTTP API (off when http_listen is empty): 503 until the model loads.
  deft::server::OpenAiApi openai(config, *auth, service.key_limits(), &metrics);
  int http_port = 0;
  if (!config.http_listen.empty()) {
    absl::StatusOr<int> bound = openai.listen();
    if (!bound.ok()) {
      server->Shutdown();
      return fail(1, std::string(bound.status().message()));
    }
    http_port = *bound;
    spdlog::info("HTTP API: http://{}/v1 (port {}{}); 503 while the model loads",
                 config.http_listen, http_port, auth->enabled() ? ", API keys required" : "");
  }
  const auto stop_grpc = [&server, &health, &openai] {
    openai.stop();
    health.shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server->Wait();
  };
  const auto fail_loading = [&stop_grpc](int code, const std::string& message) {
    stop_grpc();
    return fail(code, message);
  };
  if (!config.port_file.empty() &&
      !write_port_file(config.port_file, grpc_port, metrics_port, http_port)) {
    spdlog::error("cannot write the port file {}", config.port_file);
  }
  spdlog::info("gRPC: listening on {} (port {}, {}{}); NOT_SERVING while the model loads",
               config.listen, grpc_port, deft::server::describe_transport(tls_files),
               auth->enabled() ? ", API keys required" : "");

  // ---- Model, tokenizer, engine ----
  const std::filesystem::path dir = model_dir(config);
  const auto load_start = std::chrono::steady_clock::now();
  absl::StatusOr<deft::models::ModelConfig> model_config = deft::models::load_model_config(dir);
  if (!model_config.ok())
    return fail_loading(1, absl::StrCat("model: ", model_config.status().message()));
  absl::StatusOr<std::unique_ptr<deft::engine::Tokenizer>> tokenizer =
      deft::engine::load_tokenizer(dir.string());
  if (!tokenizer.ok())
    return fail_loading(1, absl::StrCat("tokenizer: ", tokenizer.status().message()));
  if ((*tokenizer)->eos_ids().empty()) (*tokenizer)->set_eos_ids(model_config->eos_token_ids);
  const int64_t kv_slots = int64_t{config.kv_pages} * config.page_tokens;
  std::unique_ptr<deft::engine::ModelRunner> runner;
  std::string backend = "cpu";
  size_t weight_bytes = 0;
  // Validated by validate_config: one device per rank.
  const std::vector<int> tp_devices = *deft::server::tensor_parallel_devices(config);
  const int32_t tp = config.tensor_parallel;
#ifdef DEFT_HAVE_CUDA
  if (config.backend != "cpu") {
    const deft::models::LlamaCudaOptions cuda_options{.num_kv_slots = kv_slots,
                                                      .page_tokens = config.page_tokens,
                                                      .max_batch_rows = config.max_step_tokens,
                                                      .device = config.device,
                                                      .deterministic = config.deterministic};
    absl::StatusOr<std::unique_ptr<deft::engine::ModelRunner>> cuda;
    if (tp > 1) {
      cuda = deft::models::LlamaCudaRunner::load_tensor_parallel(dir, cuda_options, tp_devices);
    } else if (absl::StatusOr<std::unique_ptr<deft::models::LlamaCudaRunner>> one =
                   deft::models::LlamaCudaRunner::load(dir, cuda_options);
               one.ok()) {
      weight_bytes = (*one)->weight_bytes();
      cuda = std::move(*one);
    } else {
      cuda = one.status();
    }
    if (cuda.ok()) {
      runner = std::move(*cuda);
      backend = "cuda";
    } else if (config.backend == "cuda" ||
               cuda.status().code() != absl::StatusCode::kFailedPrecondition) {
      return fail_loading(1, absl::StrCat("model (cuda backend): ", cuda.status().message()));
    } else {
      spdlog::info("backend auto: {}; using the CPU backend", cuda.status().ToString());
    }
  }
#else
  if (config.backend == "cuda") {
    return fail_loading(2, "backend cuda: this build has no CUDA (configure with CUDA to use it)");
  }
#endif
  if (runner == nullptr) {
    if (config.device != 0) {
      spdlog::warn("device {} is not used: the model runs on the CPU backend", config.device);
    }
    if (tp > 1) {
      // The CPU twin of tensor parallelism: the same shards, ranks on threads.
      absl::StatusOr<std::unique_ptr<deft::engine::ModelRunner>> cpu =
          deft::models::LlamaCpuRunner::load_tensor_parallel(dir, kv_slots, tp);
      if (!cpu.ok()) return fail_loading(1, absl::StrCat("model: ", cpu.status().message()));
      runner = std::move(*cpu);
    } else {
      absl::StatusOr<std::unique_ptr<deft::models::LlamaCpuRunner>> cpu =
          deft::models::LlamaCpuRunner::load(dir, kv_slots);
      if (!cpu.ok()) return fail_loading(1, absl::StrCat("model: ", cpu.status().message()));
      weight_bytes = (*cpu)->weight_bytes();
      runner = std::move(*cpu);
    }
  }
  spdlog::info(
      "model: {} ({}, {} layers, vocab {}, {} KV slots, {:.1f} MB weights) on the {} "
      "backend, loaded in {:.2f} s",
      dir.string(), model_config->architecture, model_config->num_hidden_layers,
      model_config->vocab_size, kv_slots, weight_bytes / 1e6,
      backend == "cuda" && tp > 1
          ? absl::StrCat("cuda (tensor parallel over devices ", absl::StrJoin(tp_devices, ","), ")")
      : backend == "cuda" ? absl::StrCat("cuda (device ", config.device, ")")
      : tp > 1            ? absl::StrCat("cpu (tensor parallel twin, ", tp, " ranks)")
                          : backend,
      seconds_since(load_start));

  // ---- The speculative draft model (optional): same backend, its own KV pool ----
  // Whole on one device: the model's, or its first rank's under tensor parallelism (a draft is
  // a few percent of the model: sharding it would add collectives to every draft pass).
  std::unique_ptr<deft::engine::ModelRunner> draft;
  std::string draft_name;
  if (!config.draft_model.empty()) {
    const std::filesystem::path draft_dir(config.draft_model);
    const int64_t draft_slots =
        int64_t{config.draft_kv_pages > 0 ? config.draft_kv_pages : config.kv_pages} *
        config.page_tokens;
    const auto draft_start = std::chrono::steady_clock::now();
    std::string draft_where = "the CPU backend";
#ifdef DEFT_HAVE_CUDA
    if (backend == "cuda") {
      const int draft_device = tp > 1 ? tp_devices.front() : config.device;
      absl::StatusOr<std::unique_ptr<deft::models::LlamaCudaRunner>> cuda =
          deft::models::LlamaCudaRunner::load(draft_dir, {.num_kv_slots = draft_slots,
                                                          .page_tokens = config.page_tokens,
                                                          .max_batch_rows = config.max_step_tokens,
                                                          .device = draft_device});
      if (!cuda.ok())
        return fail_loading(1, absl::StrCat("draft model: ", cuda.status().message()));
      draft = std::move(*cuda);
      draft_where = absl::StrCat("CUDA device ", draft_device);
    }
#endif
    if (draft == nullptr) {
      absl::StatusOr<std::unique_ptr<deft::models::LlamaCpuRunner>> cpu =
          deft::models::LlamaCpuRunner::load(draft_dir, draft_slots);
      if (!cpu.ok()) return fail_loading(1, absl::StrCat("draft model: ", cpu.status().message()));
      draft = std::move(*cpu);
    }
    if (draft->vocab_size() != model_config->vocab_size) {
      return fail_loading(1, absl::StrCat("draft model ", draft_dir.string(),
                                          ": its vocabulary has ", draft->vocab_size(),
                                          " tokens but the model's has ", model_config->vocab_size,
                                          " (a draft model must share the model's tokenizer)"));
    }
    std::filesystem::path draft_path = draft_dir.lexically_normal();
    if (draft_path.filename().empty()) draft_path = draft_path.parent_path();
    draft_name = draft_path.filename().string();
    spdlog::info("draft model: {} ({} layers, {} KV slots) on {}, loaded in {:.2f} s",
                 draft_dir.string(), draft->info().num_layers, draft_slots, draft_where,
                 seconds_since(draft_start));
  }
  std::shared_ptr<const deft::engine::StaticTree> speculative_tree;
  if (config.speculative_tree.empty()) {
    speculative_tree =
        std::make_shared<const deft::engine::StaticTree>(deft::engine::default_static_tree(63, 6));
  } else {
    std::ifstream file(config.speculative_tree);
    std::stringstream text;
    text << file.rdbuf();
    if (!file) {
      return fail_loading(2,
                          absl::StrCat("speculative_tree: cannot read ", config.speculative_tree));
    }
    absl::StatusOr<deft::engine::StaticTree> tree = deft::engine::StaticTree::from_json(text.str());
    if (!tree.ok()) {
      return fail_loading(2, absl::StrCat("speculative_tree ", config.speculative_tree, ": ",
                                          tree.status().message()));
    }
    speculative_tree = std::make_shared<const deft::engine::StaticTree>(*std::move(tree));
  }

  deft::server::ModelFacts facts{
      .name = dir.filename().string() == "default" ? "default (embedded)" : dir.filename().string(),
      .architecture = model_config->architecture,
      .vocab_size = model_config->vocab_size,
      .max_context = model_config->max_position_embeddings,
      .num_layers = model_config->num_hidden_layers,
      .hidden_size = model_config->hidden_size,
      .num_q_heads = model_config->num_attention_heads,
      .num_kv_heads = model_config->num_key_value_heads,
      .dtype = std::string(deft::models::dtype_name(model_config->torch_dtype)),
      .backend = backend,
      .draft_model = draft_name,
      .speculation = {.draft_model = draft != nullptr,
                      .tree = speculative_tree,
                      .max_tree_tokens = config.max_speculative_tokens},
  };

  deft::engine::SchedulerOptions engine_options{
      .page_tokens = config.page_tokens,
      .kv_pages = config.kv_pages,
      .max_queued_works = config.max_queued_jobs,
      .admission = config.kv_admission == "step" ? deft::engine::Admission::kStep
                                                 : deft::engine::Admission::kWorstCase,
      .max_step_tokens = config.max_step_tokens,
      .max_prefill_tokens = config.max_prefill_tokens,
      .first_node_id = config.first_node_id,
      .prefix_cache_pages = config.prefix_cache_pages,
      .sessions = {.max_sessions = config.max_sessions,
                   .max_nodes = config.max_session_nodes,
                   .max_branches = config.max_branches,
                   .max_verify_entries = config.max_verify_entries,
                   .max_context = model_config->max_position_embeddings},
      .draft_kv_pages = config.draft_kv_pages,
      .speculative_max_batch = config.speculative_max_batch,
  };
  engine_options.planner.chunk_tokens = config.chunk_tokens;
  engine_options.planner.min_prefill_run = config.min_prefill_run;
  engine_options.planner.deterministic = config.deterministic;
  if (config.deterministic) {
    spdlog::info(
        "deterministic mode: a request's tokens do not depend on the other requests of its steps "
        "(attention in fixed pieces of {} tokens of its own path, batch-invariant GEMMs)",
        config.chunk_tokens > 0 ? config.chunk_tokens : deft::engine::kDeterministicChunkTokens);
  }
  if (absl::Status status =
          deft::engine::parse_plan_kind(config.plan, &engine_options.planner.kind);
      !status.ok()) {
    return fail_loading(2, std::string(status.message()));
  }
  absl::StatusOr<std::unique_ptr<deft::server::EngineThread>> engine =
      deft::server::EngineThread::start(engine_options, std::move(runner), **tokenizer, &metrics,
                                        std::move(draft));
  if (!engine.ok()) return fail_loading(1, std::string(engine.status().message()));

  // ---- Serving ----
  absl::StatusOr<deft::server::ChatTemplate> chat_template =
      deft::server::choose_chat_template(config.chat_template, **tokenizer);
  if (!chat_template.ok()) return fail_loading(2, std::string(chat_template.status().message()));
  // The id HTTP requests name in "model": the model folder's name ("default" when embedded).
  std::filesystem::path model_path = dir.lexically_normal();
  if (model_path.filename().empty()) model_path = model_path.parent_path();
  openai.attach(model_path.filename().string(), facts, **tokenizer, **engine, *chat_template);
  spdlog::info("HTTP API: model id \"{}\", chat template {}", model_path.filename().string(),
               deft::server::chat_template_name(*chat_template));
  service.attach(std::move(facts), **tokenizer, **engine);
  health.set_serving(true);
  openai.set_serving(true);
  spdlog::info("serving: deft.v1.Deft, grpc.health.v1.Health and reflection on {} (port {})",
               config.listen, grpc_port);

  // ---- Run until a signal (SIGHUP: reload the keys and go on) ----
  int signal_number = 0;
  while (sigwait(&signals, &signal_number) == 0 && signal_number == SIGHUP) reload_keys(*auth);
  const auto grace =
      std::chrono::milliseconds(static_cast<int64_t>(config.shutdown_grace_seconds * 1000.0));
  spdlog::info(
      "{} received: shutting down (no new jobs; live jobs have {:.1f} s to finish; a "
      "second signal cancels them)",
      signal_number == SIGTERM ? "SIGTERM" : "SIGINT", config.shutdown_grace_seconds);
  // Stop admitting first, then tell the probes: a client that sees NOT_SERVING can rely on new
  // work being refused (UNAVAILABLE), never admitted into the drain.
  (*engine)->begin_shutdown(grace);
  health.set_serving(false);
  openai.set_serving(false);
  // A second signal cuts the grace short. The watcher is woken by a signal of our own once
  // the shutdown is over, so it never outlives the engine.
  std::atomic<bool> shut_down{false};
  std::thread second_signal([&signals, &shut_down, &auth, engine = engine->get()] {
    int again = 0;
    int error = 0;
    while ((error = sigwait(&signals, &again)) == 0 && again == SIGHUP && !shut_down.load()) {
      reload_keys(*auth);
    }
    if (error == 0 && again != SIGHUP && !shut_down.load()) {
      spdlog::warn("second signal: cancelling live jobs now");
      engine->begin_shutdown(std::chrono::milliseconds(0));
    }
  });
  // The engine first: it refuses new jobs, lets live ones run for the grace, then cancels them,
  // which ends their streaming handlers within a poll interval. Then gRPC, with a short
  // backstop for calls still in flight (the unary ones take milliseconds).
  (*engine)->shutdown(grace);
  stop_grpc();
  shut_down.store(true);
  pthread_kill(second_signal.native_handle(), SIGTERM);
  second_signal.join();
  spdlog::info("deft-server: stopped");
  return 0;
}
