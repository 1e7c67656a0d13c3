// serve_bench: the serving benchmark (issue 35, part 2). A real gRPC client drives deft-server
// over loopback, started once per attention plan (or already running), with a mix of few-shot,
// tree-of-thought (RunTree and client-driven TreeSession) and speculative-decoding jobs at
// closed-loop concurrency levels and open-loop arrival rates. Per (mix, plan, level) it reports
// client-side tokens/s, time to first token, inter-token latency, job latency and failures, and
// the server's KV pages, steps/s, rows per step and step time from its /metrics; it writes
// bench/results/server_load-<hardware>-<yyyymmdd>.json and prints a table (`--help`).
//
//   serve_bench.cc      the run: servers, warm-up, levels, output
//   serve_options.*     flags and --help          job_mix.*          kinds and their weights
//   server_process.*    the deft-server child     metrics_scraper.*  its /metrics
//   load_driver.*       one level's clients       level_summary.*    its figures, row, table
//   workload_shapes.*   job shapes from the traces
//   job.*, session_client.*, {generate,runtree,session,spec}_job.cc   the jobs
#include <array>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "bench/bench_result.h"
#include "bench/serve_bench/job.h"
#include "bench/serve_bench/level_summary.h"
#include "bench/serve_bench/load_driver.h"
#include "bench/serve_bench/metrics_scraper.h"
#include "bench/serve_bench/serve_options.h"
#include "bench/serve_bench/server_process.h"

namespace deft::bench::serve {
namespace {

// The GPU's name as the driver gives it (nvidia-smi: the client has no CUDA of its own); empty
// when it cannot be read.
std::string gpu_name() {
  std::string name;
  if (FILE* pipe = popen("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null", "r")) {
    std::array<char, 256> line{};
    if (fgets(line.data(), line.size(), pipe) != nullptr) name = line.data();
    pclose(pipe);
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

// The hardware the server runs on (the file's "hardware" and the tag in its name), as the
// other benchmarks name it: the CPU model for the CPU backend, the GPU for CUDA.
std::pair<std::string, std::string> hardware(const v1::ModelInfoResponse& info) {
  if (info.backend() != "cuda") return {BenchResult::cpu_name(), "cpu"};
  const std::string gpu = gpu_name();
  return {gpu.empty() ? "unknown NVIDIA GPU" : gpu, BenchResult::gpu_tag(gpu)};
}

absl::StatusOr<v1::ModelInfoResponse> model_info(const std::string& address) {
  auto stub = v1::Deft::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ModelInfoResponse info;
  const grpc::Status status = stub->ModelInfo(&context, v1::ModelInfoRequest(), &info);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("ModelInfo: ", status.error_message()));
  }
  return info;
}

// The server of `plan`: started, or the one at --address (whatever plan it runs).
absl::StatusOr<std::unique_ptr<ServerProcess>> server_for(const ServeOptions& options,
                                                          const std::string& plan,
                                                          const std::string& admission) {
  if (!options.address.empty()) {
    return ServerProcess::attach(options.address, options.metrics_address,
                                 options.server_start_timeout_s);
  }
  std::vector<std::string> args = options.server_args;
  if (!admission.empty()) args.insert(args.end(), {"--kv-admission", admission});
  std::fprintf(stderr, "serve_bench: starting %s --plan %s%s%s\n", options.server_binary.c_str(),
               plan.c_str(), admission.empty() ? "" : " --kv-admission ", admission.c_str());
  return ServerProcess::start(options.server_binary, args, plan, options.server_start_timeout_s);
}

// Job indices: distinct for every (mix, level) and the warm-up, equal across plans, so every
// plan sees the same jobs and no two levels send the same prompt.
uint64_t first_job_index(size_t mix, size_t level) {
  return (uint64_t{mix} << 48) | (uint64_t{level} << 32);
}
constexpr uint64_t kWarmupJobs = uint64_t{0xffff} << 48;

// What the run has gathered so far, across plans.
struct RunState {
  std::optional<BenchResult> result;  // made once the first server says what it runs on
  std::vector<LevelSummary> summaries;
  bool any_failed = false;
  bool kind_missing = false;
  std::atomic<int64_t> received_tokens{0};
};

// Runs `count` jobs of each kind one at a time; false (with the reason on stderr) when one
// fails, which is most often a server limit the job shapes pass.
bool warm_up(LoadDriver& driver, const std::set<JobKind>& kinds, int32_t count) {
  for (const JobKind kind : kinds) {
    const uint64_t first_index = kWarmupJobs + (uint64_t{static_cast<uint8_t>(kind)} << 32);
    for (const JobRecord& job : driver.run_sequentially(kind, count, first_index)) {
      if (job.ok()) continue;
      std::fprintf(stderr,
                   "serve_bench: a warm-up %s job failed: %s: %s\n"
                   "(a limit of the server? raise it with --server-args, e.g. "
                   "--max-prompt-tokens, --max-tree-tokens, --kv-pages; or shrink the job)\n",
                   job_kind_name(kind), job.failure.c_str(), job.failure_message.c_str());
      return false;
    }
  }
  return true;
}

// Reports a finished level on stderr and keeps its summary; its row goes into the result
// unless a job answered wrongly or none finished.
void record_level(LevelSummary summary, const JobMix& mix, const std::string& label,
                  RunState& state) {
  std::fprintf(stderr,
               "%s %lld jobs done, %lld failed, %.0f tok/s over %.1f s (+%.1f s drain)%s%s\n",
               label.c_str(), static_cast<long long>(summary.all.done),
               static_cast<long long>(summary.all.failed), summary.tokens_per_s, summary.window_s,
               summary.drain_s, summary.all.first_failure.empty() ? "" : "; e.g. ",
               summary.all.first_failure.c_str());
  state.any_failed = state.any_failed || summary.all.failed > 0;
  for (const JobMix::Entry& entry : mix.entries) {
    const auto figures = summary.by_kind.find(job_kind_name(entry.kind));
    if (figures == summary.by_kind.end() || figures->second.done == 0) {
      std::fprintf(stderr, "%s no %s job finished\n", label.c_str(), job_kind_name(entry.kind));
      state.kind_missing = true;
    }
  }
  if (summary.all.wrong_output()) {
    std::fprintf(stderr, "%s wrong answers: the row is not written\n", label.c_str());
  } else if (summary.all.done == 0) {
    std::fprintf(stderr, "%s no job finished: the row is not written\n", label.c_str());
  } else {
    state.result->add(result_row(summary));
  }
  state.summaries.push_back(std::move(summary));
}

// One plan: its server, the warm-up, then every mix at every level. False when the server
// does not come up or the warm-up fails.
bool run_plan(const ServeOptions& options, const std::string& plan, const std::string& admission,
              const WorkloadShapes& shapes, const std::set<JobKind>& kinds,
              const std::vector<LoadLevel>& levels, int argc, char** argv, RunState& state) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = server_for(options, plan, admission);
  if (!server.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(server.status().message()).c_str());
    return false;
  }
  const absl::StatusOr<v1::ModelInfoResponse> info = model_info((*server)->address());
  if (!info.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(info.status().message()).c_str());
    return false;
  }
  const std::string plan_name = admission.empty()
                                    ? info->attention()
                                    : absl::StrCat(info->attention(), "+admission=", admission);
  std::fprintf(stderr,
               "serve_bench: %s serving %s (%s backend, plan %s, vocab %d, KV %lld tokens in "
               "pages of %d)\n",
               (*server)->address().c_str(), info->name().c_str(), info->backend().c_str(),
               plan_name.c_str(), info->vocab_size(),
               static_cast<long long>(info->kv_capacity_tokens()), info->page_tokens());
  if (!state.result) {
    const auto [name, tag] = hardware(*info);
    state.result.emplace(options.benchmark, name, tag, argc, argv);
  }

  JobEnv env;
  env.options = &options;
  env.shapes = &shapes;
  env.model = {.vocab_size = info->vocab_size(),
               .bos_token_id = info->bos_token_id(),
               .eos_token_ids = {info->eos_token_ids().begin(), info->eos_token_ids().end()},
               .max_context = info->max_context()};
  env.received_tokens = &state.received_tokens;
  MetricsScraper metrics((*server)->metrics_address());
  LoadDriver driver((*server)->address(), env, &metrics);
  if (!warm_up(driver, kinds, options.warmup_jobs)) return false;

  for (size_t m = 0; m < options.mixes.size(); ++m) {
    const JobMix& mix = options.mixes[m];
    for (size_t l = 0; l < levels.size(); ++l) {
      const std::string label =
          absl::StrCat("[", plan_name, " ", mix.name(), " ", levels[l].name(), "]");
      std::fprintf(stderr, "%s start\n", label.c_str());
      const LevelRun run = driver.run(levels[l], mix, first_job_index(m, l), label);
      record_level(summarize_level(run, mix.name(), plan_name, levels[l]), mix, label, state);
    }
  }
  std::fprintf(stderr, "serve_bench: stopping the server of plan %s\n", plan_name.c_str());
  return true;
}

