// fewshot and stream: Generate, n samples of a random prompt (fewshot: --fewshot-n samples of a
// --fewshot-prompt-tokens prompt, the paper's few-shot workload, one prompt node and n branches;
// stream: one sample of a --stream-prompt-tokens prompt). EOS is ignored, so each branch must
// stream exactly the tokens asked for and end with FINISH_REASON_LENGTH.
#include <algorithm>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "bench/serve_bench/job.h"

namespace deft::bench::serve {

void run_generate_job(v1::Deft::Stub& stub, const JobEnv& env, int32_t prompt_tokens, int32_t n,
                      int32_t tokens, std::mt19937_64& rng, JobRecord* record, int32_t stop_min) {
  const ServeOptions& options = *env.options;
  v1::GenerateRequest request;
  const std::vector<int32_t> prompt = random_prompt(env.model, prompt_tokens, rng);
  request.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(), prompt.end());
  request.set_n(n);
  v1::SamplingParams& sampling = *request.mutable_sampling();
  sampling.set_temperature(options.temperature);
  sampling.set_seed(rng());
  sampling.set_max_tokens(tokens);
  sampling.set_ignore_eos(true);
  record->expected_tokens = int64_t{n} * tokens;
  // A client-side stop: read `stop_after` tokens, then cancel (n = 1).
  int32_t stop_after = 0;
  if (stop_min > 0 && n == 1) {
    stop_after = std::uniform_int_distribution<int32_t>(std::min(stop_min, tokens), tokens)(rng);
    record->expected_tokens = stop_after;
  }

  grpc::ClientContext context;
  set_job_deadline(env, &context);
  TokenTimer timer(record, env.received_tokens);
  struct Branch {
    int32_t tokens = 0;
    v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  };
  std::map<int32_t, Branch> branches;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    timer.add(response.branch(), response.delta().ids_size());
    Branch& branch = branches[response.branch()];
    branch.tokens += response.delta().ids_size();
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      branch.finish = response.finish_reason();
    }
    if (stop_after > 0 && branch.tokens >= stop_after) break;
  }
  if (stop_after > 0 && branches[0].tokens >= stop_after) {
    context.TryCancel();  // the client's own stop: the server frees the job's KV
    (void)reader->Finish();
    record->expected_tokens = branches[0].tokens;  // a message may carry several tokens
    return;
  }
  if (const grpc::Status status = reader->Finish(); !status.ok()) {
    record->fail(status);
    return;
  }
  if (static_cast<int32_t>(branches.size()) != n) {
    record->fail(kTokenCount,
                 absl::StrCat("Generate streamed ", branches.size(), " branches, asked for ", n));
  }
  for (const auto& [index, branch] : branches) {
    if (branch.tokens != tokens || branch.finish != v1::FINISH_REASON_LENGTH) {
      record->fail(
          kTokenCount,
          absl::StrCat("Generate branch ", index, " streamed ", branch.tokens, " tokens (finish ",
                       v1::FinishReason_Name(branch.finish), "), asked for ", tokens));
    }
  }
}

}  // namespace deft::bench::serve
