#include "engine/speculation/token_tree.h"

#include <algorithm>
#include <numeric>

namespace deft::engine {
namespace {

const StaticTree& static_tree(const SpeculativeOptions& options) {
  static const StaticTree fallback = default_static_tree(63, 6);
  return options.tree != nullptr ? *options.tree : fallback;
}

}  // namespace

void TokenTree::clear() {
  tokens_.clear();
  parents_.clear();
  depths_.clear();
  scores_.clear();
  static_of_.clear();
  expanded_.clear();
}

void TokenTree::reset(int32_t max_depth) {
  clear();
  max_depth_ = std::max(0, std::min(max_depth, options_->depth));
}

int32_t TokenTree::add(TokenId token, int32_t parent, float score, int32_t static_node) {
  tokens_.push_back(token);
  parents_.push_back(parent);
  depths_.push_back(parent < 0 ? 1 : depths_[static_cast<size_t>(parent)] + 1);
  scores_.push_back(score);
  static_of_.push_back(static_node);
  expanded_.push_back(0);
  return static_cast<int32_t>(tokens_.size()) - 1;
}

int32_t TokenTree::top_k() const {
  switch (options_->policy) {
    case TreePolicy::kStatic:
      return static_tree(*options_).top_k();
    case TreePolicy::kDynamic:
      return options_->top_k;
    case TreePolicy::kNgram:
      return 0;
  }
  return 0;
}

void TokenTree::expansions(int32_t level, std::vector<int32_t>* out) const {
  out->clear();
  if (max_depth_ <= 0 || options_->policy == TreePolicy::kNgram) return;
  if (level == 0) {
    if (tokens_.empty()) out->push_back(-1);
    return;
  }
  if (level >= max_depth_) return;  // entries of the last level are not expanded
  const auto n = static_cast<int32_t>(tokens_.size());
  if (options_->policy == TreePolicy::kStatic) {
    const StaticTree& tree = static_tree(*options_);
    for (int32_t e = 0; e < n; ++e) {
      if (depths_[static_cast<size_t>(e)] == level && expanded_[static_cast<size_t>(e)] == 0 &&
          !tree.children(static_of_[static_cast<size_t>(e)]).empty()) {
        out->push_back(e);
      }
    }
    return;
  }
  // kDynamic: the top_k entries of this level by path probability (ties: the earlier entry).
  for (int32_t e = 0; e < n; ++e) {
    if (depths_[static_cast<size_t>(e)] == level && expanded_[static_cast<size_t>(e)] == 0) {
      out->push_back(e);
    }
  }
  std::stable_sort(out->begin(), out->end(), [&](int32_t a, int32_t b) {
    return scores_[static_cast<size_t>(a)] > scores_[static_cast<size_t>(b)];
  });
  if (static_cast<int32_t>(out->size()) > options_->top_k) out->resize(options_->top_k);
  std::sort(out->begin(), out->end());
}

void TokenTree::expand(int32_t entry, std::span<const TokenLogprob> top) {
  if (entry >= 0) expanded_[static_cast<size_t>(entry)] = 1;
  const int32_t depth = entry < 0 ? 1 : depths_[static_cast<size_t>(entry)] + 1;
  if (depth > max_depth_) return;
  const float base = entry < 0 ? 0.0f : scores_[static_cast<size_t>(entry)];
  if (options_->policy == TreePolicy::kStatic) {
    const StaticTree& tree = static_tree(*options_);
    const int32_t node = entry < 0 ? -1 : static_of_[static_cast<size_t>(entry)];
    for (int32_t child : tree.children(node)) {
      // The first tree_tokens nodes of the static tree are a tree: later ones are left out.
      if (child >= options_->tree_tokens) continue;
      const auto rank = static_cast<size_t>(tree.nodes()[static_cast<size_t>(child)].rank);
      if (rank >= top.size()) continue;
      add(top[rank].token, entry, base + top[rank].logprob, child);
    }
    return;
  }
  if (options_->policy == TreePolicy::kDynamic) {
    const size_t k = std::min(top.size(), static_cast<size_t>(options_->top_k));
    for (size_t i = 0; i < k; ++i) add(top[i].token, entry, base + top[i].logprob, -1);
  }
}

void TokenTree::finish() {
  if (options_->policy != TreePolicy::kDynamic || size() <= options_->tree_tokens) return;
  // The tree_tokens most probable paths; a parent is at least as probable as its child and is
  // shallower, so the order puts it first and the kept entries form a tree.
  std::vector<int32_t> order(tokens_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const auto x = static_cast<size_t>(a);
    const auto y = static_cast<size_t>(b);
    if (scores_[x] != scores_[y]) return scores_[x] > scores_[y];
    return depths_[x] < depths_[y];
  });
  order.resize(static_cast<size_t>(options_->tree_tokens));
  std::sort(order.begin(), order.end());  // entry order: parents first
  std::vector<int32_t> new_index(tokens_.size(), -1);
  for (size_t i = 0; i < order.size(); ++i)
    new_index[static_cast<size_t>(order[i])] = static_cast<int32_t>(i);
  TokenTree kept(options_);
  kept.max_depth_ = max_depth_;
  for (int32_t e : order) {
    const auto old = static_cast<size_t>(e);
    const int32_t parent = parents_[old] < 0 ? -1 : new_index[static_cast<size_t>(parents_[old])];
    kept.add(tokens_[old], parent, scores_[old], -1);
  }
  *this = std::move(kept);
}

void TokenTree::add_path(std::span<const TokenId> tokens) {
  int32_t parent = -1;
  for (size_t d = 0; d < tokens.size() && static_cast<int32_t>(d) < max_depth_; ++d) {
    int32_t found = -1;
    for (int32_t e = 0; e < size(); ++e) {
      if (parents_[static_cast<size_t>(e)] == parent &&
          tokens_[static_cast<size_t>(e)] == tokens[d]) {
        found = e;
        break;
      }
    }
    if (found < 0) {
      if (size() >= options_->tree_tokens) return;
      found = add(tokens[d], parent, 0.0f, -1);
    }
    parent = found;
  }
}

void TokenTree::truncate(int32_t count) {
  if (count >= size()) return;
  const auto n = static_cast<size_t>(std::max(count, 0));
  tokens_.resize(n);
  parents_.resize(n);
  depths_.resize(n);
  scores_.resize(n);
  static_of_.resize(n);
  expanded_.resize(n);
}

void TokenTree::walk(std::span<const TokenId> row_tokens, std::vector<int32_t>* rows) const {
  int32_t current = -1;  // the entry whose row is being read (-1: the anchor)
  for (;;) {
    rows->push_back(current + 1);
    const TokenId drawn = row_tokens[static_cast<size_t>(current + 1)];
    int32_t next = -1;
    for (int32_t e = current + 1; e < size(); ++e) {  // children come after their parent
      if (parents_[static_cast<size_t>(e)] == current && tokens_[static_cast<size_t>(e)] == drawn) {
        next = e;
        break;
      }
    }
    if (next < 0) return;
    current = next;
  }
}

}  // namespace deft::engine
