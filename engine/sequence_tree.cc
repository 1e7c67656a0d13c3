#include "engine/sequence_tree.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {

SequenceTree::SequenceTree(uint32_t tree_id, KvCacheManager* kv, NodeId max_node_ids,
                           NodeId first_node_id)
    : tree_id_(tree_id),
      kv_(kv),
      next_id_(std::max<NodeId>(first_node_id, 1)),
      max_node_ids_(std::max<NodeId>(max_node_ids, 1)) {
  TreeNode root;
  root.id = 0;
  add_node(std::move(root));
  num_live_nodes_ = 1;
}

SequenceTree::~SequenceTree() {
  if (kv_ == nullptr) return;
  for (const auto& [id, n] : nodes_) kv_->release(kv_key(id));
}

bool SequenceTree::contains(NodeId node) const {
  return nodes_.contains(node);
}

TreeNode& SequenceTree::add_node(TreeNode node) {
  TreeNode* storage = nullptr;
  if (free_nodes_.empty()) {
    storage = &node_pool_.emplace_back();
  } else {
    storage = free_nodes_.back();
    free_nodes_.pop_back();
  }
  *storage = std::move(node);
  nodes_.emplace(storage->id, storage);
  return *storage;
}

void SequenceTree::remove_node(NodeMap::iterator it) {
  TreeNode* storage = it->second;
  *storage = TreeNode{};  // frees a long node's token buffer now, not when the slot is reused
  free_nodes_.push_back(storage);
  nodes_.erase(it);
}

absl::Status SequenceTree::ids_left(int64_t count) const {
  if (count <= max_node_ids_ - next_id_) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("tree ", tree_id_, ": its node ids (below ", max_node_ids_, ") are used up"));
}

TreeNode* SequenceTree::live(NodeId id) {
  const auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second;
}

absl::Status SequenceTree::not_found(NodeId node) const {
  return absl::NotFoundError(absl::StrCat("tree ", tree_id_, ": no live node ", node));
}

const TreeNode& SequenceTree::node(NodeId id) const {
  const auto it = nodes_.find(id);
  DEFT_CHECK(it != nodes_.end(), "SequenceTree %u: node %lld is not a live node", tree_id_,
             static_cast<long long>(id));
  return *it->second;
}

absl::Status SequenceTree::append(NodeId node, std::span<const TokenId> tokens) {
  TreeNode* found = live(node);
  if (found == nullptr) return not_found(node);
  TreeNode& n = *found;
  if (!n.children.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tree ", tree_id_, ": node ", node, " has ", n.children.size(),
        " live children; tokens can only be appended to a leaf"));
  }
  if (tokens.empty()) return absl::OkStatus();
  const int64_t new_size = static_cast<int64_t>(n.tokens.size() + tokens.size());
  if (kv_ != nullptr) {
    if (absl::Status status = kv_->reserve(kv_key(node), new_size); !status.ok()) return status;
  }
  n.tokens.insert(n.tokens.end(), tokens.begin(), tokens.end());
  total_tokens_ += static_cast<int64_t>(tokens.size());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NodeId>> SequenceTree::branch(NodeId node, int32_t k) {
  if (live(node) == nullptr) return not_found(node);
  if (k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("branch factor must be >= 1, got ", k));
  }
  if (absl::Status status = ids_left(k); !status.ok()) return status;
  std::vector<NodeId> children(k);
  // Cannot fail: the node is live, the ids are there and empty children take no KV.
  for (NodeId& child : children) child = *add_child(node, {});
  return children;
}

absl::StatusOr<NodeId> SequenceTree::add_child(NodeId node, std::span<const TokenId> tokens) {
  TreeNode* parent = live(node);
  if (parent == nullptr) return not_found(node);
  if (absl::Status status = ids_left(1); !status.ok()) return status;
  const NodeId id = next_id_;
  if (kv_ != nullptr && !tokens.empty()) {
    if (absl::Status status = kv_->reserve(kv_key(id), static_cast<int64_t>(tokens.size()));
        !status.ok()) {
      return status;
    }
  }
  ++next_id_;
  TreeNode child;
  child.id = id;
  child.parent = node;
  child.depth_begin = parent->depth_begin + static_cast<int64_t>(parent->tokens.size());
  child.tokens.assign(tokens.begin(), tokens.end());
  add_node(std::move(child));  // parent stays in place (node_pool_)
  parent->children.push_back(id);
  ++num_live_nodes_;
  total_tokens_ += static_cast<int64_t>(tokens.size());
  return id;
}

absl::Status SequenceTree::prune(NodeId node) {
  TreeNode* found = live(node);
  if (found == nullptr) return not_found(node);
  if (node == root()) {
    TreeNode& root_node = *found;
    if (!root_node.children.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tree ", tree_id_, ": cannot prune the root while it has ", root_node.children.size(),
          " live children"));
    }
    total_tokens_ -= static_cast<int64_t>(root_node.tokens.size());
    root_node.tokens.clear();
    if (kv_ != nullptr) kv_->release(kv_key(node));
    return absl::OkStatus();
  }
  // Detach from the parent, then free the subtree (iteratively: trees can be deep).
  NodeChildren& siblings = live(found->parent)->children;
  siblings.erase(std::remove(siblings.begin(), siblings.end(), node), siblings.end());
  std::vector<NodeId>& stack = prune_stack_;
  stack.assign(1, node);
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    const auto it = nodes_.find(id);
    const TreeNode& n = *it->second;
    stack.insert(stack.end(), n.children.begin(), n.children.end());
    total_tokens_ -= static_cast<int64_t>(n.tokens.size());
    if (kv_ != nullptr) kv_->release(kv_key(id));
    remove_node(it);
    --num_live_nodes_;
  }
  return absl::OkStatus();
}

