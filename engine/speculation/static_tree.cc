#include "engine/speculation/static_tree.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deft::engine {
namespace {

std::string path_text(const std::vector<int32_t>& path) {
  return absl::StrCat("[", absl::StrJoin(path, ", "), "]");
}

}  // namespace

absl::StatusOr<StaticTree> StaticTree::from_paths(const std::vector<std::vector<int32_t>>& paths) {
  if (paths.empty()) return absl::InvalidArgumentError("the speculation tree has no paths");
  std::map<std::vector<int32_t>, size_t> index;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::vector<int32_t>& path = paths[i];
    if (path.empty()) return absl::InvalidArgumentError(absl::StrCat("tree path ", i, " is empty"));
    for (int32_t rank : path) {
      if (rank < 0 || rank >= kMaxStaticRank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tree path ", i, " ", path_text(path), ": ranks must be in [0, ", kMaxStaticRank, ")"));
      }
    }
    if (!index.emplace(path, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tree path ", i, " ", path_text(path), " appears twice"));
    }
  }
  // Keep the given order (a file lists its most useful paths first, so a request with a smaller
  // budget keeps the best part), except that a path waits for its parent: it goes where its
  // last prefix appears, after that prefix.
  struct Key {
    size_t ready = 0;  // the largest index among the path and its prefixes
    size_t depth = 0;
    size_t index = 0;
  };
  std::vector<Key> keys(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::vector<int32_t>& path = paths[i];
    keys[i] = {.ready = i, .depth = path.size(), .index = i};
    for (size_t length = 1; length < path.size(); ++length) {
      const std::vector<int32_t> prefix(path.begin(), path.begin() + length);
      auto it = index.find(prefix);
      if (it == index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("tree path ", i, " ", path_text(path),
                                                       ": its prefix ", path_text(prefix),
                                                       " is not a path of the tree"));
      }
      keys[i].ready = std::max(keys[i].ready, it->second);
    }
  }
  std::vector<size_t> order(paths.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Key& x = keys[a];
    const Key& y = keys[b];
    if (x.ready != y.ready) return x.ready < y.ready;
    if (x.depth != y.depth) return x.depth < y.depth;
    return x.index < y.index;
  });
  StaticTree tree;
  std::map<std::vector<int32_t>, int32_t> node_of;
  tree.children_.resize(paths.size() + 1);
  for (size_t i : order) {
    const std::vector<int32_t>& path = paths[i];
    const std::vector<int32_t> parent_path(path.begin(), path.end() - 1);
    const int32_t parent = parent_path.empty() ? -1 : node_of.at(parent_path);
    const auto node = static_cast<int32_t>(tree.nodes_.size());
    tree.nodes_.push_back(
        {.parent = parent, .rank = path.back(), .depth = static_cast<int32_t>(path.size())});
    node_of[path] = node;
    tree.children_[static_cast<size_t>(parent + 1)].push_back(node);
    tree.depth_ = std::max(tree.depth_, static_cast<int32_t>(path.size()));
    tree.top_k_ = std::max(tree.top_k_, path.back() + 1);
  }
  for (std::vector<int32_t>& children : tree.children_) {
    std::sort(children.begin(), children.end(), [&](int32_t a, int32_t b) {
      return tree.nodes_[static_cast<size_t>(a)].rank < tree.nodes_[static_cast<size_t>(b)].rank;
    });
  }
  return tree;
}

absl::StatusOr<StaticTree> StaticTree::from_json(const std::string& text) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError("the speculation tree is not JSON");
  if (json.is_object()) {
    if (json.contains("tree")) {
      json = json["tree"];
    } else if (json.contains("Tree_Structure")) {
      json = json["Tree_Structure"];
    } else {
      return absl::InvalidArgumentError(
          "the speculation tree JSON object has no \"tree\" list of rank paths");
    }
  }
  if (!json.is_array()) {
    return absl::InvalidArgumentError("the speculation tree must be a list of rank paths");
  }
  std::vector<std::vector<int32_t>> paths;
  for (size_t i = 0; i < json.size(); ++i) {
    const nlohmann::json& path = json[i];
    if (!path.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("tree path ", i, " is not a list of ranks"));
    }
    std::vector<int32_t>& out = paths.emplace_back();
    for (const nlohmann::json& rank : path) {
      if (!rank.is_number_integer() || rank.get<int64_t>() < 0 ||
          rank.get<int64_t>() >= kMaxStaticRank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tree path ", i, " has a rank that is not an integer in [0, ", kMaxStaticRank, ")"));
      }
      out.push_back(rank.get<int32_t>());
    }
  }
  return from_paths(paths);
}

std::span<const int32_t> StaticTree::children(int32_t node) const {
  return children_[static_cast<size_t>(node + 1)];
}

std::vector<std::vector<int32_t>> StaticTree::paths() const {
  std::vector<std::vector<int32_t>> out(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& node = nodes_[i];
    if (node.parent >= 0) out[i] = out[static_cast<size_t>(node.parent)];
    out[i].push_back(node.rank);
  }
  return out;
}

StaticTree default_static_tree(int32_t size, int32_t depth) {
  constexpr int32_t kRanks = 10;
  double accept[kRanks] = {0.6, 0.15, 0.07, 0.04, 0.03, 0.02};
  for (int32_t r = 6; r < kRanks; ++r) accept[r] = accept[r - 1] * 2.0 / 3.0;
  struct Candidate {
    double value;
    uint64_t order;  // ties: the earlier candidate first (deterministic)
    std::vector<int32_t> path;
    bool operator<(const Candidate& other) const {
      if (value != other.value) return value < other.value;
      return order > other.order;
    }
  };
  std::priority_queue<Candidate> candidates;
  uint64_t order = 0;
  for (int32_t r = 0; r < kRanks; ++r) candidates.push({accept[r], order++, {r}});
  std::vector<std::vector<int32_t>> paths;
  while (static_cast<int32_t>(paths.size()) < size && !candidates.empty()) {
    Candidate best = candidates.top();
    candidates.pop();
    if (static_cast<int32_t>(best.path.size()) < depth) {
      for (int32_t r = 0; r < kRanks; ++r) {
        std::vector<int32_t> child = best.path;
        child.push_back(r);
        candidates.push({best.value * accept[r], order++, std::move(child)});
      }
    }
    paths.push_back(std::move(best.path));
  }
  absl::StatusOr<StaticTree> tree = StaticTree::from_paths(paths);
  return *std::move(tree);  // the paths are valid by construction
}

}  // namespace deft::engine
