#include "bench/serve_bench/level_summary.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace deft::bench::serve {
namespace {

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

double value(const MetricValues& values, const std::string& name) {
  const auto it = values.find(name);
  return it == values.end() ? 0.0 : it->second;
}

nlohmann::json spread_json(const Spread& s, double unit, const char* suffix) {
  nlohmann::json json = {{"count", s.count}};
  for (const auto& [name, v] :
       {std::pair{"p10", s.p10}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}}) {
    json[absl::StrCat(name, suffix)] = v * unit;
  }
  return json;
}

nlohmann::json figures_json(const JobFigures& f) {
  nlohmann::json json = {{"jobs_done", f.done},
                         {"jobs_failed", f.failed},
                         {"failures", f.failures},
                         {"generated_tokens", f.tokens},
                         {"ttft", spread_json(f.ttft, 1e3, "_ms")},
                         {"inter_token", spread_json(f.itl, 1e3, "_ms")},
                         {"job_latency", spread_json(f.latency, 1.0, "_s")}};
  if (!f.first_failure.empty()) json["first_failure"] = f.first_failure;
  return json;
}

}  // namespace

Spread spread(std::vector<double> samples_s) {
  Spread s;
  s.count = static_cast<int64_t>(samples_s.size());
  if (samples_s.empty()) return s;
  std::sort(samples_s.begin(), samples_s.end());
  // Nearest rank: the smallest sample with at least q of the samples at or below it.
  const auto at = [&](double q) {
    const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(samples_s.size())));
    return samples_s[std::clamp<size_t>(rank, 1, samples_s.size()) - 1];
  };
  s.p10 = at(0.10);
  s.p50 = at(0.50);
  s.p90 = at(0.90);
  s.p99 = at(0.99);
  return s;
}

bool JobFigures::wrong_output() const {
  return failures.count(kTokenCount) > 0 || failures.count(kProtocol) > 0;
}

JobFigures job_figures(const std::vector<const JobRecord*>& jobs) {
  JobFigures f;
  std::vector<double> ttft, itl, latency;
  for (const JobRecord* job : jobs) {
    f.tokens += job->tokens;
    if (!job->ok()) {
      ++f.failed;
      ++f.failures[job->failure];
      if (f.first_failure.empty()) {
        f.first_failure = absl::StrCat(job->failure, ": ", job->failure_message);
      }
      continue;
    }
    ++f.done;
    if (job->ttft_s >= 0) ttft.push_back(job->ttft_s);
    itl.insert(itl.end(), job->itl_s.begin(), job->itl_s.end());
    latency.push_back(job->latency_s());
  }
  f.ttft = spread(std::move(ttft));
  f.itl = spread(std::move(itl));
  f.latency = spread(std::move(latency));
  return f;
}

LevelSummary summarize_level(const LevelRun& run, const std::string& mix, const std::string& plan,
                             const LoadLevel& load) {
  LevelSummary summary;
  summary.mix = mix;
  summary.plan = plan;
  summary.load = load;
  summary.level = load.name();
  summary.window_s = run.window_s();
  summary.drain_s = run.drain_s;
  summary.max_start_delay_s = run.max_start_delay_s;
  const double window_s = std::max(summary.window_s, 1e-9);
  summary.tokens_per_s = static_cast<double>(run.window_tokens) / window_s;

  std::vector<const JobRecord*> all;
  std::map<std::string, std::vector<const JobRecord*>> by_kind;
  double in_flight_s = 0;
  for (const JobRecord& job : run.jobs) {
    all.push_back(&job);
    by_kind[job_kind_name(job.kind)].push_back(&job);
    const Clock::time_point from = std::max(job.start, run.window_start);
    const Clock::time_point to = std::min(job.end, run.window_end);
    if (to > from) in_flight_s += seconds_between(from, to);
  }
  summary.all = job_figures(all);
  for (const auto& [kind, jobs] : by_kind) summary.by_kind[kind] = job_figures(jobs);
  summary.mean_in_flight = in_flight_s / window_s;

  if (!run.server_start.empty() && !run.server_end.empty()) {
    const auto delta = [&](const std::string& name) {
      return value(run.server_end, name) - value(run.server_start, name);
    };
    LevelSummary::Server server;
    const double steps = delta("deft_engine_steps_total");
    const double generated = delta("deft_generated_tokens_total");
    const double prompt = delta("deft_prompt_tokens_total");
    const double step_s = delta("deft_step_latency_seconds_sum");
    const double step_count = delta("deft_step_latency_seconds_count");
    server.steps = static_cast<int64_t>(steps);
    server.steps_per_s = steps / window_s;
    server.generated_tokens_per_s = generated / window_s;
    server.prompt_tokens_per_s = prompt / window_s;
    server.busy_share = step_s / window_s;
    if (steps > 0) {
      // deft_step_rows_total counts every query row; before it existed, prompt + generated.
      const double rows = delta("deft_step_rows_total");
      server.mean_rows_per_step = rows > 0 ? rows / steps : (prompt + generated) / steps;
      server.logit_rows_per_step = delta("deft_step_logit_rows_total") / steps;
      const double plan_s = delta("deft_step_plan_seconds_total");
      const double forward_s = delta("deft_step_forward_seconds_total");
      server.plan_ms = plan_s / steps * 1e3;
      server.forward_ms = forward_s / steps * 1e3;
      server.other_ms = (delta("deft_step_seconds_total") - plan_s - forward_s) / steps * 1e3;
      server.mean_generated_per_step = generated / steps;
      server.kv_tokens_read_per_step = delta("deft_attention_kv_tokens_read_total") / steps;
    }
    if (step_count > 0) server.mean_step_ms = step_s / step_count * 1e3;
    server.kv_pages_used_max = std::max(value(run.server_max, "deft_kv_pages_used"),
                                        value(run.server_end, "deft_kv_pages_used"));
    // The pool: pages in use, free and held by the prefix cache (deft_kv_pages_cached).
    server.kv_pages_total = value(run.server_start, "deft_kv_pages_used") +
                            value(run.server_start, "deft_kv_pages_free") +
                            value(run.server_start, "deft_kv_pages_cached");
    server.queue_depth_max = value(run.server_max, "deft_queue_depth");
    server.live_jobs_max = value(run.server_max, "deft_live_jobs");
    summary.server = server;
  }
  return summary;
}

