// Speculative-decoding acceptance over a drafted token tree (the Verify RPC): given the target
// model's logits at the anchor node and after every drafted entry, which root-to-leaf path of
// the draft the target accepts and which token it emits after it (the bonus token).
//
// Rules (params as in engine::Sampler). Greedy ignores every draft probability; otherwise each
// node of the walk (the anchor, then each accepted entry) with drafted children picks its rule:
// - Greedy (temperature 0, or top_k 1): at each level the target argmax (ties to the lower id)
//   must equal a child's token (the first such child in entry order) to accept it; the bonus
//   is the argmax of the last accepted row.
// - Draft distribution (the node has one, DraftTree::distributions): multi-draft speculative
//   sampling (SpecInfer's multi-step speculative sampling, Miao et al. 2024; Sequoia's
//   sampling without replacement, Chen et al. 2024). q = the node's sparse draft distribution
//   normalised to sum 1 (the client drew the children from the listed tokens in proportion to
//   their probabilities), p = target distribution after temperature/top-k/top-p. For each
//   child x in entry order: accept with probability min(1, p(x) / q(x)); on a rejection
//   p <- norm(max(0, p - q)) and, drawn without replacement, also q(x) <- 0 and q
//   renormalised; when every child is rejected the bonus is drawn from the residual p. Exact:
//   the emitted token is distributed as p for any q, provided the children were drawn from q as
//   DraftSampling says (each child given the ones before it), so the whole committed sequence
//   is distributed as plain sampling's.
// - draft_probs q(x) of each drafted token (no distributions; the older, per-token rule): for
//   each child accept with probability min(1, p(x) / q(x)); on a rejection only the drafted
//   token's mass is removed, p(x) = max(0, p(x) - q(x)), renormalised; the bonus after all
//   rejections is drawn from the residual. Exact only for deterministic drafts (q(x) = 1, every
//   other token 0, where it equals the rule above); not for sampled drafts, whose q elsewhere
//   it does not know.
// - Neither (no distribution at this node, no draft_probs): the target token is drawn exactly as
//   Sampler::sample(row, params, position) draws it; the child with that token is accepted, or
//   if none has it the draw is the bonus. Exact for any draft; a chain of such nodes emits what
//   plain decoding with the same seed emits, token for token.
// After an accepted leaf the bonus is the Sampler's draw from the leaf's row in every rule.
//
// Randomness: each uniform number comes from Philox4x32-10 keyed by params.seed with the
// 128-bit counter {position low 32 bits, position high 32 bits, entry word, purpose}:
//   target draw        {pos, 0, 0}          pos = position of the drawn token; this is exactly
//                                           sampling_uniform(seed, pos), the Sampler's draw
//   acceptance test    {pos, e + 1, 1}      of entry e, pos = position of entry e's token
//   residual draw      {pos, 0, 2}          the bonus after rejecting every child
// where the position of the anchor's next token is `step` and an entry at depth d (d = 0 under
// the anchor) sits at step + d. A node uses one rule, and nodes of one walk sit at distinct
// positions, so a verify replays identically and never reuses a number for two decisions.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

// How a node's children were drawn from its draft distribution (the rule above needs it).
enum class DraftSampling : uint8_t {
  kUnspecified,  // only without distributions
  // Each child an independent draw from q (duplicates stay separate entries: merging them
  // changes the rule); SpecInfer's rule.
  kWithReplacement,
  // Each child drawn from q less the siblings before it, renormalised (siblings' tokens are
  // distinct); Sequoia's rule.
  kWithoutReplacement,
};

// The draft distribution a node's drafted children were sampled from: a sparse list covering
// the (truncated) distribution, e.g. the draft model's top-k; tokens outside it have q = 0.
struct DraftDistribution {
  int32_t entry = -1;  // -1: the anchor node; else the entry whose children were drafted from it
  std::vector<TokenId> tokens;  // distinct, in [0, vocab)
  std::vector<float> probs;     // one per token, finite, in (0, 1], summing to <= 1 + 1e-3
};

