// The topology of one decoding tree: nodes are runs of tokens with one parent; a query's context
// is the concatenation of the nodes on its root-to-leaf path. RoPE position of a token = its
// depth = tokens on the path before it. Optionally bound to a KvCacheManager, in which case the
// tree keeps the node's KV pages in step with its tokens: appending reserves slots (all or
// nothing), pruning frees pages at once.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv_cache_manager.h"

namespace deft::engine {

// Node ids are 64-bit: the engine keeps one tree for the server's lifetime and never reuses an
// id (every prompt, branch, split and drafted speculative token takes a fresh one), so a busy
// server (~25k ids a second) would run through 2^31 ids in about a day.
using NodeId = int64_t;
using TokenId = int32_t;

// A speculative step hangs a token tree of one-token nodes with a child or two each, and prunes
// it after the step: these hold such a node's children and tokens in the node itself, so the
// step's bookkeeping makes no heap allocation for them (and follows no pointer to them).
using NodeChildren = absl::InlinedVector<NodeId, 2>;
using NodeTokens = absl::InlinedVector<TokenId, 4>;

struct TreeNode {
  NodeId id = -1;
  NodeId parent = -1;  // -1 for the root
  NodeChildren children;
  NodeTokens tokens;
  int64_t depth_begin = 0;  // depth (RoPE position) of tokens[0] = tokens on the path above
};

class SequenceTree {
 public:
  // The tree starts with one empty root node (id 0). `kv` may be null (topology only). The
  // other ids are handed out once each, from `first_node_id` up and below `max_node_ids`
  // (tests lower the limit, or start high to see ids past 2^32 without making 2^32 nodes).
  explicit SequenceTree(uint32_t tree_id, KvCacheManager* kv = nullptr,
                        NodeId max_node_ids = std::numeric_limits<NodeId>::max(),
                        NodeId first_node_id = 1);
  ~SequenceTree();  // releases every page the tree holds
  SequenceTree(const SequenceTree&) = delete;
  SequenceTree& operator=(const SequenceTree&) = delete;

  uint32_t tree_id() const { return tree_id_; }
  NodeId root() const { return 0; }

  // Appends tokens to a node that has no live children. NOT_FOUND for an unknown or pruned
  // node, FAILED_PRECONDITION for an inner node, RESOURCE_EXHAUSTED when KV is short; on
  // error nothing changes.
  absl::Status append(NodeId node, std::span<const TokenId> tokens);

  // Creates `k` (>= 1) empty children under `node`; returns their ids. Copies no KV.
  // RESOURCE_EXHAUSTED (nothing changes) once the tree has handed out all its ids.
  absl::StatusOr<std::vector<NodeId>> branch(NodeId node, int32_t k);

  // Creates one child of `node` holding `tokens` (their KV reserved), as branch(node, 1) then
  // append() but in one step and without branch()'s list: a speculative step hangs each drafted
  // token this way. NOT_FOUND, RESOURCE_EXHAUSTED (ids or KV used up); on error nothing changes.
  absl::StatusOr<NodeId> add_child(NodeId node, std::span<const TokenId> tokens);

  // Removes `node` and its whole subtree and frees their pages. Pruning the root is refused
  // (FAILED_PRECONDITION) while it has live children; with none, it empties the root.
  absl::Status prune(NodeId node);

  // Splits `node` before its token `at` (0 < at <= size; a multiple of the page size when the
  // tree holds KV): a new node (returned) takes the tokens [0, at) and their pages and takes
  // `node`'s place under its parent; `node` keeps its id, its children and the tokens from
  // `at` on, and becomes the new node's only child. Copies no KV. Holders of `node` see the
  // same path as before. NOT_FOUND / INVALID_ARGUMENT (the root, a bad `at`).
  absl::StatusOr<NodeId> split(NodeId node, int64_t at);

  // Drops the tokens of a leaf from `length` on and frees their pages. NOT_FOUND,
  // FAILED_PRECONDITION for an inner node, INVALID_ARGUMENT for a length beyond its size.
  absl::Status truncate(NodeId node, int64_t length);

  bool contains(NodeId node) const;  // live node
  // The live node; aborts on an unknown id (check contains() first for untrusted ids).
  const TreeNode& node(NodeId id) const;
  // Root-to-node path (root first). NOT_FOUND for an unknown node.
  absl::StatusOr<std::vector<NodeId>> path(NodeId node) const;
  // Depth (RoPE position) of token `index` of `node` (index may equal size: next token).
  int64_t depth(NodeId node, int64_t index) const;
  // Live nodes with no live children, in depth-first order.
  std::vector<NodeId> live_leaves() const;
  // Live nodes in depth-first pre-order (children in creation order).
  std::vector<NodeId> dfs_order() const;

  int32_t num_live_nodes() const { return num_live_nodes_; }
  // One past the largest node id ever handed out (ids of pruned nodes are never reused).
  NodeId node_id_limit() const { return next_id_; }
  int64_t total_tokens() const { return total_tokens_; }
  // Slot ids live in the KV manager under this key.
  KvCacheManager::OwnerKey kv_key(NodeId node) const {
    return (KvCacheManager::OwnerKey{tree_id_} << 64) | static_cast<uint64_t>(node);
  }
  KvCacheManager* kv() const { return kv_; }

  // Full consistency check (parents, children, depths, counts, KV pages); for tests.
  bool check_invariants() const;

 private:
  // The live node, or null (one lookup, where contains() then node() made two).
  TreeNode* live(NodeId id);
  absl::Status not_found(NodeId node) const;  // NOT_FOUND naming the node
  // OK while `count` more ids can be handed out, else RESOURCE_EXHAUSTED (branch, split).
  absl::Status ids_left(int64_t count) const;
  using NodeMap = absl::flat_hash_map<NodeId, TreeNode*>;
  // Files `node` under its id, in a pooled TreeNode (a pruned node's, else a new one).
  TreeNode& add_node(TreeNode node);
  // Erases a live node and returns its TreeNode to the pool.
  void remove_node(NodeMap::iterator it);

  uint32_t tree_id_;
  KvCacheManager* kv_;
  // The live nodes by id, pointing into node_pool_ (a deque: references stay valid while nodes
  // are added). A pruned node's entry is erased and its TreeNode goes on free_nodes_, to be
  // reused by the next node: a long speculative session holds memory for its most live nodes at
  // once, never for the 64 nodes each step prunes (ids are never reused: next_id_ only grows),
  // and a step makes no heap allocation per node. Such an allocation per node (the
  // node_hash_map this replaces) was the cold step's largest cost: malloc walks its free lists
  // through the 64 chunks the last prune freed, a cache miss each (perf on planner_bench
  // step_cold: malloc / _int_malloc about a quarter of the step).
  std::deque<TreeNode> node_pool_;
  std::vector<TreeNode*> free_nodes_;  // LIFO: the most recently pruned (cache-warm) first
  std::vector<NodeId> prune_stack_;    // prune()'s scratch (keeps its storage)
  NodeMap nodes_;
  NodeId next_id_;
  NodeId max_node_ids_;
  int32_t num_live_nodes_ = 0;
  int64_t total_tokens_ = 0;
};

}  // namespace deft::engine
