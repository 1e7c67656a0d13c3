// Speculative-decoding acceptance over a drafted token tree (the Verify RPC): given the target
// model's logits at the anchor node and after every drafted entry, which root-to-leaf path of
// the draft the target accepts and which token it emits after it (the bonus token).
//
// Modes (params as in engine::Sampler):
// - Greedy (temperature 0, or top_k 1): at each level the target argmax (ties to the lower id)
//   must equal a child's token (the first such child in entry order) to accept it; the bonus
//   is the argmax of the last accepted row.
// - Sampling without draft_probs: at each level the target token is drawn exactly as
//   Sampler::sample(row, params, position) draws it; the child with that token is accepted, or
//   if none has it the draw is the bonus. Accepted tokens + bonus are therefore exactly what
//   plain decoding with the same seed emits, token for token.
// - Sampling with draft_probs q (SpecInfer-style multi-draft rejection): for each child in
//   entry order accept with probability min(1, p(t) / q(t)), p = target distribution after
//   temperature/top-k/top-p; on a rejection p(t) = max(0, p(t) - q(t)), renormalised, before
//   the next child; when every child is rejected the bonus is drawn from the residual p, after
//   an accepted leaf from the leaf's row. Exact (emits tokens distributed as p) for
//   deterministic drafts, q = 1.
//
// Randomness: each uniform number comes from Philox4x32-10 keyed by params.seed with the
// 128-bit counter {position low 32 bits, position high 32 bits, entry word, purpose}:
//   target draw        {pos, 0, 0}          pos = position of the drawn token; this is exactly
//                                           sampling_uniform(seed, pos), the Sampler's draw
//   acceptance test    {pos, e + 1, 1}      of entry e, pos = position of entry e's token
//   residual draw      {pos, 0, 2}          the bonus after rejecting every child
// where the position of the anchor's next token is `step` and an entry at depth d (d = 0 under
// the anchor) sits at step + d. A verify therefore replays identically, and never reuses a
// number for two decisions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

struct DraftTree {
  std::span<const TokenId> tokens;     // one per entry
  std::span<const int32_t> parents;    // parent entry index, -1 = under the anchor node
  std::span<const float> draft_probs;  // empty, or one per entry in (0, 1]
};

// INVALID_ARGUMENT naming the entry: empty tree, size mismatches, more than max_entries
// entries, token outside [0, vocab), parent >= own index (forward reference or self/cycle)
// or < -1, draft prob not in (0, 1] or not finite.
absl::Status validate_draft_tree(const DraftTree& tree, int32_t vocab_size, int32_t max_entries);

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
// INVALID_ARGUMENT for a bad tree (validate_draft_tree without an entry limit), bad params
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
