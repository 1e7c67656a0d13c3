#include "engine/forest.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

// place_prompt's split and branch can only fail when the tree's node ids run out (unreachable:
// see kMaxFirstNodeId), and its callers' Work::start() cannot fail: a bug.
[[noreturn]] void die_placing_prompt(const char* operation, const absl::Status& status) {
  DEFT_FAIL("Forest::place_prompt: %s failed (it cannot fail for a valid prompt while node ids "
            "last): %s",
            operation, status.ToString().c_str());
}

}  // namespace

Forest::Forest(KvCacheManager* kv, NodeId first_node_id, PrefixCacheOptions cache)
    : kv_(kv),
      tree_(/*tree_id=*/0, kv, std::numeric_limits<NodeId>::max(), first_node_id),
      cache_(cache) {
  DEFT_CHECK(first_node_id >= 1 && first_node_id <= kMaxFirstNodeId,
             "Forest: first node id %lld is outside [1, 2^62]", static_cast<long long>(first_node_id));
  DEFT_CHECK(cache.max_pages >= -1, "Forest: prefix cache cap %lld pages is below -1",
             static_cast<long long>(cache.max_pages));
}

Forest::NodeUse& Forest::use(NodeId node) {
  const auto it = uses_.find(node);
  DEFT_CHECK(it != uses_.end(), "Forest: node %lld is not a live node below the root",
             static_cast<long long>(node));
  return it->second;
}

PromptPlacement Forest::place_prompt(std::span<const TokenId> prompt) {
  // The last prompt token is never shared: its row gives the prompt's next-token logits.
  const int64_t limit = static_cast<int64_t>(prompt.size()) - 1;
  const int64_t page = kv_->page_tokens();
  NodeId at = tree_.root();
  int64_t pos = 0;
  int64_t cached = 0;
  for (;;) {
    NodeId best = -1;
    int64_t best_match = 0;
    for (NodeId child : tree_.node(at).children) {
      const NodeTokens& tokens = tree_.node(child).tokens;
      int64_t match = 0;
      const int64_t most = std::min<int64_t>(static_cast<int64_t>(tokens.size()), limit - pos);
      while (match < most && tokens[match] == prompt[pos + match]) ++match;
      if (match > best_match) {
        best = child;
        best_match = match;
      }
    }
    if (best < 0) break;
    const NodeUse& best_use = use(best);
    const bool was_cached = !is_referenced(best_use);
    const auto size = static_cast<int64_t>(tree_.node(best).tokens.size());
    const bool whole = best_match == size;
    // Nobody appends to an unheld node: go on below it when it is referenced already, or
    // cached and ends on a page boundary. Below a cached node that ends inside a page the
    // prompt's node would start on a fresh page, so the cached pages the prompt comes to
    // reference would pass the pages admission counted for it (Work::pending_pages: the
    // prompt's own pages) by one per such node; reuse ends at its last page boundary instead.
    if (whole && best_use.holds == 0 && (!was_cached || size % page == 0)) {
      at = best;
      pos += best_match;
      if (was_cached) cached += best_match;
      continue;
    }
    // Share the node's pages up to the last page boundary of the match. A held node keeps
    // its id as the tail, so its holder can still append to it.
    const int64_t cut = best_match / page * page;
    if (cut == 0) break;
    at = split(best, cut);
    pos += cut;
    if (was_cached) cached += cut;
    break;
  }
  absl::StatusOr<NodeId> node = add_child(at);
  if (!node.ok()) die_placing_prompt("branch", node.status());
  cache_.count_hit(cached);
  return {.node = *node, .shared = pos, .cached = cached};
}

NodeId Forest::split(NodeId node, int64_t at) {
  absl::StatusOr<NodeId> head = tree_.split(node, at);
  if (!head.ok()) die_placing_prompt("split", head.status());
  // The head takes the node's place: referenced through the node if the node is, else cached
  // with it (the pages it takes stay cached, so the cached page count does not change). The
  // node stays a leaf or not as before; the head has a child, so it is no LRU leaf.
  const NodeUse tail = use(node);
  uses_[*head] = {
      .holds = 0, .referenced_children = is_referenced(tail) ? 1 : 0, .cached_at = tail.cached_at};
  return *head;
}

void Forest::add_node(NodeId node) {
  uses_[node] = {.holds = 1};
  const NodeId parent = tree_.node(node).parent;
  if (parent == tree_.root()) return;
  NodeUse& parent_use = use(parent);
  const bool was_referenced = is_referenced(parent_use);
  ++parent_use.referenced_children;
  if (!was_referenced) now_referenced(parent);
}