int run(int argc, char** argv) {
  bool help = false;
  absl::StatusOr<ServeOptions> parsed = parse_serve_options(argc, argv, &help);
  if (!parsed.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  if (help) {
    std::printf("%s", kUsage);
    return 0;
  }
  const ServeOptions& options = *parsed;

  std::set<JobKind> kinds;
  for (const JobMix& mix : options.mixes) {
    for (const JobMix::Entry& entry : mix.entries) kinds.insert(entry.kind);
  }
  // Only the traces the mixes need are read.
  ServeOptions shape_options = options;
  if (!kinds.count(JobKind::kRunTree) && !kinds.count(JobKind::kSession)) {
    shape_options.tot_traces.clear();
  }
  if (!kinds.count(JobKind::kSpec)) shape_options.spec_trees.clear();
  const absl::StatusOr<WorkloadShapes> shapes = load_workload_shapes(shape_options);
  if (!shapes.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(shapes.status().message()).c_str());
    return 1;
  }
  std::vector<LoadLevel> levels;
  for (const int32_t clients : options.concurrency) levels.push_back({.concurrency = clients});
  for (const double rate : options.rates) levels.push_back({.rate = rate});

  RunState state;
  const std::vector<std::string> admissions =
      options.admissions.empty() ? std::vector<std::string>{""} : options.admissions;
  for (const std::string& plan : options.plans) {
    for (const std::string& admission : admissions) {
      if (!run_plan(options, plan, admission, *shapes, kinds, levels, argc, argv, state)) return 1;
    }
  }
  print_table(state.summaries);
  std::printf("wrote %s\n", state.result->write(options.out_dir).c_str());
  if (options.strict && (state.any_failed || state.kind_missing)) {
    std::fprintf(
        stderr, "serve_bench: --strict: %s\n",
        state.any_failed ? "some jobs failed (see above)" : "a kind of a mix finished no job");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace deft::bench::serve

int main(int argc, char** argv) { return deft::bench::serve::run(argc, argv); }
