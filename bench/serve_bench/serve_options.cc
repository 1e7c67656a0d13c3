#include "bench/serve_bench/serve_options.h"

#include <functional>
#include <map>
#include <type_traits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#ifndef DEFT_SERVER_BINARY
#error "DEFT_SERVER_BINARY must name the build's deft-server"
#endif
#ifndef DEFT_WORKLOADS_DIR
#error "DEFT_WORKLOADS_DIR must name ../shared/workloads"
#endif

namespace deft::bench::serve {

const char kUsage[] = R"(usage: serve_bench [options]
A serving benchmark: a real gRPC client drives deft-server over loopback with a mix of jobs at
several load levels and reports, per (mix, plan, level), generated tokens/s, time to first token,
inter-token latency, job latency, failures, and from the server's /metrics the KV pages used,
engine steps/s, rows per step and step time. Writes
bench/results/server_load-<hardware>-<yyyymmdd>.json and prints a table.

The server
  --server-binary PATH      deft-server to start (default: this build's)
  --server-args "ARGS"      passed to it, split at whitespace (e.g. "--model DIR --kv-pages N")
  --plans P1,P2             start the server once per attention plan (--plan); default
                            deft_flatten,sequence
  --admissions A1,A2        and once per KV admission policy (--kv-admission: step,
                            worst_case); a row's method is then PLAN+admission=A
  --address HOST:PORT       drive this running server instead (starts none; the plan is
                            whatever it runs)
  --metrics-address H:P     its Prometheus endpoint (with --address; without it, no server
                            metrics)
  --server-start-timeout S  wait this long for SERVING (model load; default 900)

Load levels (each runs --duration seconds, or --jobs jobs)
  --concurrency 1,2,4       closed loop: that many clients, each sending its next job when the
                            last one ends (default 1,2,4,8,16,32,64 unless --rate is given)
  --rate R1,R2              open loop: Poisson arrivals at R jobs/s; latency counts from the
                            arrival, so waiting for an in-flight slot counts too
  --duration S              seconds per level (default 30); jobs still running at the end
                            finish, but tokens/s and the server rates cover [0, S] only
  --jobs N                  instead of --duration: N jobs per level
  --max-inflight N          open loop: most jobs in flight (default 256)
  --warmup-jobs N           per kind and plan before the levels, one at a time, not measured;
                            they also check that the server's limits fit the jobs (default 1)
  --job-timeout S           deadline of one job (default 600)

The mix
  --mix "MIXES"             mixes separated by ';', each KIND[:WEIGHT],... of fewshot, runtree,
                            session, spec, stream, repeat; every mix runs every level (default: one mix of the
                            first four, equal weights)
  --seed N                  prompts, kinds and trace records per job derive from it (default 1)

Job shapes
  fewshot   Generate: n samples of one prompt (random token ids), EOS ignored
  --fewshot-prompt-tokens N (default 4000)   --fewshot-n N (default 20)
  --fewshot-tokens N        tokens per sample (default 200)
  repeat    fewshot's shape, but every job sends the same prompt: time to first token with
            the server's prefix cache (compare with fewshot's at the same level)
  stream    Generate: one sample of a short prompt (random token ids), EOS ignored
  --stream-prompt-tokens N (default 512)   --stream-tokens N (default 256)
  --stream-stop-min N       stream jobs stop reading (cancel) after U[N, stream-tokens]
                            tokens, like a client's own stop condition (default 0: read all)
  --temperature T           of Generate, RunTree and session decodes (default 0.8)
  runtree   RunTree shaped like a reasoning trace record: branch_factor = its widest fan-out,
            every_tokens = its median thought, max_depth = its depth, keep_best 1
  session   TreeSession following a trace record level by level: branch the expanded nodes,
            decode each thought's length (all thoughts of a level together), prune the
            thoughts that end without children, close
  --workloads DIR           the paper's traces (default ../shared/workloads)
  --tot-traces A,B          reasoning/*.json files, without .json (default keywordToT,set128ToT);
                            jobs cycle through their complete records
  --tot-scale F             multiplies the traces' prompt and thought lengths (default 1)
  spec      TreeSession + verify: per step one verify of a recorded Medusa token tree under
            the session's leaf (entry 0 the last bonus token, the others random ids)
  --spec-trees 32,64        speculative_decoding/apps_tree_size<T>.json (default 64)
  --spec-prompt-tokens N    (default 1000)
  --spec-steps N            verify steps per job; 0: the record's (default 0)
  --spec-max-context N      stop before the context passes N tokens (default 6000)
  --spec-accept recorded|model
                            recorded (default): each step commits the record's Accept_length
                            (the top-ranked path's entries carry a tiny draft probability, so
                            rejection sampling accepts them); model: greedy acceptance, random
                            drafts, so about one token per step

Output
  One row per (mix, plan, level): case <mix>_<level> (c8: 8 clients; r2.5: 2.5 jobs/s), method
  the plan, times the finished jobs' latency (median, p10, p90), the rest in extra (per kind
  too). A level where a job answered wrongly writes no row. DEFT_COMMIT=SHA names the commit
  when the binary runs away from its checkout.
  --out DIR                 where the JSON goes (default: this checkout's bench/results)
  --benchmark NAME          the result's benchmark name and file name (default server_load)
  --strict                  exit 1 when a job failed or a kind of a mix finished no job (a job
                            fails when its RPC fails or a stream's token count is not the one
                            asked for)
  --metrics-interval S      /metrics sampling period (default 0.2)
  --progress-interval S     progress line period on stderr (default 5)
  --help                    this text
)";

namespace {

absl::Status bad(const std::string& flag, const std::string& value, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " '", value, "': ", why));
}

template <typename T>
absl::Status parse_number(const std::string& flag, const std::string& value, T minimum, T* out) {
  bool ok = false;
  if constexpr (std::is_floating_point_v<T>) {
    double parsed = 0;
    ok = absl::SimpleAtod(value, &parsed);
    *out = static_cast<T>(parsed);
  } else {
    ok = absl::SimpleAtoi(value, out);
  }
  if (!ok) return bad(flag, value, "not a number");
  if (*out < minimum) return bad(flag, value, absl::StrCat("must be >= ", minimum));
  return absl::OkStatus();
}

template <typename T>
absl::Status parse_list(const std::string& flag, const std::string& value, T minimum,
                        std::vector<T>* out) {
  out->clear();
  for (const std::string& part :
       std::vector<std::string>(absl::StrSplit(value, ',', absl::SkipWhitespace()))) {
    T number{};
    if (absl::Status status = parse_number(flag, part, minimum, &number); !status.ok()) {
      return status;
    }
    out->push_back(number);
  }
  if (out->empty()) return bad(flag, value, "an empty list");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ServeOptions> parse_serve_options(int argc, char** argv, bool* help) {
  ServeOptions options;
  options.server_binary = DEFT_SERVER_BINARY;
  options.workloads_dir = DEFT_WORKLOADS_DIR;
  *help = false;
  bool concurrency_given = false;
  std::string mixes = "fewshot,runtree,session,spec";

  using Setter = std::function<absl::Status(const std::string& flag, const std::string& value)>;
  const auto text = [](std::string* field) -> Setter {
    return [field](const std::string&, const std::string& value) {
      *field = value;
      return absl::OkStatus();
    };
  };
  const auto list = [](std::vector<std::string>* field) -> Setter {
    return [field](const std::string&, const std::string& value) {
      *field = absl::StrSplit(value, ',', absl::SkipWhitespace());
      return absl::OkStatus();
    };
  };
  const auto number = [](auto* field, auto minimum) -> Setter {
    return [field, minimum](const std::string& flag, const std::string& value) {
      return parse_number(flag, value, static_cast<std::remove_pointer_t<decltype(field)>>(minimum),
                          field);
    };
  };
  const std::map<std::string, Setter> setters = {
      {"--server-binary", text(&options.server_binary)},
      {"--server-args",
       [&](const std::string&, const std::string& value) {
         options.server_args = absl::StrSplit(value, absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
         return absl::OkStatus();
       }},
      {"--plans", list(&options.plans)},
      {"--address", text(&options.address)},
      {"--metrics-address", text(&options.metrics_address)},
      {"--server-start-timeout", number(&options.server_start_timeout_s, 1)},
      {"--concurrency",
       [&](const std::string& flag, const std::string& value) {
         concurrency_given = true;
         return parse_list(flag, value, int32_t{1}, &options.concurrency);
       }},
      {"--rate",
       [&](const std::string& flag, const std::string& value) {
         return parse_list(flag, value, 1e-6, &options.rates);
       }},
      {"--duration", number(&options.duration_s, 0.001)},
      {"--jobs", number(&options.jobs, 1)},
      {"--max-inflight", number(&options.max_inflight, 1)},
      {"--warmup-jobs", number(&options.warmup_jobs, 0)},
      {"--job-timeout", number(&options.job_timeout_s, 0.001)},
      {"--mix", text(&mixes)},
      {"--seed", number(&options.seed, 0)},
      {"--fewshot-prompt-tokens", number(&options.fewshot_prompt_tokens, 1)},
      {"--fewshot-n", number(&options.fewshot_n, 1)},
      {"--fewshot-tokens", number(&options.fewshot_tokens, 1)},
      {"--stream-prompt-tokens", number(&options.stream_prompt_tokens, 1)},
      {"--stream-tokens", number(&options.stream_tokens, 1)},
      {"--stream-stop-min", number(&options.stream_stop_min, 0)},
      {"--admissions", list(&options.admissions)},
      {"--benchmark", text(&options.benchmark)},
      {"--temperature", number(&options.temperature, 0)},
      {"--workloads", text(&options.workloads_dir)},
      {"--tot-traces", list(&options.tot_traces)},
      {"--tot-scale", number(&options.tot_scale, 1e-6)},
      {"--spec-trees",
       [&](const std::string& flag, const std::string& value) {
         return parse_list(flag, value, int32_t{2}, &options.spec_trees);
       }},
      {"--spec-prompt-tokens", number(&options.spec_prompt_tokens, 1)},
      {"--spec-steps", number(&options.spec_steps, 0)},
      {"--spec-max-context", number(&options.spec_max_context, 2)},
      {"--spec-accept",
       [&](const std::string& flag, const std::string& value) {
         if (value == "recorded") {
           options.spec_accept = ServeOptions::SpecAccept::kRecorded;
         } else if (value == "model") {
           options.spec_accept = ServeOptions::SpecAccept::kModel;
         } else {
           return bad(flag, value, "recorded or model");
         }
         return absl::OkStatus();
       }},
      {"--out", text(&options.out_dir)},
      {"--metrics-interval", number(&options.metrics_interval_s, 0.001)},
      {"--progress-interval", number(&options.progress_interval_s, 0.001)},
  };

  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      *help = true;
      return options;
    }
    if (flag == "--strict") {
      options.strict = true;
      continue;
    }
    std::string value;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else if (setters.count(flag) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    }
    const auto setter = setters.find(flag);
    if (setter == setters.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option '", flag, "' (see --help)"));
    }
    if (absl::Status status = setter->second(flag, value); !status.ok()) return status;
  }

  if (!options.rates.empty() && !concurrency_given) options.concurrency.clear();
  for (const std::string& text_mix :
       std::vector<std::string>(absl::StrSplit(mixes, ';', absl::SkipWhitespace()))) {
    absl::StatusOr<JobMix> mix = parse_job_mix(text_mix);
    if (!mix.ok()) return mix.status();
    options.mixes.push_back(*std::move(mix));
  }
  if (options.mixes.empty()) return absl::InvalidArgumentError("--mix: no mix given");
  if (options.plans.empty()) return absl::InvalidArgumentError("--plans: no plan given");
  if (options.tot_traces.empty()) return absl::InvalidArgumentError("--tot-traces: no trace");
  if (!options.address.empty()) options.plans = {""};  // the running server's plan
  return options;
}

}  // namespace deft::bench::serve
