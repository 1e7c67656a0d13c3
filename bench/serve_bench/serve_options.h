// serve_bench's command line: what to start or drive, the load levels, the job mix and each job
// kind's shape. `serve_bench --help` prints kUsage, which documents every flag.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/serve_bench/job_mix.h"

namespace deft::bench::serve {

extern const char kUsage[];

struct ServeOptions {
  // The server: started once per plan, or an already running one.
  std::string server_binary;             // default: the build's deft-server
  std::vector<std::string> server_args;  // passed through (split at whitespace)
  std::vector<std::string> plans = {"deft_flatten", "sequence"};
  std::string address;          // non-empty: drive this running server, start none
  std::string metrics_address;  // its /metrics (host:port); empty: no server metrics
  double server_start_timeout_s = 900;

  // Load levels: closed-loop clients, then open-loop Poisson arrivals.
  std::vector<int32_t> concurrency = {1, 2, 4, 8, 16, 32, 64};
  std::vector<double> rates;   // jobs/s
  double duration_s = 30;      // per level (ignored when jobs > 0)
  int64_t jobs = 0;            // per level; 0: run for duration_s
  int32_t max_inflight = 256;  // open loop: arrivals beyond it wait (and their latency grows)
  int32_t warmup_jobs = 1;     // per kind and plan, before the levels; not measured
  double job_timeout_s = 600;

  std::vector<JobMix> mixes;

  // Job shapes.
  int32_t fewshot_prompt_tokens = 4000;
  int32_t fewshot_n = 20;
  int32_t fewshot_tokens = 200;
  int32_t stream_prompt_tokens = 512;
  int32_t stream_tokens = 256;
  // stream: when > 0, each job stops reading after a length drawn uniformly from
  // [stream_stop_min, stream_tokens] and cancels the call, as a client whose own stop
  // condition hits (the server frees the KV at once, as for EOS): max_tokens stays a bound
  // that most jobs never reach, which is what KV admission policies differ on.
  int32_t stream_stop_min = 0;
  float temperature = 0.8f;   // Generate, RunTree and session decodes
  std::string workloads_dir;  // ../shared/workloads
  std::vector<std::string> tot_traces = {"keywordToT", "set128ToT"};
  double tot_scale = 1.0;  // scales the traces' prompt and thought lengths
  std::vector<int32_t> spec_trees = {64};
  int32_t spec_prompt_tokens = 1000;
  int32_t spec_steps = 0;           // 0: the record's steps
  int32_t spec_max_context = 6000;  // the paper's stop length
  enum class SpecAccept : uint8_t { kRecorded, kModel };
  SpecAccept spec_accept = SpecAccept::kRecorded;

  // KV admission policies (deft-server --kv-admission), each a server start per plan, in the
  // same run; empty: the server's default.
  std::vector<std::string> admissions;

  // Output.
  std::string benchmark = "server_load";  // the result file's benchmark name
  std::string out_dir;  // empty: the checkout's bench/results
  bool strict = false;  // exit 1 when a job failed or a kind of a mix finished no job
  double metrics_interval_s = 0.2;
  double progress_interval_s = 5;
  uint64_t seed = 1;
};

// The options, or INVALID_ARGUMENT naming the bad flag or value. `help` is set for --help.
absl::StatusOr<ServeOptions> parse_serve_options(int argc, char** argv, bool* help);

}  // namespace deft::bench::serve
