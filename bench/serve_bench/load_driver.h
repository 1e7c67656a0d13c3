// One load level against one server: closed-loop clients (each sends its next job when its last
// one ends) or open-loop Poisson arrivals, drawing jobs from a mix until --duration passes or
// --jobs have been sent. Returns every job's record, the measurement window and the server's
// metrics over it.
//
// The window runs from the level's start to the end of --duration, or to the last job's end if
// that comes first (always, with --jobs). Tokens/s and the server's rates are taken over the
// window only; jobs still running at its end finish (their records count, so every job is
// checked), but the drain, where fewer clients are left, does not dilute the rates.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/serve_bench/job.h"
#include "bench/serve_bench/metrics_scraper.h"

namespace deft::bench::serve {

struct LoadLevel {
  int32_t concurrency = 0;   // closed loop: clients
  double rate = 0;           // open loop (concurrency 0): arrivals per second
  std::string name() const;  // "c8", "r2.5"
};

struct LevelRun {
  std::vector<JobRecord> jobs;  // in the order they ended
  Clock::time_point window_start, window_end;
  int64_t window_tokens = 0;              // tokens received within the window
  double drain_s = 0;                     // from the window's end to the last job's end
  MetricValues server_start, server_end;  // at the window's edges; empty without metrics
  MetricValues server_max;                // maxima of the samples taken through the level
  // Open loop: how late jobs started after their arrival, waiting for a free client
  // (--max-inflight); counted in their latency.
  double max_start_delay_s = 0;
  double window_s() const {
    return std::chrono::duration<double>(window_end - window_start).count();
  }
};

class LoadDriver {
 public:
  // Opens `channels` connections to `address` (clients share them round-robin: one HTTP/2
  // connection for every client would serialise them in one transport).
  LoadDriver(const std::string& address, const JobEnv& env, MetricsScraper* metrics,
             int32_t channels = 8);

  // Runs one level; job i gets the index first_job_index + i (its kind, prompt and trace
  // record). `label` prefixes the progress lines on stderr.
  LevelRun run(const LoadLevel& level, const JobMix& mix, uint64_t first_job_index,
               const std::string& label);
  // `count` jobs of `kind`, one at a time (warm-up and a check that the server takes them).
  std::vector<JobRecord> run_sequentially(JobKind kind, int32_t count, uint64_t first_job_index);

 private:
  v1::Deft::Stub& stub(size_t client) { return *stubs_[client % stubs_.size()]; }

  const JobEnv& env_;
  MetricsScraper* metrics_;
  std::vector<std::unique_ptr<v1::Deft::Stub>> stubs_;
};

}  // namespace deft::bench::serve
