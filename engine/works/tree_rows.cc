#include "engine/works/tree_rows.h"

namespace deft::engine {

void TreeRows::discard(Forest& forest) {
  for (auto it = created.rbegin(); it != created.rend(); ++it) forest.discard(*it);
  created.clear();
  node_of.clear();
  index_of.clear();
}

absl::Status add_tree_rows(StepContext& step, NodeId under, std::span<const TokenId> tokens,
                           std::span<const int32_t> parents, StepContext::Logits logits,
                           TreeRows* rows, const std::function<void(size_t)>& after_row) {
  const size_t n = tokens.size();
  std::vector<int32_t> children(n, 0);
  for (int32_t parent : parents) {
    if (parent >= 0) ++children[static_cast<size_t>(parent)];
  }
  rows->node_of.assign(n, -1);
  rows->index_of.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t parent = parents[i];
    NodeId node = -1;
    if (parent >= 0 && children[static_cast<size_t>(parent)] == 1) {
      node = rows->node_of[static_cast<size_t>(parent)];  // continues the parent's chain
    } else {
      const NodeId at = parent < 0 ? under : rows->node_of[static_cast<size_t>(parent)];
      absl::StatusOr<NodeId> child = step.forest.add_child(at);
      if (!child.ok()) return child.status();
      node = *child;
      rows->created.push_back(node);
    }
    rows->node_of[i] = node;
    rows->index_of[i] = static_cast<int32_t>(step.forest.tree().node(node).tokens.size());
    if (absl::Status status = step.add_run(node, tokens.subspan(i, 1), logits); !status.ok()) {
      return status;
    }
    if (after_row) after_row(i);
  }
  return absl::OkStatus();
}

}  // namespace deft::engine
