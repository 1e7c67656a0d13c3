// A static speculation tree: a fixed set of rank paths (Medusa's notation: [0] is the draft's
// most likely first token, [0, 1] that token's second most likely successor, ...). Every step
// realises it from the draft model's top lists: the entry of path P + [r] is the r-th most likely
// token after the entry of P.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::engine {

// Most ranks one path element may use: the draft's top lists are at most this long
// (kMaxTopLogprobs).
inline constexpr int32_t kMaxStaticRank = 20;

class StaticTree {
 public:
  struct Node {
    int32_t parent = -1;  // -1: under the anchor (the branch's last committed token)
    int32_t rank = 0;     // among the parent's draft top list
    int32_t depth = 1;    // 1 for the anchor's children
  };

  // From rank paths: each path non-empty, ranks in [0, kMaxStaticRank), no duplicate, every
  // proper prefix also a path. INVALID_ARGUMENT naming the first bad path. The nodes come out
  // ordered by depth, then by the order of the paths: a parent precedes its children, and
  // the first k nodes of the tree are a tree too.
  static absl::StatusOr<StaticTree> from_paths(const std::vector<std::vector<int32_t>>& paths);
  // The same from JSON: a list of paths, or an object whose "tree" member is one (a file of
  // configs/, or a Medusa-style "Tree_Structure").
  static absl::StatusOr<StaticTree> from_json(const std::string& text);

  std::span<const Node> nodes() const { return nodes_; }
  int32_t size() const { return static_cast<int32_t>(nodes_.size()); }
  int32_t depth() const { return depth_; }
  // The longest top list any node's expansion reads (1 + the largest rank).
  int32_t top_k() const { return top_k_; }
  // Node indices of the children of `node` (-1: the anchor's), in rank order.
  std::span<const int32_t> children(int32_t node) const;
  // The rank paths, in node order (configs/, tests).
  std::vector<std::vector<int32_t>> paths() const;

 private:
  std::vector<Node> nodes_;
  std::vector<std::vector<int32_t>> children_;  // [node + 1]
  int32_t depth_ = 0;
  int32_t top_k_ = 0;
};

// The default tree of `size` nodes and at most `depth` levels: the nodes of highest estimated
// probability of acceptance, where a path's probability is the product over its ranks of a
// per-rank acceptance estimate (0.6, 0.15, 0.07, 0.04, 0.03, then 0.02 down by a third per rank;
// the shape of a small draft's measured rank acceptance), the way Medusa and Sequoia choose
// their trees. configs/speculative_tree.json holds default_static_tree(63, 6).
StaticTree default_static_tree(int32_t size, int32_t depth);

}  // namespace deft::engine
