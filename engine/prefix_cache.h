// The prefix cache (DESIGN.md §7, "KV as a cache"): KV that no work or session references any
// more stays in the forest (engine/forest.h) as cached KV, so the next prompt with the same
// prefix reuses it instead of prefilling it again. Cached KV goes least-recently-used first,
// leaves before their parents (a parent is on the path of its children: evicting it first would
// strand them), and only when pages are needed (a step's allocation) or the cache is over its
// cap. Admission counts cached pages as free (engine/scheduler.h), so the cache never holds a
// request back.
//
// This class is the policy's bookkeeping: the evictable leaves in LRU order, the cached page
// count, the cap and the counters. The forest decides what is referenced and does the evicting
// (it owns the tree).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <utility>

#include "engine/sequence_tree.h"

namespace deft::engine {

struct PrefixCacheOptions {
  // Most pages cached KV may hold. -1 (the default): the whole pool. Cached pages cost nothing
  // until pages are needed, when they are evicted on the spot, so a smaller cap only throws
  // hits away; it is there for an operator who wants the cache small. 0: no prefix cache (a
  // released node's KV is freed at once).
  int64_t max_pages = -1;
};

struct PrefixCacheStats {
  int64_t cached_pages = 0;   // pages held by cached (unreferenced) nodes now
  int64_t hit_tokens = 0;     // prompt tokens whose KV was found in cached nodes, ever
  int64_t evicted_pages = 0;  // pages of cached KV evicted (for room or the cap), ever
};

class PrefixCache {
 public:
  explicit PrefixCache(PrefixCacheOptions options) : options_(options) {}

  bool enabled() const { return options_.max_pages != 0; }
  int64_t max_pages() const { return options_.max_pages; }
  // The cached pages exceed the cap.
  bool over_cap() const {
    return options_.max_pages >= 0 && stats_.cached_pages > options_.max_pages;
  }

  // A fresh use time, for the nodes that become cached now (a counter, not a clock: eviction
  // order is then the same on every run).
  uint64_t tick() { return ++clock_; }

  // A cached node without children, evictable, keyed by the time it became cached.
  void add_leaf(NodeId node, uint64_t cached_at) { leaves_.insert({cached_at, node}); }
  // Erases the entry if there is one (a node that gained a child or a reference).
  void remove_leaf(NodeId node, uint64_t cached_at) { leaves_.erase({cached_at, node}); }
  bool has_leaf(NodeId node, uint64_t cached_at) const {
    return leaves_.count({cached_at, node}) != 0;
  }
  // The least recently used evictable leaf.
  std::optional<NodeId> oldest_leaf() const {
    if (leaves_.empty()) return std::nullopt;
    return leaves_.begin()->second;
  }
  size_t num_leaves() const { return leaves_.size(); }

  void add_pages(int64_t pages) { stats_.cached_pages += pages; }
  void remove_pages(int64_t pages) { stats_.cached_pages -= pages; }
  void count_hit(int64_t tokens) { stats_.hit_tokens += tokens; }
  void count_eviction(int64_t pages) { stats_.evicted_pages += pages; }
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  PrefixCacheOptions options_;
  PrefixCacheStats stats_;
  uint64_t clock_ = 0;
  // (cached_at, node): the oldest first; ties (nodes cached by one release) by id.
  std::set<std::pair<uint64_t, NodeId>> leaves_;
};

}  // namespace deft::engine
