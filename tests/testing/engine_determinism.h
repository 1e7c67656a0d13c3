// Test support (header only): deterministic mode through the engine. Copies of one Generate job
// run on a Scheduler alongside each other and random jobs (a small step budget: chunked prefill;
// the prefix cache on) against the same job alone on a fresh Scheduler: tokens and logprobs per
// branch, bit for bit. Used by the CPU runner's test (tests/models/) and the CUDA runner's
// (tests/gpu/).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/model_runner.h"
#include "engine/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/generate_work.h"

namespace deft::test {

inline constexpr int32_t kPageTokens = 16;
inline constexpr int32_t kPages = 2048;

struct JobResult {
  std::vector<std::vector<engine::TokenId>> tokens;  // per branch
  std::vector<std::vector<float>> logprobs;
  bool operator==(const JobResult& other) const {
    if (tokens != other.tokens || logprobs.size() != other.logprobs.size()) return false;
    for (size_t b = 0; b < logprobs.size(); ++b) {
      if (logprobs[b].size() != other.logprobs[b].size() ||
          std::memcmp(logprobs[b].data(), other.logprobs[b].data(),
                      logprobs[b].size() * sizeof(float)) != 0) {
        return false;
      }
    }
    return true;
  }
};

class EngineDeterminism {
 public:
  EngineDeterminism(engine::ModelRunner& runner, const engine::Tokenizer& tokenizer,
                    bool deterministic, int32_t max_step_tokens)
      : runner_(runner), tokenizer_(tokenizer) {
    engine::SchedulerOptions options{
        .page_tokens = kPageTokens, .kv_pages = kPages, .max_step_tokens = max_step_tokens};
    options.planner.deterministic = deterministic;
    options.planner.min_prefill_run = 64;
    scheduler_ = std::make_unique<engine::Scheduler>(options, runner_, tokenizer_);
  }

  std::shared_ptr<engine::GenerateEvents> submit(const engine::GenerateJob& job) {
    auto events = std::make_shared<engine::GenerateEvents>();
    EXPECT_TRUE(
        scheduler_
            ->submit(std::make_unique<engine::GenerateWork>(job, events, tokenizer_, kPageTokens))
            .ok());
    return events;
  }

  // Steps until every job has finished, draining their events each step (a job whose reader
  // falls kBacklogLimit events behind pauses); returns each job's tokens and logprobs.
  std::vector<JobResult> run_until_done(
      const std::vector<std::shared_ptr<engine::GenerateEvents>>& events,
      const std::vector<int32_t>& branches) {
    std::vector<JobResult> results(events.size());
    for (size_t j = 0; j < events.size(); ++j) {
      results[j].tokens.resize(branches[j]);
      results[j].logprobs.resize(branches[j]);
    }
    std::vector<bool> ended(events.size(), false);
    std::vector<engine::GenerateEvent> batch;
    for (int i = 0; i < 20000; ++i) {
      bool done = true;
      for (size_t j = 0; j < events.size(); ++j) {
        batch.clear();
        if (!ended[j] && !events[j]->next(batch, std::chrono::milliseconds(0))) ended[j] = true;
        for (const engine::GenerateEvent& event : batch) {
          JobResult& r = results[j];
          r.tokens[event.branch].insert(r.tokens[event.branch].end(), event.delta.ids.begin(),
                                        event.delta.ids.end());
          r.logprobs[event.branch].insert(r.logprobs[event.branch].end(),
                                          event.delta.logprobs.begin(), event.delta.logprobs.end());
        }
        done = done && ended[j];
      }
      if (done) return results;
      scheduler_->prepare();
      (void)scheduler_->step();
    }
    ADD_FAILURE() << "the scheduler did not finish";
    return results;
  }

  JobResult alone(const engine::GenerateJob& job) {
    return run_until_done({submit(job)}, {job.n}).front();
  }