struct DraftTree {
  std::span<const TokenId> tokens;     // one per entry
  std::span<const int32_t> parents;    // parent entry index, -1 = under the anchor node
  std::span<const float> draft_probs;  // empty, or one per entry in (0, 1]
  // Empty, or at most one per node that has drafted children (not with draft_probs).
  std::span<const DraftDistribution> distributions;
  DraftSampling draft_sampling = DraftSampling::kUnspecified;  // set when distributions are
};

// Sum of a distribution's probabilities may pass 1 by this much (float rounding of a client's
// softmax over thousands of tokens).
inline constexpr double kDraftProbSumTolerance = 1e-3;

// INVALID_ARGUMENT naming the entry or draft_distributions[i]: empty tree, size mismatches,
// more than max_entries entries, token outside [0, vocab), parent >= own index (forward
// reference or self/cycle) or < -1, draft prob not in (0, 1] or not finite; with distributions:
// draft_probs given too, draft_sampling unspecified, more than entries + 1 distributions or
// more than max_distribution_tokens (token, prob) pairs in all, an entry outside [-1, entries),
// two for one node, one for a node without drafted children, sizes that differ, no tokens, a
// token outside the vocabulary or listed twice, a prob not finite in (0, 1], a sum over
// 1 + kDraftProbSumTolerance, a drafted child whose token its parent's distribution lacks, and
// (drawn without replacement) two siblings with one token.
absl::Status validate_draft_tree(
    const DraftTree& tree, int32_t vocab_size, int32_t max_entries,
    int64_t max_distribution_tokens = std::numeric_limits<int64_t>::max());

struct Acceptance {
  // Root-to-leaf path of accepted entries (entry indices, anchor side first; may be empty).
  // Each is the parent of the next; the first has parent -1. The committed tokens are
  // tree.tokens[e] for e in accepted_entries, then bonus_token (see committed_tokens()).
  std::vector<int32_t> accepted_entries;
  TokenId bonus_token = -1;    // the target's token after the accepted path
  float bonus_logprob = 0.0f;  // raw log-softmax of it (row of the last accepted entry)

  // The accepted drafted tokens in path order (VerifyResponse.accepted).
  std::vector<TokenId> accepted_tokens(const DraftTree& tree) const;
  // accepted_tokens() followed by bonus_token: what the sequence grows by. Stop tokens are not
  // interpreted here: the caller cuts the committed tokens after the first stop/EOS token.
  std::vector<TokenId> committed_tokens(const DraftTree& tree) const;
};

// logits: (entries + 1) rows of vocab_size floats: row 0 = target next-token logits at the
// anchor node, row 1 + i = target logits after entry i. Only the rows along the walked path
// are read. `step` = position of the first drafted token (of the anchor's next token).
// INVALID_ARGUMENT for a bad tree (validate_draft_tree without its limits), bad params
// (validate_sampling_params), vocab_size < 1 or a logits size other than
// (entries + 1) * vocab_size; INTERNAL for a NaN or +inf logit or an all -inf row on the
// walked path (as Sampler::sample).
absl::StatusOr<Acceptance> accept_draft_tree(const DraftTree& tree, std::span<const float> logits,
                                             int32_t vocab_size, const SamplingParams& params,
                                             uint64_t step);
// The same over one span per row (rows[0] the anchor's, rows[1 + i] after entry i, each
// vocab_size floats), so a caller need not copy rows it already holds into one buffer (a
// 256-entry tree's logits are 131 MB of a 128256-token vocabulary).
absl::StatusOr<Acceptance> accept_draft_tree(const DraftTree& tree,
                                             std::span<const std::span<const float>> rows,
                                             int32_t vocab_size, const SamplingParams& params,
                                             uint64_t step);

}  // namespace deft::engine
