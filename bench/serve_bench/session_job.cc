// session: a client-driven tree-of-thought search on a TreeSession, following one reasoning
// record (TotShape) level by level:
//   create the prompt; per level: branch each node the record expands (the branch commands
//   pipelined), decode all the level's thoughts together (thoughts are of different lengths:
//   one decode command per distinct length, each over the thoughts still going, so every
//   thought gets exactly its length), prune each childless thought as it ends (pipelined with
//   the next decode), except on the last level; then close.
// The record starts a thought's children as soon as the thought ends; this client, like a
// ToT-BFS search that scores a whole level before expanding it, waits for the level. EOS is
// ignored, so every decode must stream exactly max_tokens per node.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "bench/serve_bench/job.h"
#include "bench/serve_bench/session_client.h"

namespace deft::bench::serve {

void run_session_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                     std::mt19937_64& rng, JobRecord* record) {
  const TotShape& shape = env.shapes->tot[job_index % env.shapes->tot.size()];
  for (const auto& level : shape.levels) {
    for (const TotShape::Thought& thought : level) record->expected_tokens += thought.tokens;
  }
  TokenTimer timer(record, env.received_tokens);
  SessionClient session(stub, env, record);

  v1::SessionRequest create;
  const std::vector<int32_t> prompt = random_prompt(env.model, shape.prompt_tokens, rng);
  create.mutable_create()->mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(),
                                                                                  prompt.end());
  const std::optional<v1::SessionResponse> created = session.await(session.send(create));
  if (!created) return;
  std::vector<int64_t> previous_nodes = {created->created_node()};  // the previous level's

  for (size_t depth = 0; depth < shape.levels.size(); ++depth) {
    const std::vector<TotShape::Thought>& level = shape.levels[depth];
    const bool last_level = depth + 1 == shape.levels.size();
    // Branch: the thoughts of each parent, in level order, take its children in order.
    std::map<int32_t, std::vector<size_t>> thoughts_of;  // parent index -> thought indices
    for (size_t i = 0; i < level.size(); ++i) {
      thoughts_of[std::max(level[i].parent, 0)].push_back(i);
    }
    std::vector<std::pair<uint64_t, const std::vector<size_t>*>> branches;
    for (const auto& [parent, thoughts] : thoughts_of) {
      v1::SessionRequest branch;
      branch.mutable_branch()->set_node(previous_nodes[parent]);
      branch.mutable_branch()->set_k(static_cast<int32_t>(thoughts.size()));
      branches.emplace_back(session.send(branch), &thoughts);
    }
    std::vector<int64_t> nodes(level.size(), -1);
    for (const auto& [request_id, thoughts] : branches) {
      const std::optional<v1::SessionResponse> branched = session.await(request_id);
      if (!branched) return;
      if (branched->branched().children_size() != static_cast<int>(thoughts->size())) {
        record->fail(kProtocol,
                     absl::StrCat("branch answered ", branched->branched().children_size(),
                                  " children, asked for ", thoughts->size()));
        return;
      }
      for (size_t k = 0; k < thoughts->size(); ++k) {
        nodes[(*thoughts)[k]] = branched->branched().children(static_cast<int>(k));
      }
    }

    // Decode by lengths: the thoughts still going, up to the next shortest one's end.
    std::vector<size_t> going(level.size());
    for (size_t i = 0; i < going.size(); ++i) going[i] = i;
    std::sort(going.begin(), going.end(),
              [&](size_t a, size_t b) { return level[a].tokens > level[b].tokens; });
    int32_t decoded = 0;  // tokens every thought still going has so far
    while (!going.empty()) {
      const int32_t max_tokens = level[going.back()].tokens - decoded;
      v1::SessionRequest decode;
      for (const size_t i : going) decode.mutable_decode()->add_nodes(nodes[i]);
      v1::SamplingParams& sampling = *decode.mutable_decode()->mutable_sampling();
      sampling.set_temperature(env.options->temperature);
      sampling.set_seed(rng());
      sampling.set_max_tokens(max_tokens);
      sampling.set_ignore_eos(true);
      std::map<int64_t, std::pair<int32_t, v1::FinishReason>> streamed;  // node -> tokens, finish
      timer.restart_streams();
      const std::optional<v1::SessionResponse> done =
          session.await(session.send(decode), [&](const v1::NodeTokens& tokens) {
            timer.add(tokens.node(), tokens.delta().ids_size());
            auto& [count, finish] = streamed[tokens.node()];
            count += tokens.delta().ids_size();
            finish = tokens.finish_reason();
          });
      if (!done) return;
      for (const size_t i : going) {
        const auto& [count, finish] = streamed[nodes[i]];
        if (count != max_tokens || finish != v1::FINISH_REASON_LENGTH) {
          record->fail(kTokenCount,
                       absl::StrCat("session decode of node ", nodes[i], " streamed ", count,
                                    " tokens (finish ", v1::FinishReason_Name(finish),
                                    "), asked for ", max_tokens, " (", shape.name, ")"));
          return;
        }
      }
      decoded += max_tokens;
      while (!going.empty() && level[going.back()].tokens == decoded) {
        const size_t ended = going.back();
        going.pop_back();
        if (!level[ended].expanded && !last_level) {
          v1::SessionRequest prune;
          prune.mutable_prune()->set_node(nodes[ended]);
          session.send(prune);  // answered (and checked) while the next command is awaited
        }
      }
    }
    previous_nodes = std::move(nodes);
  }
  session.close();
  if (record->ok() && record->tokens != record->expected_tokens) {
    record->fail(kTokenCount,
                 absl::StrCat("session streamed ", record->tokens, " tokens, the record asks for ",
                              record->expected_tokens, " (", shape.name, ")"));
  }
}

}  // namespace deft::bench::serve