absl::StatusOr<NodeId> Forest::add_child(NodeId node) {
  absl::StatusOr<NodeId> child = tree_.add_child(node, {});
  if (child.ok()) add_node(*child);
  return child;
}

absl::StatusOr<std::vector<NodeId>> Forest::branch(NodeId node, int32_t k) {
  absl::StatusOr<std::vector<NodeId>> children = tree_.branch(node, k);
  if (!children.ok()) return children.status();
  for (NodeId child : *children) add_node(child);
  return children;
}

absl::Status Forest::append(NodeId node, std::span<const TokenId> tokens) {
  if (tree_.contains(node) && !tokens.empty()) {
    const TreeNode& leaf = tree_.node(node);
    (void)make_room(kv_->pages_needed(tree_.kv_key(node),
                                      static_cast<int64_t>(leaf.tokens.size() + tokens.size())));
  }
  return tree_.append(node, tokens);
}

void Forest::hold(NodeId node) {
  NodeUse& node_use = use(node);
  const bool was_referenced = is_referenced(node_use);
  ++node_use.holds;
  if (!was_referenced) now_referenced(node);
}

int32_t Forest::holds(NodeId node) const {
  const auto it = uses_.find(node);
  return it != uses_.end() ? it->second.holds : 0;
}

bool Forest::referenced(NodeId node) const {
  const auto it = uses_.find(node);
  return it != uses_.end() && is_referenced(it->second);
}

void Forest::release(NodeId node) {
  NodeUse& node_use = use(node);
  DEFT_CHECK(node_use.holds > 0, "Forest: release of node %lld, which is not held",
             static_cast<long long>(node));
  --node_use.holds;
  if (!is_referenced(node_use)) {
    now_cached(node, cache_.tick());
    // An empty leaf (a prompt released before its prefill) caches nothing: it goes now.
    const TreeNode& leaf = tree_.node(node);
    if (leaf.tokens.empty() && leaf.children.empty()) free_cached_subtree(node);
  }
  trim();
}

void Forest::discard(NodeId node) {
  NodeUse& node_use = use(node);
  DEFT_CHECK(node_use.holds > 0, "Forest: discard of node %lld, which is not held",
             static_cast<long long>(node));
  --node_use.holds;
  if (!is_referenced(node_use)) {
    now_cached(node, cache_.tick(), /*file_node=*/false);
    free_cached_subtree(node);
  }
  trim();
}

void Forest::now_referenced(NodeId node) {
  while (node != tree_.root()) {
    NodeUse& node_use = use(node);
    cache_.remove_leaf(node, node_use.cached_at);
    cache_.remove_pages(node_pages(node));
    const NodeId parent = tree_.node(node).parent;
    if (parent == tree_.root()) return;
    NodeUse& parent_use = use(parent);
    const bool was_referenced = is_referenced(parent_use);
    ++parent_use.referenced_children;
    if (was_referenced) return;
    node = parent;
  }
}

void Forest::now_cached(NodeId node, uint64_t tick, bool file_node) {
  for (bool first = true; node != tree_.root(); first = false) {
    NodeUse& node_use = use(node);
    node_use.cached_at = tick;
    cache_.add_pages(node_pages(node));
    const TreeNode& tree_node = tree_.node(node);
    if (tree_node.children.empty() && (file_node || !first)) cache_.add_leaf(node, tick);
    const NodeId parent = tree_node.parent;
    if (parent == tree_.root()) return;
    NodeUse& parent_use = use(parent);
    --parent_use.referenced_children;
    if (is_referenced(parent_use)) return;
    node = parent;
  }
}

void Forest::evict_oldest(bool count) {
  const NodeId leaf = *cache_.oldest_leaf();
  const int64_t pages = node_pages(leaf);
  if (count) cache_.count_eviction(pages);
  free_cached_subtree(leaf);
}

void Forest::free_cached_subtree(NodeId node) {
  const NodeId parent = tree_.node(node).parent;
  std::vector<NodeId>& stack = scratch_;
  stack.assign(1, node);
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    const TreeNode& tree_node = tree_.node(id);
    stack.insert(stack.end(), tree_node.children.begin(), tree_node.children.end());
    const auto it = uses_.find(id);
    DEFT_CHECK(it != uses_.end() && !is_referenced(it->second),
               "Forest: node %lld is referenced; its KV cannot be freed",
               static_cast<long long>(id));
    cache_.remove_leaf(id, it->second.cached_at);
    cache_.remove_pages(node_pages(id));
    uses_.erase(it);
  }
  (void)tree_.prune(node);
  // A cached parent left without children is an evictable leaf now (a referenced one is not).
  if (parent != tree_.root() && tree_.node(parent).children.empty()) {
    const NodeUse& parent_use = use(parent);
    if (!is_referenced(parent_use)) cache_.add_leaf(parent, parent_use.cached_at);
  }
}

