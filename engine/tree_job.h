// A server-side tree job run to completion on any ModelRunner: the prompt is prefilled as the
// root node, which branches k ways; every node then generates `branch_every` tokens and
// branches k ways again, down to `max_depth` levels of branching; the nodes of the last level
// run until EOS or `max_new_tokens` tokens on their path. Every step decodes all live leaves
// together (one AttentionPlan per step), which is exactly the few-shot / tree-of-thought shape
// of DESIGN.md §1.
//
// Greedy decoding (temperature 0, the default) would give k identical children, so a branch
// point with temperature 0 gives its children the k most likely tokens (ties to the lower id);
// inside a node, tokens are the argmax. With temperature > 0 every child samples with its own
// seed (branch_seed(parent seed, child index)), so a job replays identically.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

struct TreeJobOptions {
  std::vector<TokenId> prompt;   // at least one token
  int32_t branch_factor = 4;     // children per branch point (k >= 1)
  int32_t branch_every = 8;      // tokens a node generates before it branches (>= 1)
  int32_t max_depth = 3;         // levels of branching below the prompt; 0: one plain branch
  int32_t max_new_tokens = 32;   // per root-to-leaf path, prompt excluded (>= 1)
  SamplingParams sampling = {.temperature = 0.0f};  // seed: the root's; top_logprobs ignored
  std::vector<TokenId> eos_ids;  // a sampled one ends its branch (kept as the node's last token)
  PlannerOptions planner;
  uint32_t tree_id = 0;          // key of the job's pages in the KV manager
};

enum class BranchEnd : uint8_t {
  kNone,       // inner node (it branched) or the prompt
  kEos,        // sampled an EOS token
  kMaxTokens,  // its path reached max_new_tokens
};

struct TreeJobNode {
  NodeId id = -1;
  NodeId parent = -1;  // -1 for the prompt
  int32_t level = 0;   // 0: the prompt; k: k-th generation of branches
  std::vector<TokenId> tokens;  // the prompt, or the tokens this node generated
  double logprob = 0.0;         // sum of the raw log-probabilities of the generated tokens
  std::vector<NodeId> children;
  BranchEnd end = BranchEnd::kNone;
};

struct TreeJobStats {
  int64_t steps = 0;             // forward passes, the prefill included
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // over all nodes
  int64_t forwarded_tokens = 0;  // query rows over all steps
  int64_t kv_tokens_read = 0;    // the plans' KV IO (per layer and KV head)
  int32_t leaves = 0;
  int32_t peak_kv_pages = 0;
  double seconds = 0.0;          // wall time of the job
  double forward_seconds = 0.0;  // of which in ModelRunner::forward
};

struct TreeJobResult {
  std::vector<TreeJobNode> nodes;  // indexed by NodeId; nodes[0] is the prompt
  TreeJobStats stats;
};

// An upper bound on the KV pages a job holds at its peak (every node of the full tree at its
// longest); a pool this large never runs out for the job.
int64_t tree_job_max_pages(const TreeJobOptions& options, int32_t page_tokens);

// INVALID_ARGUMENT naming the bad field (also for prompt tokens outside the vocabulary).
absl::Status validate_tree_job(const TreeJobOptions& options, int32_t vocab_size);

// Runs the job. Before each step it checks that the KV pool can hold the step's new tokens and
// fails with RESOURCE_EXHAUSTED (naming the step, the leaves and the pages) instead of
// over-committing; the job's pages are freed on return either way. `on_step` (optional) is
// called after every step with the step index and the nodes so far.
absl::StatusOr<TreeJobResult> run_tree_job(
    ModelRunner& runner, KvCacheManager& kv, const TreeJobOptions& options,
    const std::function<void(int64_t step, const std::vector<TreeJobNode>&)>& on_step = {});

}  // namespace deft::engine
