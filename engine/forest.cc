#include "engine/forest.h"

#include <algorithm>
#include <limits>

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

Forest::Forest(KvCacheManager* kv, NodeId first_node_id)
    : kv_(kv), tree_(/*tree_id=*/0, kv, std::numeric_limits<NodeId>::max(), first_node_id) {
  DEFT_CHECK(first_node_id >= 1 && first_node_id <= kMaxFirstNodeId,
             "Forest: first node id %lld is outside [1, 2^62]", static_cast<long long>(first_node_id));
}

PromptPlacement Forest::place_prompt(std::span<const TokenId> prompt) {
  // The last prompt token is never shared: its row gives the prompt's next-token logits.
  const int64_t limit = static_cast<int64_t>(prompt.size()) - 1;
  const int64_t page = kv_->page_tokens();
  NodeId at = tree_.root();
  int64_t pos = 0;
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
    const TreeNode& node = tree_.node(best);
    const bool whole = best_match == static_cast<int64_t>(node.tokens.size());
    if (whole && !node.children.empty() && holds(best) == 0) {
      at = best;  // an unheld inner node (a shared head): go on below it
      pos += best_match;
      continue;
    }
    // Share the node's pages up to the last page boundary of the match. A held node keeps
    // its id as the tail, so its holder can still append to it.
    const int64_t cut = best_match / page * page;
    if (cut == 0) break;
    absl::StatusOr<NodeId> head = tree_.split(best, cut);
    if (!head.ok()) die_placing_prompt("split", head.status());
    at = *head;
    pos += cut;
    break;
  }
  absl::StatusOr<NodeId> node = add_child(at);
  if (!node.ok()) die_placing_prompt("branch", node.status());
  return {.node = *node, .shared = pos};
}

absl::StatusOr<NodeId> Forest::add_child(NodeId node) {
  absl::StatusOr<NodeId> child = tree_.add_child(node, {});
  if (child.ok()) hold(*child);
  return child;
}

absl::StatusOr<std::vector<NodeId>> Forest::branch(NodeId node, int32_t k) {
  absl::StatusOr<std::vector<NodeId>> children = tree_.branch(node, k);
  if (!children.ok()) return children.status();
  for (NodeId child : *children) hold(child);
  return children;
}

void Forest::hold(NodeId node) { ++holds_[node]; }

int32_t Forest::holds(NodeId node) const {
  const auto it = holds_.find(node);
  return it != holds_.end() ? it->second : 0;
}

void Forest::release(NodeId node) {
  DEFT_CHECK(holds(node) > 0, "Forest: release of node %lld, which is not held",
             static_cast<long long>(node));
  if (--holds_[node] == 0) holds_.erase(node);
  collect(node);
}

void Forest::collect(NodeId node) {
  while (node != tree_.root() && tree_.contains(node) && holds(node) == 0 &&
         tree_.node(node).children.empty()) {
    const NodeId parent = tree_.node(node).parent;
    (void)tree_.prune(node);
    node = parent;
  }
}

int64_t Forest::node_pages(NodeId node) const {
  return static_cast<int64_t>(kv_->pages(tree_.kv_key(node)).size());
}

}  // namespace deft::engine