absl::StatusOr<NodeId> SequenceTree::split(NodeId node, int64_t at) {
  TreeNode* found = live(node);
  if (found == nullptr) return not_found(node);
  if (node == root()) {
    return absl::InvalidArgumentError(absl::StrCat("tree ", tree_id_, ": cannot split the root"));
  }
  if (absl::Status status = ids_left(1); !status.ok()) return status;
  TreeNode& tail = *found;
  const int64_t size = static_cast<int64_t>(tail.tokens.size());
  if (at <= 0 || at > size || (kv_ != nullptr && at % kv_->page_tokens() != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("tree ", tree_id_, ": cannot split node ",
                                                   node, " of ", size, " tokens at ", at));
  }
  TreeNode head;
  head.id = next_id_++;
  head.parent = tail.parent;
  head.children = {node};
  head.depth_begin = tail.depth_begin;
  TreeNode& head_node = add_node(std::move(head));
  head_node.tokens.assign(tail.tokens.begin(), tail.tokens.begin() + at);
  tail.tokens.erase(tail.tokens.begin(), tail.tokens.begin() + at);
  tail.depth_begin += at;
  tail.parent = head_node.id;
  NodeChildren& siblings = nodes_.find(head_node.parent)->second->children;
  *std::find(siblings.begin(), siblings.end(), node) = head_node.id;
  if (kv_ != nullptr) {
    kv_->move_front_pages(kv_key(node), kv_key(head_node.id), at / kv_->page_tokens());
  }
  ++num_live_nodes_;
  return head_node.id;
}

absl::Status SequenceTree::truncate(NodeId node, int64_t length) {
  TreeNode* found = live(node);
  if (found == nullptr) return not_found(node);
  TreeNode& n = *found;
  if (!n.children.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("tree ", tree_id_, ": node ", node, " has live children; cannot truncate"));
  }
  if (length < 0 || length > static_cast<int64_t>(n.tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tree ", tree_id_, ": cannot truncate node ",
                                                   node, " of ", n.tokens.size(),
                                                   " tokens to ", length));
  }
  total_tokens_ -= static_cast<int64_t>(n.tokens.size()) - length;
  n.tokens.resize(static_cast<size_t>(length));
  if (kv_ != nullptr) kv_->shrink(kv_key(node), length);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NodeId>> SequenceTree::path(NodeId node) const {
  if (!contains(node)) {
    return absl::NotFoundError(absl::StrCat("tree ", tree_id_, ": no live node ", node));
  }
  std::vector<NodeId> result;
  for (NodeId id = node; id != -1; id = nodes_.find(id)->second->parent) result.push_back(id);
  std::reverse(result.begin(), result.end());
  return result;
}

int64_t SequenceTree::depth(NodeId node, int64_t index) const {
  return this->node(node).depth_begin + index;
}

std::vector<NodeId> SequenceTree::dfs_order() const {
  std::vector<NodeId> order;
  order.reserve(num_live_nodes_);
  std::vector<NodeId> stack = {root()};
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    order.push_back(id);
    const NodeChildren& children = nodes_.find(id)->second->children;
    stack.insert(stack.end(), children.rbegin(), children.rend());
  }
  return order;
}

std::vector<NodeId> SequenceTree::live_leaves() const {
  std::vector<NodeId> leaves;
  for (NodeId id : dfs_order()) {
    if (nodes_.find(id)->second->children.empty()) leaves.push_back(id);
  }
  return leaves;
}

bool SequenceTree::check_invariants() const {
  int32_t live = 0;
  int64_t tokens = 0;
  for (const auto& [id, node_ptr] : nodes_) {
    const TreeNode& n = *node_ptr;
    if (n.id != id || id < 0 || id >= next_id_) return false;
    ++live;
    tokens += static_cast<int64_t>(n.tokens.size());
    if (n.id == root()) {
      if (n.parent != -1 || n.depth_begin != 0) return false;
    } else {
      if (!contains(n.parent)) return false;
      const TreeNode& parent = *nodes_.find(n.parent)->second;
      if (std::count(parent.children.begin(), parent.children.end(), n.id) != 1) return false;
      if (n.depth_begin != parent.depth_begin + static_cast<int64_t>(parent.tokens.size())) {
        return false;
      }
    }
    for (NodeId child : n.children) {
      if (!contains(child) || nodes_.find(child)->second->parent != n.id) return false;
    }
    if (kv_ != nullptr) {
      const int64_t pages = static_cast<int64_t>(kv_->pages(kv_key(n.id)).size());
      const int64_t needed =
          (static_cast<int64_t>(n.tokens.size()) + kv_->page_tokens() - 1) / kv_->page_tokens();
      if (pages != needed) return false;
    }
  }
  return live == num_live_nodes_ && tokens == total_tokens_ &&
         node_pool_.size() == nodes_.size() + free_nodes_.size() &&
         static_cast<int32_t>(dfs_order().size()) == live;
}

}  // namespace deft::engine
