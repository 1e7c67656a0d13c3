#include "bench/serve_bench/job.h"

#include <algorithm>

#include "absl/status/status.h"

namespace deft::bench::serve {

void JobRecord::fail(const grpc::Status& status) {
  // gRPC and absl number their codes alike (google.rpc.Code).
  fail(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
       status.error_message());
}

void TokenTimer::add(int64_t stream, int count) {
  if (count <= 0) return;
  const Clock::time_point now = Clock::now();
  received_tokens_->fetch_add(count, std::memory_order_relaxed);
  record_->tokens += count;
  if (record_->ttft_s < 0) {
    record_->ttft_s = std::chrono::duration<double>(now - record_->start).count();
  }
  const auto [last, first] = last_.try_emplace(stream, now);
  if (first) return;
  const double gap_s = std::chrono::duration<double>(now - last->second).count();
  record_->itl_s.insert(record_->itl_s.end(), count, gap_s / count);
  last->second = now;
}

JobRecord run_job(JobKind kind, v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                  Clock::time_point start) {
  JobRecord record;
  record.kind = kind;
  record.start = start;
  std::mt19937_64 rng(env.options->seed * 0x9e3779b97f4a7c15ULL + job_index);
  switch (kind) {
    case JobKind::kFewShot:
      run_generate_job(stub, env, env.options->fewshot_prompt_tokens, env.options->fewshot_n,
                       env.options->fewshot_tokens, rng, &record);
      break;
    case JobKind::kStream:
      run_generate_job(stub, env, env.options->stream_prompt_tokens, 1, env.options->stream_tokens,
                       rng, &record, env.options->stream_stop_min);
      break;
    case JobKind::kRepeat: {
      // The prompt's ids from the run's seed alone: the same prompt for every job (and plan).
      std::mt19937_64 prompt_rng(env.options->seed * 0x9e3779b97f4a7c15ULL - 1);
      run_generate_job(stub, env, env.options->fewshot_prompt_tokens, env.options->fewshot_n,
                       env.options->fewshot_tokens, prompt_rng, &record);
      break;
    }
    case JobKind::kRunTree:
      run_runtree_job(stub, env, job_index, rng, &record);
      break;
    case JobKind::kSession:
      run_session_job(stub, env, job_index, rng, &record);
      break;
    case JobKind::kSpec:
      run_spec_job(stub, env, job_index, rng, &record);
      break;
  }
  record.end = Clock::now();
  return record;
}

int32_t random_token(const ModelFacts& model, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> id(0, model.vocab_size - 1);
  for (;;) {
    const int32_t token = id(rng);
    const bool special = token == model.bos_token_id ||
                         std::find(model.eos_token_ids.begin(), model.eos_token_ids.end(), token) !=
                             model.eos_token_ids.end();
    if (!special || model.vocab_size <= 1 + static_cast<int32_t>(model.eos_token_ids.size())) {
      return token;
    }
  }
}

std::vector<int32_t> random_prompt(const ModelFacts& model, int32_t tokens, std::mt19937_64& rng) {
  std::vector<int32_t> prompt;
  prompt.reserve(tokens);
  if (model.bos_token_id >= 0 && tokens > 0) prompt.push_back(model.bos_token_id);
  while (static_cast<int32_t>(prompt.size()) < tokens) prompt.push_back(random_token(model, rng));
  return prompt;
}

void set_job_deadline(const JobEnv& env, grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(env.options->job_timeout_s)));
}

}  // namespace deft::bench::serve
