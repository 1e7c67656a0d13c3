// The engine's one shared tree of KV (DESIGN.md §2, §4): every live job and session hangs its
// prompt under the empty root of one SequenceTree, so prompts that share a prefix share its KV
// and the planner sees all of a step's queries in one tree (a shared prefix is read once per
// step, across jobs too).
//
// Prefix reuse (radix-style): a new prompt walks down from the root along the node whose
// tokens share the longest prefix with it. Where the match ends inside a node, that node is
// split at the last page boundary of the match (SequenceTree::split: the head takes the
// shared pages, the node keeps its id as the tail, so its holder sees nothing change) and the
// prompt's own node hangs under the head. The prompt's last token is always recomputed, so
// its next-token logits exist. Tokens after the last shared page boundary are recomputed.
//
// Lifetime: works and sessions hold nodes (hold/release). A node lives while it is held or
// has live children; releasing the last hold frees it and every ancestor left with neither.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

// The highest first node id (SchedulerOptions::first_node_id) a forest accepts: 2^62 ids are
// left above it, never used up (25k ids a second for 5 million years).
inline constexpr NodeId kMaxFirstNodeId = NodeId{1} << 62;

struct PromptPlacement {
  NodeId node = -1;        // the prompt's own node (empty: its tokens are to be appended)
  int64_t shared = 0;      // prompt tokens whose KV it shares (the node's depth_begin)
};

class Forest {
 public:
  // Node ids after the root start at `first_node_id` (SchedulerOptions::first_node_id; 1 to
  // kMaxFirstNodeId, else the constructor aborts).
  explicit Forest(KvCacheManager* kv, NodeId first_node_id = 1);

  SequenceTree& tree() { return tree_; }
  const SequenceTree& tree() const { return tree_; }
  KvCacheManager& kv() { return *kv_; }

  // Places a prompt (>= 1 token): an empty held node whose path shares the longest live
  // prefix; the caller appends prompt[shared:] to it. Never fails for a valid prompt: it takes
  // up to two fresh node ids, and the forest's 64-bit ids cannot run out (kMaxFirstNodeId), so
  // a failure aborts as a bug, with a message.
  PromptPlacement place_prompt(std::span<const TokenId> prompt);

  // k empty children under `node`, each held once.
  absl::StatusOr<std::vector<NodeId>> branch(NodeId node, int32_t k);
  // One empty child under `node`, held once (branch(node, 1) without the list).
  absl::StatusOr<NodeId> add_child(NodeId node);

  void hold(NodeId node);
  // Drops one hold; frees the node (and ancestors) left unheld and childless.
  void release(NodeId node);
  int32_t holds(NodeId node) const;

  // Pages of one node.
  int64_t node_pages(NodeId node) const;

 private:
  void collect(NodeId node);

  KvCacheManager* kv_;
  SequenceTree tree_;
  // Holds by node id, for held nodes only (ids are never reused, so an array by id would grow
  // with every node the server ever made).
  absl::flat_hash_map<NodeId, int32_t> holds_;
};

}  // namespace deft::engine
