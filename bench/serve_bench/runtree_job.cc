// runtree: a server-side tree-of-thought search (RunTree) shaped like a reasoning record
// (TotShape's policy): branch k ways every `every_tokens`, `depth` levels, keep the best one per
// level, EOS ignored. Every node then generates exactly every_tokens tokens, so the job must
// stream k * depth * every_tokens tokens and its best path must hold depth * every_tokens.
#include <map>

#include "absl/strings/str_cat.h"
#include "bench/serve_bench/job.h"

namespace deft::bench::serve {

void run_runtree_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                     std::mt19937_64& rng, JobRecord* record) {
  const TotShape& shape = env.shapes->tot[job_index % env.shapes->tot.size()];
  v1::RunTreeRequest request;
  const std::vector<int32_t> prompt = random_prompt(env.model, shape.prompt_tokens, rng);
  request.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(), prompt.end());
  v1::BranchPolicy& policy = *request.mutable_policy();
  policy.set_branch_factor(shape.branch_factor);
  policy.set_every_tokens(shape.every_tokens);
  policy.set_max_depth(shape.depth());
  policy.set_keep_best(1);
  policy.set_score(v1::BranchPolicy::SCORE_CUMULATIVE_LOGPROB);
  const int32_t path_tokens = shape.depth() * shape.every_tokens;
  v1::SamplingParams& sampling = *request.mutable_sampling();
  sampling.set_temperature(env.options->temperature);
  sampling.set_seed(rng());
  sampling.set_max_tokens(path_tokens);
  sampling.set_ignore_eos(true);
  record->expected_tokens = int64_t{shape.branch_factor} * path_tokens;

  grpc::ClientContext context;
  set_job_deadline(env, &context);
  TokenTimer timer(record, env.received_tokens);
  std::map<int64_t, int32_t> streamed;  // node -> tokens
  v1::TreeResult result;
  int finished_events = 0;
  std::unique_ptr<grpc::ClientReader<v1::TreeEvent>> reader = stub.RunTree(&context, request);
  v1::TreeEvent event;
  while (reader->Read(&event)) {
    if (event.has_tokens()) {
      timer.add(event.tokens().node(), event.tokens().delta().ids_size());
      streamed[event.tokens().node()] += event.tokens().delta().ids_size();
    } else if (event.has_finished()) {
      ++finished_events;
      result = event.finished();
    }
  }
  if (const grpc::Status status = reader->Finish(); !status.ok()) {
    record->fail(status);
    return;
  }
  if (finished_events != 1) {
    record->fail(kProtocol, absl::StrCat("RunTree ended with ", finished_events,
                                         " `finished` events (", shape.name, ")"));
    return;
  }
  std::map<int64_t, int32_t> final_tokens;
  for (const v1::TreeNodeInfo& node : result.nodes()) {
    if (node.node() != 0) final_tokens[node.node()] = node.tokens().ids_size();
  }
  for (const auto& [node, tokens] : final_tokens) {
    const auto it = streamed.find(node);
    if ((it == streamed.end() ? 0 : it->second) != tokens || tokens != shape.every_tokens) {
      record->fail(
          kTokenCount,
          absl::StrCat("RunTree node ", node, " streamed ", it == streamed.end() ? 0 : it->second,
                       " tokens and ended with ", tokens, "; every node must make ",
                       shape.every_tokens, " (", shape.name, ")"));
      return;
    }
  }
  int32_t best_path_tokens = 0;
  for (const int64_t node : result.best_path()) {
    if (node != 0) best_path_tokens += final_tokens[node];
  }
  if (best_path_tokens != path_tokens) {
    record->fail(kTokenCount,
                 absl::StrCat("RunTree best path holds ", best_path_tokens, " tokens, asked for ",
                              path_tokens, " (", shape.name, ")"));
  } else if (record->tokens != record->expected_tokens) {
    record->fail(kTokenCount, absl::StrCat("RunTree streamed ", record->tokens, " tokens in ",
                                           final_tokens.size(), " nodes, expected ",
                                           record->expected_tokens, " (", shape.name, ")"));
  }
}

}  // namespace deft::bench::serve
