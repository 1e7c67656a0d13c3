// spec: a speculative-decoding client on a TreeSession: create the prompt, then per step one
// `verify` of a recorded Medusa token tree (SpecShape) under the session's leaf, the tree's
// entry 0 being the previous step's bonus token (a random id at the first step) and the other
// entries random ids; the verified node becomes the next step's leaf. What the load needs is
// the shape: tree_size query rows per verify over a growing prefix. Random drafts alone would
// commit about one token per step, so by default (--spec-accept recorded) each step commits the
// record's Accept_length: the first a entries of the top-ranked path carry draft probability
// FLT_MIN, so the server's rejection sampling (temperature 1) accepts them whatever the model
// (min(1, p / q) = 1 for any p > 0), and the other entries carry 1 (accepted with the target's
// small probability of a random id). --spec-accept model: greedy acceptance, no draft probs.
// Steps run until the record (or --spec-steps) ends or the context would pass
// --spec-max-context.
#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/serve_bench/job.h"
#include "bench/serve_bench/session_client.h"

namespace deft::bench::serve {

void run_spec_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index, std::mt19937_64& rng,
                  JobRecord* record) {
  const ServeOptions& options = *env.options;
  const SpecShape& shape = env.shapes->spec[job_index % env.shapes->spec.size()];
  const bool recorded = options.spec_accept == ServeOptions::SpecAccept::kRecorded;
  const int32_t steps = options.spec_steps > 0 ? options.spec_steps
                                               : static_cast<int32_t>(shape.accept_lengths.size());
  const int64_t max_context = env.model.max_context > 0
                                  ? std::min(options.spec_max_context, env.model.max_context)
                                  : options.spec_max_context;
  TokenTimer timer(record, env.received_tokens);
  SessionClient session(stub, env, record);

  v1::SessionRequest create;
  const std::vector<int32_t> prompt = random_prompt(env.model, options.spec_prompt_tokens, rng);
  create.mutable_create()->mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(),
                                                                                  prompt.end());
  const std::optional<v1::SessionResponse> created = session.await(session.send(create));
  if (!created) return;
  int64_t node = created->created_node();
  int64_t context = options.spec_prompt_tokens;
  int32_t bonus = random_token(env.model, rng);

  for (int32_t step = 0; step < steps && context + shape.depth <= max_context; ++step) {
    // The least this step must commit: a top-path entries (recorded), or the bonus (model).
    const int32_t forced =
        recorded ? std::clamp<int32_t>(shape.accept_lengths[step % shape.accept_lengths.size()], 1,
                                       static_cast<int32_t>(shape.top_path.size()))
                 : (step > 0 ? 1 : 0);
    record->expected_tokens += forced;
    v1::SessionRequest request;
    v1::VerifyCommand& verify = *request.mutable_verify();
    verify.set_node(node);
    verify.add_tokens(bonus);
    for (size_t entry = 1; entry < shape.parents.size(); ++entry) {
      verify.add_tokens(random_token(env.model, rng));
    }
    verify.mutable_parents()->Add(shape.parents.begin(), shape.parents.end());
    if (recorded) {
      verify.mutable_draft_probs()->Resize(static_cast<int>(shape.parents.size()), 1.0f);
      for (int32_t i = 0; i < forced; ++i) {
        verify.set_draft_probs(shape.top_path[i], std::numeric_limits<float>::min());
      }
      verify.mutable_sampling()->set_temperature(1.0f);
      verify.mutable_sampling()->set_seed(rng());
    }
    const std::optional<v1::SessionResponse> answer = session.await(session.send(request));
    if (!answer) return;
    const v1::VerifyResponse& verified = answer->verified();
    const std::vector<int32_t> entries(verified.accepted_entries().begin(),
                                       verified.accepted_entries().end());
    const bool forced_accepted =
        static_cast<int32_t>(entries.size()) >= forced &&
        (recorded
             ? std::equal(shape.top_path.begin(), shape.top_path.begin() + forced, entries.begin())
             : forced == 0 || entries.front() == 0);
    if (!forced_accepted || verified.accepted_size() != static_cast<int>(entries.size())) {
      record->fail(kTokenCount,
                   absl::StrCat("verify step ", step, " accepted entries [",
                                absl::StrJoin(entries, ","), "], expected at least the first ",
                                forced, " of the top path (", shape.name, ")"));
      return;
    }
    timer.add(0, verified.accepted_size());
    node = verified.node();
    bonus = verified.bonus_token();
    context += verified.accepted_size();
  }
  session.close();
  if (record->ok() && record->tokens < record->expected_tokens) {
    record->fail(kTokenCount, absl::StrCat("speculative session committed ", record->tokens,
                                           " tokens, expected at least ", record->expected_tokens,
                                           " (", shape.name, ")"));
  }
}

}  // namespace deft::bench::serve
