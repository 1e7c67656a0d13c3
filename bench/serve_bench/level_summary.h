// A load level's figures: client-side percentiles of the jobs that finished, failures by code,
// and the server's rates over the level's window from its /metrics counters. Becomes one row of
// the result file (BENCH_RESULTS.md: medians in the row, the rest in `extra`) and one line of
// the stdout table.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "bench/serve_bench/load_driver.h"

namespace deft::bench::serve {

// Percentiles of a sample set, in seconds; count 0: no samples.
struct Spread {
  int64_t count = 0;
  double p10 = 0, p50 = 0, p90 = 0, p99 = 0;
};
Spread spread(std::vector<double> samples_s);

// Client-side figures of a set of jobs (a level's, or one kind's within it).
struct JobFigures {
  int64_t done = 0;  // finished as expected
  int64_t failed = 0;
  std::map<std::string, int64_t> failures;  // failure code -> jobs
  std::string first_failure;                // "CODE: message" of one failed job
  int64_t tokens = 0;                       // generated tokens of every job, failed ones too
  Spread ttft, itl, latency;                // over the jobs that finished as expected

  // Some job's answer was wrong (TOKEN_COUNT, PROTOCOL), not merely refused or late: the
  // level's row is not written (BENCH_RESULTS.md).
  bool wrong_output() const;
};
JobFigures job_figures(const std::vector<const JobRecord*>& jobs);

struct LevelSummary {
  std::string mix, plan, level;
  LoadLevel load;
  double window_s = 0, drain_s = 0;
  double tokens_per_s = 0;  // generated tokens received within the window / window
  JobFigures all;
  std::map<std::string, JobFigures> by_kind;
  double mean_in_flight = 0;  // jobs in flight over the window (time average)
  double max_start_delay_s = 0;

  // From the server's /metrics (nullopt: no endpoint). Rows per step: every step's query rows
  // (prefill, extend, verify and decode rows: deft_step_rows_total).
  struct Server {
    double kv_pages_used_max = 0, kv_pages_total = 0;
    double queue_depth_max = 0, live_jobs_max = 0;
    double steps_per_s = 0, mean_rows_per_step = 0, mean_generated_per_step = 0;
    double mean_step_ms = 0, busy_share = 0;  // step time / window
    double generated_tokens_per_s = 0, prompt_tokens_per_s = 0;
    double kv_tokens_read_per_step = 0;
    // Where a step's time goes (per step, from the deft_step_*_seconds_total counters): host
    // attention planning, the model's forward pass (device sampling included), and the rest of
    // the step on the engine thread (host sampling, works' bookkeeping, streaming events).
    double logit_rows_per_step = 0;
    double plan_ms = 0, forward_ms = 0, other_ms = 0;
    int64_t steps = 0;
  };
  std::optional<Server> server;
};

LevelSummary summarize_level(const LevelRun& run, const std::string& mix, const std::string& plan,
                             const LoadLevel& load);

// The result file's row: case "<mix>_<level>", method the plan, times the finished jobs'
// latency (median, p10, p90), repetitions the jobs that finished as expected.
ResultRow result_row(const LevelSummary& summary);

// The table on stdout, one line per summary.
void print_table(const std::vector<LevelSummary>& summaries);

}  // namespace deft::bench::serve
