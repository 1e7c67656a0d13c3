// The RunTree branch policy (proto BranchPolicy) behind one small interface: when a node's
// segment ends (every n tokens, at a delimiter, at a step-end token), how a root-to-node path is
// scored, and which of the nodes of one depth are expanded (ToT-BFS / beam-like keep_best).
// Pure logic: the caller (the tree job) owns the tree, decodes, branches and prunes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

// Most levels of branching below the prompt, and the longest kEveryTokens segment.
inline constexpr int32_t kMaxBranchDepth = 16;
inline constexpr int32_t kMaxEveryTokens = 4096;

struct BranchPolicyOptions {
  int32_t branch_factor = 2;  // k >= 1 children per expansion
  enum class Trigger : uint8_t { kEveryTokens, kDelimiter, kStepEndToken };
  Trigger trigger = Trigger::kEveryTokens;
  int32_t every_tokens = 16;    // kEveryTokens: >= 1
  std::string delimiter;        // kDelimiter: non-empty
  TokenId step_end_token = -1;  // kStepEndToken: in [0, vocab)
  int32_t max_depth = 2;        // levels of branching below the prompt, >= 0
  enum class Score : uint8_t { kCumulativeLogprob, kMeanLogprob };
  Score score = Score::kCumulativeLogprob;
  int32_t keep_best = 0;  // w nodes expanded per depth; 0: all
};

// INVALID_ARGUMENT naming the field (e.g. "policy.branch_factor must be in [1, 64], got 0"):
// branch_factor outside [1, max_branches], max_depth outside [0, kMaxBranchDepth],
// keep_best < 0, an unknown trigger or score, and for the chosen trigger only: every_tokens
// outside [1, kMaxEveryTokens], an empty delimiter, step_end_token outside [0, vocab_size).
absl::Status validate_branch_policy(const BranchPolicyOptions& p, int32_t vocab_size,
                                    int32_t max_branches);

struct NodeProgress {  // what the controller decides on, for one live node
  int32_t depth = 0;   // 1 = children of the prompt, 2 = their children, ...
  int32_t tokens = 0;  // tokens this node generated so far (>= 1 when asked)
  TokenId last_token = -1;
  std::string_view text;  // this node's decoded text so far
  // Sum of the raw logprobs of every generated token on the root-to-node path.
  double path_logprob = 0.0;
  int64_t path_tokens = 0;  // generated tokens on that path
};

class BranchController {
 public:
  virtual ~BranchController() = default;
  // After each generated token: true when the node's segment ends here (trigger fired).
  // The caller then makes it a branch point if depth < max_depth().
  //   kEveryTokens: tokens is a positive multiple of every_tokens (fires again every n tokens
  //                 on a node that is not branched, e.g. at max_depth);
  //   kDelimiter:   text ends with the delimiter;
  //   kStepEndToken: last_token == step_end_token.
  virtual bool ends_segment(const NodeProgress& node) const = 0;
  // Higher is better. kCumulativeLogprob: path_logprob; kMeanLogprob (length-normalised):
  // path_logprob / max(1, path_tokens).
  virtual double score(const NodeProgress& node) const = 0;
  // Given the scores of the nodes of one depth that ended their segments, the indices to
  // expand, best first (ties: lower index first; a NaN score ranks below every number);
  // keep_best == 0 keeps all, otherwise the first min(keep_best, size) of that order.
  virtual std::vector<int32_t> select(std::span<const double> scores) const = 0;
  virtual int32_t branch_factor() const = 0;
  virtual int32_t max_depth() const = 0;
};

// `options` must have passed validate_branch_policy (aborts with a message on a branch_factor,
// every_tokens, max_depth or keep_best no validation allows: a caller bug).
std::unique_ptr<BranchController> make_branch_controller(const BranchPolicyOptions& options);

}  // namespace deft::engine
