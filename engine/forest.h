// The engine's one shared tree of KV (DESIGN.md §2, §4): every live job and session hangs its
// prompt under the empty root of one SequenceTree, so prompts that share a prefix share its KV
// and the planner sees all of a step's queries in one tree (a shared prefix is read once per
// step, across jobs too).
//
// References: works and sessions hold nodes (hold/release). A node is referenced while it is
// held or has a referenced child; a referenced node's KV is never freed (a session's holds pin
// its nodes, and with them their paths, for as long as the session lives).
//
// Prefix cache (engine/prefix_cache.h): a node left unreferenced keeps its KV as cached KV, to
// be reused by later prompts, until pages are needed (append() makes room by evicting the least
// recently used cached leaves) or the cache is over its cap. With the cache off (max_pages 0)
// an unreferenced node is freed at once, with every ancestor left unreferenced. discard() frees
// KV no prompt will ask for (a drafted entry, a score's continuation, a pruned branch) at once
// either way, so it never pushes useful prefixes out of the cache.
//
// Prefix reuse (radix-style): a new prompt walks down from the root along the node whose
// tokens share the longest prefix with it, referenced or cached. It goes on below a node it
// matches whole when nobody holds that node (nobody appends to it, so its KV stays as it is)
// and, for a cached node, when the node ends on a page boundary (so the cached pages the prompt
// comes to reference never pass the prompt's own page count, which admission counted); where
// the match ends inside a node, that node is split at the last page boundary of the match
// (SequenceTree::split: the head takes the shared pages, the node keeps its id as the tail, so
// its holder sees nothing change) and the prompt's own node hangs under the head.
// Alignment: reuse ends at a page boundary inside a node, or at the end of a whole live node. A
// node owns whole pages, so either way the prompt's node starts on a fresh page and no KV is
// copied; token-aligned reuse would need a copy of the last partial page (a device operation the
// runner does not have) to save at most page_tokens - 1 recomputed tokens, under 0.4% of a
// 4000-token prompt at 16-token pages. The prompt's last token is always recomputed, so its
// next-token logits exist.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv_cache_manager.h"
#include "engine/prefix_cache.h"
#include "engine/sequence_tree.h"

namespace deft::engine {

// The highest first node id (SchedulerOptions::first_node_id) a forest accepts: 2^62 ids are
// left above it, never used up (25k ids a second for 5 million years).
inline constexpr NodeId kMaxFirstNodeId = NodeId{1} << 62;

struct PromptPlacement {
  NodeId node = -1;        // the prompt's own node (empty: its tokens are to be appended)
  int64_t shared = 0;      // prompt tokens whose KV it shares (the node's depth_begin)
  int64_t cached = 0;      // of which found in cached (unreferenced) nodes: prefix-cache hits
};

class Forest {
 public:
  // Node ids after the root start at `first_node_id` (SchedulerOptions::first_node_id; 1 to
  // kMaxFirstNodeId, else the constructor aborts).
  explicit Forest(KvCacheManager* kv, NodeId first_node_id = 1, PrefixCacheOptions cache = {});

  SequenceTree& tree() { return tree_; }
  const SequenceTree& tree() const { return tree_; }
  KvCacheManager& kv() { return *kv_; }

  // Places a prompt (>= 1 token): an empty held node whose path shares the longest prefix in
  // the forest, live or cached; the caller appends prompt[shared:] to it. Never fails for a
  // valid prompt: it takes up to two fresh node ids, and the forest's 64-bit ids cannot run out
  // (kMaxFirstNodeId), so a failure aborts as a bug, with a message.
  PromptPlacement place_prompt(std::span<const TokenId> prompt);

  // k empty children under `node`, each held once.
  absl::StatusOr<std::vector<NodeId>> branch(NodeId node, int32_t k);
  // One empty child under `node`, held once (branch(node, 1) without the list).
  absl::StatusOr<NodeId> add_child(NodeId node);

  // Appends tokens to a held leaf (SequenceTree::append), evicting cached KV first when the
  // free pages are short. RESOURCE_EXHAUSTED only when the referenced KV leaves no room.
  absl::Status append(NodeId node, std::span<const TokenId> tokens);

  void hold(NodeId node);
  // Drops one hold; a node left unreferenced becomes cached KV (freed at once with the cache
  // off, or when that puts the cache over its cap).
  void release(NodeId node);
  // Drops one hold; a node left unreferenced is freed at once, with its subtree (all cached).
  void discard(NodeId node);
  int32_t holds(NodeId node) const;
  // Held, or with a referenced child: its KV is never evicted.
  bool referenced(NodeId node) const;

  // Evicts least recently used cached KV until `pages` pages are free; returns whether they
  // are (false, evicting nothing, when the free and cached pages together are short).
  bool make_room(int64_t pages);
  // Evicts every cached node (after a failed step: its rows' KV may never have been written).
  void clear_cache();

  // Pages of one node.
  int64_t node_pages(NodeId node) const;
  // New pages an append of `tokens` tokens to `node` takes (a node owns whole pages).
  int64_t append_pages(NodeId node, int64_t tokens) const;
  // Pages of cached nodes: evictable at any time, so free for admission's purposes.
  int64_t cached_pages() const { return cache_.stats().cached_pages; }
  // Pages of referenced nodes (the used pages that are not cached).
  int64_t referenced_pages() const { return kv_->used_pages() - cached_pages(); }
  const PrefixCacheStats& cache_stats() const { return cache_.stats(); }
  bool cache_enabled() const { return cache_.enabled(); }

  // Full consistency check, for tests: the tree's and the pool's own checks; every node's
  // reference counts match its holds and children; cached nodes are exactly the unreferenced
  // ones, the LRU holds exactly the childless ones, and their pages add up to cached_pages();
  // free + referenced + cached pages == the pool; the cache is within its cap. The error names
  // the first broken invariant.
  absl::Status check_invariants() const;

 private:
  struct NodeUse {
    int32_t holds = 0;
    int32_t referenced_children = 0;
    uint64_t cached_at = 0;  // when it last became unreferenced: its LRU key
  };
  static bool is_referenced(const NodeUse& use) {
    return use.holds > 0 || use.referenced_children > 0;
  }
  NodeUse& use(NodeId node);
  // Files a new node (held once by its creator) under its parent.
  void add_node(NodeId node);
  // `node` has just become referenced (it was cached); so do its cached ancestors.
  void now_referenced(NodeId node);
  // `node` has just become unreferenced; so do the ancestors it alone referenced. Each is
  // cached at `tick`; `node` itself enters the LRU (when a leaf) only if `file_node`: a
  // discarded node is freed next, and a speculative step discards many (an LRU entry is a heap
  // allocation, which SequenceTree spares such nodes).
  void now_cached(NodeId node, uint64_t tick, bool file_node = true);
  // Splits a node for place_prompt (see the header comment), keeping the references.
  NodeId split(NodeId node, int64_t at);
  // Evicts the least recently used cached leaf (the cache must have one).
  void evict_oldest(bool count);
  // Frees a cached node and its subtree (all cached).
  void free_cached_subtree(NodeId node);
  // Evicts until the cache is within its cap.
  void trim();

  KvCacheManager* kv_;
  SequenceTree tree_;
  PrefixCache cache_;
  // References by node id, for every node but the root (ids are never reused, so an array by id
  // would grow with every node the server ever made).
  absl::flat_hash_map<NodeId, NodeUse> uses_;
  std::vector<NodeId> scratch_;  // free_cached_subtree's stack (keeps its storage)
};

}  // namespace deft::engine