 private:
  engine::ModelRunner& runner_;
  const engine::Tokenizer& tokenizer_;
  std::unique_ptr<engine::Scheduler> scheduler_;
};

// Where `got` first differs from `want`: "" when equal.
inline std::string first_difference(const JobResult& want, const JobResult& got) {
  for (size_t b = 0; b < want.tokens.size() && b < got.tokens.size(); ++b) {
    const size_t n = std::min(want.tokens[b].size(), got.tokens[b].size());
    for (size_t i = 0; i < n; ++i) {
      const bool token = want.tokens[b][i] != got.tokens[b][i];
      const bool logprob = i < want.logprobs[b].size() && i < got.logprobs[b].size() &&
                           std::memcmp(&want.logprobs[b][i], &got.logprobs[b][i], sizeof(float));
      if (token || logprob) {
        std::ostringstream out;
        out << "branch " << b << " token " << i << ": " << (token ? "token" : "logprob only")
            << " (alone " << want.tokens[b][i] << " " << want.logprobs[b][i] << ", mixed "
            << got.tokens[b][i] << " " << got.logprobs[b][i] << ")";
        return out.str();
      }
    }
    if (want.tokens[b].size() != got.tokens[b].size()) return "a branch length differs";
  }
  return want == got ? "" : "the branch count or logprob counts differ";
}

// Copies of `job` (16 greedy, 8 seeded) alone and among each other and random jobs; returns how
// many copies equal the job alone (the first difference of each other copy goes to
// `differences` when given).
inline int32_t copies_equal_alone(engine::ModelRunner& runner, const engine::Tokenizer& tokenizer,
                                  bool deterministic, const engine::GenerateJob& job,
                                  int32_t copies, std::mt19937_64& rng,
                                  std::vector<std::string>* differences = nullptr) {
  JobResult reference;
  {
    // Alone on a fresh scheduler (an empty prefix cache).
    EngineDeterminism engine(runner, tokenizer, deterministic, /*max_step_tokens=*/512);
    reference = engine.alone(job);
  }
  // Mixed on another (a small step budget: chunked prefill), the copies submitted together with
  // 12 random jobs (greedy and sampled, 1-4 branches).
  EngineDeterminism engine(runner, tokenizer, deterministic, /*max_step_tokens=*/96);
  std::vector<std::shared_ptr<engine::GenerateEvents>> all;
  std::vector<int32_t> branches;
  for (int32_t i = 0; i < copies + 12; ++i) {
    const bool is_copy = i < copies;
    if (is_copy) {
      all.push_back(engine.submit(job));
      branches.push_back(job.n);
    } else {
      engine::GenerateJob other;
      other.prompt.resize(std::uniform_int_distribution<size_t>(1, 200)(rng));
      for (engine::TokenId& t : other.prompt) {
        t = static_cast<engine::TokenId>(std::uniform_int_distribution<int>(3, 500)(rng));
      }
      other.n = std::uniform_int_distribution<int32_t>(1, 4)(rng);
      other.max_tokens = std::uniform_int_distribution<int32_t>(4, 64)(rng);
      other.sampling = {.temperature = 0.8f, .seed = rng()};
      other.limits.ignore_eos = true;
      all.push_back(engine.submit(other));
      branches.push_back(other.n);
    }
  }
  const std::vector<JobResult> results = engine.run_until_done(all, branches);
  int32_t equal = 0;
  for (int32_t i = 0; i < copies; ++i) {
    const std::string difference = first_difference(reference, results[i]);
    equal += difference.empty() ? 1 : 0;
    if (differences != nullptr && !difference.empty()) differences->push_back(difference);
  }
  return equal;
}

// The jobs the determinism tests copy: on one random 150-token prompt, a greedy job (n 1) and a
// seeded-sampling one (n 2, temperature 0.9, top-k 40, top-p 0.95), `max_tokens` each, EOS
// ignored.
struct DeterminismJobs {
  engine::GenerateJob greedy;
  engine::GenerateJob sampled;
};
inline DeterminismJobs determinism_jobs(std::mt19937_64& rng, int32_t max_tokens) {
  DeterminismJobs jobs;
  jobs.greedy.prompt.resize(150);
  for (engine::TokenId& t : jobs.greedy.prompt) {
    t = static_cast<engine::TokenId>(std::uniform_int_distribution<int>(3, 500)(rng));
  }
  jobs.greedy.max_tokens = max_tokens;
  jobs.greedy.sampling = {.temperature = 0.0f};
  jobs.greedy.limits.ignore_eos = true;
  jobs.sampled = jobs.greedy;
  jobs.sampled.n = 2;
  jobs.sampled.sampling = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = rng()};
  return jobs;
}

// copies_equal_alone() of both jobs: how many copies of each equal it alone, and the first
// difference seen ("" when none), for the test's message.
struct CopiesEqual {
  int32_t greedy = 0;
  int32_t sampled = 0;
  std::string first_difference;
};
inline CopiesEqual copies_of_both_equal_alone(engine::ModelRunner& runner,
                                              const engine::Tokenizer& tokenizer,
                                              bool deterministic, const DeterminismJobs& jobs,
                                              int32_t greedy_copies, int32_t sampled_copies,
                                              std::mt19937_64& rng) {
  std::vector<std::string> differences;
  CopiesEqual out;
  out.greedy = copies_equal_alone(runner, tokenizer, deterministic, jobs.greedy, greedy_copies, rng,
                                  &differences);
  out.sampled = copies_equal_alone(runner, tokenizer, deterministic, jobs.sampled, sampled_copies,
                                   rng, &differences);
  if (!differences.empty()) out.first_difference = differences.front();
  return out;
}

}  // namespace deft::test