void Forest::trim() {
  if (!cache_.enabled()) {
    // No cache: every unreferenced node goes now, as soon as it is one (not counted).
    while (cache_.num_leaves() > 0) evict_oldest(false);
    return;
  }
  while (cache_.over_cap() && cache_.num_leaves() > 0) evict_oldest(true);
}

bool Forest::make_room(int64_t pages) {
  // Every cached page can be evicted: when they are not enough, evicting any is a loss.
  if (kv_->free_pages() + cached_pages() < pages) return false;
  while (kv_->free_pages() < pages && cache_.num_leaves() > 0) evict_oldest(true);
  return kv_->free_pages() >= pages;
}

void Forest::clear_cache() {
  while (cache_.num_leaves() > 0) evict_oldest(true);
}

int64_t Forest::node_pages(NodeId node) const {
  return static_cast<int64_t>(kv_->pages(tree_.kv_key(node)).size());
}

int64_t Forest::append_pages(NodeId node, int64_t tokens) const {
  if (tokens <= 0) return 0;
  const int64_t page = kv_->page_tokens();
  const auto held = static_cast<int64_t>(tree_.node(node).tokens.size());
  return (held + tokens + page - 1) / page - node_pages(node);
}

absl::Status Forest::check_invariants() const {
  const auto broken = [](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("forest invariant: ", parts...));
  };
  if (!tree_.check_invariants()) return broken("SequenceTree::check_invariants failed");
  if (!kv_->check_invariants()) return broken("KvCacheManager::check_invariants failed");
  const std::vector<NodeId> order = tree_.dfs_order();
  if (uses_.size() + 1 != order.size()) {
    return broken(uses_.size(), " nodes have references but the tree has ", order.size() - 1,
                  " nodes below the root");
  }
  int64_t cached_pages = 0;
  int64_t referenced_pages = node_pages(tree_.root());
  int64_t all_pages = 0;
  size_t cached_leaves = 0;
  for (NodeId id : order) {
    all_pages += node_pages(id);
    if (id == tree_.root()) continue;
    const auto it = uses_.find(id);
    if (it == uses_.end()) return broken("node ", id, " has no references entry");
    const NodeUse& node_use = it->second;
    if (node_use.holds < 0) return broken("node ", id, " has ", node_use.holds, " holds");
    const TreeNode& node = tree_.node(id);
    int32_t referenced_children = 0;
    for (NodeId child : node.children) referenced_children += referenced(child) ? 1 : 0;
    if (referenced_children != node_use.referenced_children) {
      return broken("node ", id, " counts ", node_use.referenced_children,
                    " referenced children but has ", referenced_children);
    }
    const bool leaf_entry = cache_.has_leaf(id, node_use.cached_at);
    if (is_referenced(node_use)) {
      if (leaf_entry) return broken("referenced node ", id, " is in the LRU");
      referenced_pages += node_pages(id);
      continue;
    }
    if (!cache_.enabled()) return broken("node ", id, " is cached with the cache off");
    cached_pages += node_pages(id);
    if (node.children.empty() != leaf_entry) {
      return broken("cached node ", id,
                    node.children.empty() ? " is a leaf missing from" : " has children but is in",
                    " the LRU");
    }
    if (leaf_entry) ++cached_leaves;
  }
  if (cached_leaves != cache_.num_leaves()) {
    return broken("the LRU has ", cache_.num_leaves(), " entries but ", cached_leaves,
                  " cached leaves are in the tree");
  }
  if (cached_pages != cache_.stats().cached_pages) {
    return broken("cached nodes hold ", cached_pages, " pages but the cache counts ",
                  cache_.stats().cached_pages);
  }
  if (all_pages != kv_->used_pages()) {
    return broken("nodes hold ", all_pages, " pages but the pool has ", kv_->used_pages(),
                  " in use");
  }
  if (kv_->free_pages() + referenced_pages + cached_pages != kv_->num_pages()) {
    return broken("free ", kv_->free_pages(), " + referenced ", referenced_pages, " + cached ",
                  cached_pages, " pages != the pool's ", kv_->num_pages());
  }
  if (cache_.over_cap()) {
    return broken("the cache holds ", cached_pages, " pages, over its cap of ", cache_.max_pages());
  }
  return absl::OkStatus();
}

}  // namespace deft::engine
