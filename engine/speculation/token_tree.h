// One branch's drafted token tree for one step. Entries hang under the anchor (the branch's last
// committed token, whose next-token row the target computes in the same step) and are added
// parent first, so any prefix of the entries is a tree too. The policy (speculative_options.h)
// decides how the tree grows from the draft model's top lists, level by level:
//   kStatic   the StaticTree's nodes, each the r-th most likely token after its parent;
//   kDynamic  EAGLE-2: at each level the top_k entries of highest draft path probability are
//             expanded by their top_k most likely successors; at the end the tree_tokens
//             entries of highest path probability are kept (a child is never more probable
//             than its parent, so they form a tree);
//   kNgram    paths added whole (add_path), merged as a trie.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/sampler.h"
#include "engine/sequence_tree.h"
#include "engine/speculation/speculative_options.h"

namespace deft::engine {

class TokenTree {
 public:
  explicit TokenTree(const SpeculativeOptions* options) : options_(options) {}

  // Starts a step's tree: at most `max_depth` levels (<= 0: no tree this step).
  void reset(int32_t max_depth);
  int32_t max_depth() const { return max_depth_; }

  // The entries (-1: the anchor) whose draft top list level `level` computes: level 0 the
  // anchor, level l >= 1 entries of depth l the policy expands. Empty once the tree is grown.
  void expansions(int32_t level, std::vector<int32_t>* out) const;
  // Length of the top lists expand() wants.
  int32_t top_k() const;
  // Grows the tree under `entry` (-1: the anchor) from the draft's top list after it (most
  // likely first, raw log-probabilities).
  void expand(int32_t entry, std::span<const TokenLogprob> top);
  // The policy's last say once every level ran (kDynamic keeps its best tree_tokens entries).
  void finish();

  // kNgram: adds a drafted continuation of the anchor, sharing the entries it matches, until
  // tree_tokens entries or max_depth levels.
  void add_path(std::span<const TokenId> tokens);

  // Keeps the first `count` entries (a tree, since parents come first).
  void truncate(int32_t count);
  void clear();

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  std::span<const TokenId> tokens() const { return tokens_; }
  std::span<const int32_t> parents() const { return parents_; }
  int32_t depth(int32_t entry) const { return depths_[static_cast<size_t>(entry)]; }

  // The target's verdict. row_tokens[0] is the token the target draws after the anchor,
  // row_tokens[1 + i] the one it draws after entry i. From the anchor, the walk moves into the
  // first child whose token is the one drawn at the current row and stops at a row whose
  // drawn token no child has. Appends the rows of the path to `rows` (0 first): the committed
  // tokens are row_tokens at those rows, accepted entries plus the target's own next token.
  // Lossless: every committed token is the one the target draws at its position, exactly as
  // decoding without speculation draws it (same seed, same position), so the output equals
  // plain decoding's (recursive rejection sampling of deterministic drafts, as SpecInfer and
  // Sequoia specify it, draws the same distribution; this draw is its coupling with the plain
  // decoder).
  void walk(std::span<const TokenId> row_tokens, std::vector<int32_t>* rows) const;

 private:
  int32_t add(TokenId token, int32_t parent, float score, int32_t static_node);

  const SpeculativeOptions* options_;
  int32_t max_depth_ = 0;
  std::vector<TokenId> tokens_;
  std::vector<int32_t> parents_;
  std::vector<int32_t> depths_;
  std::vector<float> scores_;       // draft log-probability of the path (kDynamic)
  std::vector<int32_t> static_of_;  // the StaticTree node an entry realises (kStatic)
  std::vector<uint8_t> expanded_;
};

}  // namespace deft::engine