ResultRow result_row(const LevelSummary& s) {
  ResultRow row;
  row.case_name = absl::StrCat(s.mix, "_", s.level);
  row.method = s.plan;
  row.median_us = s.all.latency.p50 * 1e6;
  row.p10_us = s.all.latency.p10 * 1e6;
  row.p90_us = s.all.latency.p90 * 1e6;
  row.repetitions = s.all.done;
  nlohmann::json& extra = row.extra;
  extra = figures_json(s.all);
  extra["mix"] = s.mix;
  if (s.load.concurrency > 0) {
    extra["concurrency"] = s.load.concurrency;
  } else {
    extra["arrival_rate_per_s"] = s.load.rate;
    extra["max_start_delay_s"] = s.max_start_delay_s;
  }
  extra["mean_in_flight"] = s.mean_in_flight;
  extra["window_s"] = s.window_s;
  extra["drain_s"] = s.drain_s;
  extra["generated_tokens_per_s"] = s.tokens_per_s;
  extra["by_kind"] = nlohmann::json::object();
  for (const auto& [kind, figures] : s.by_kind) extra["by_kind"][kind] = figures_json(figures);
  if (s.server) {
    const LevelSummary::Server& v = *s.server;
    extra["server"] = {{"kv_pages_used_max", v.kv_pages_used_max},
                       {"kv_pages_total", v.kv_pages_total},
                       {"queue_depth_max", v.queue_depth_max},
                       {"live_jobs_max", v.live_jobs_max},
                       {"steps", v.steps},
                       {"steps_per_s", v.steps_per_s},
                       {"mean_rows_per_step", v.mean_rows_per_step},
                       {"mean_generated_per_step", v.mean_generated_per_step},
                       {"mean_step_ms", v.mean_step_ms},
                       {"busy_share", v.busy_share},
                       {"generated_tokens_per_s", v.generated_tokens_per_s},
                       {"prompt_tokens_per_s", v.prompt_tokens_per_s},
                       {"kv_tokens_read_per_step", v.kv_tokens_read_per_step},
                       {"logit_rows_per_step", v.logit_rows_per_step},
                       {"plan_ms_per_step", v.plan_ms},
                       {"forward_ms_per_step", v.forward_ms},
                       {"other_ms_per_step", v.other_ms}};
  }
  return row;
}

void print_table(const std::vector<LevelSummary>& summaries) {
  std::printf("\n%-30s %-13s %-6s %9s %9s %17s %15s %15s %10s %8s %9s %8s %17s\n", "mix", "plan",
              "load", "ok/fail", "tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "job p50/p99 s",
              "KV pages", "steps/s", "rows/step", "step ms", "plan/fwd/other");
  for (const LevelSummary& s : summaries) {
    const std::string jobs = absl::StrCat(s.all.done, "/", s.all.failed);
    // "p50/p99" of a spread in `unit`s, "-" without samples.
    const auto pair = [](const Spread& spread, double unit, int decimals) {
      return spread.count == 0 ? std::string("-")
                               : absl::StrFormat("%.*f/%.*f", decimals, spread.p50 * unit, decimals,
                                                 spread.p99 * unit);
    };
    const std::string ttft = pair(s.all.ttft, 1e3, 1);
    const std::string itl = pair(s.all.itl, 1e3, 2);
    const std::string latency = pair(s.all.latency, 1.0, 2);
    std::string kv = "-", steps = "-", rows = "-", step_ms = "-", split = "-";
    if (s.server) {
      kv = absl::StrFormat("%.0f/%.0f", s.server->kv_pages_used_max, s.server->kv_pages_total);
      steps = absl::StrFormat("%.1f", s.server->steps_per_s);
      rows = absl::StrFormat("%.1f", s.server->mean_rows_per_step);
      step_ms = absl::StrFormat("%.2f", s.server->mean_step_ms);
      split = absl::StrFormat("%.2f/%.2f/%.2f", s.server->plan_ms, s.server->forward_ms,
                              s.server->other_ms);
    }
    std::printf("%-30s %-13s %-6s %9s %9.0f %17s %15s %15s %10s %8s %9s %8s %17s\n", s.mix.c_str(),
                s.plan.c_str(), s.level.c_str(), jobs.c_str(), s.tokens_per_s, ttft.c_str(),
                itl.c_str(), latency.c_str(), kv.c_str(), steps.c_str(), rows.c_str(),
                step_ms.c_str(), split.c_str());
    for (const auto& [code, count] : s.all.failures) {
      std::printf("%-30s   %lld failed with %s\n", "", static_cast<long long>(count), code.c_str());
    }
  }
  std::fflush(stdout);
}

}  // namespace deft::bench::serve
