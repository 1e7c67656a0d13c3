// Test support (header only): seeded random decoding steps over random trees, for property tests
// of the planner and of every attention kernel that executes its plans (CPU and GPU).
//
// A step is one or more SequenceTrees over one scrambled KV pool, with the queries of one kind:
//   decode      one new token per live leaf;
//   extend      a run of new tokens of one node (a prefill when the tree is a bare root);
//   token tree  a token tree of single-token nodes hung under a node (speculative verification);
//   multi-tree  2..max_trees_per_step trees, each with one of the kinds above.
// RandomStep::context() is the ground truth every plan must cover: per query row, the KV slots
// of its node's proper ancestors and of its own node up to itself.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "tests/testing/naive_tree_attention.h"

#ifndef DEFT_ASSERT_OK
#define DEFT_ASSERT_OK(expr)              \
  do {                                    \
    const absl::Status status_ = (expr);  \
    ASSERT_TRUE(status_.ok()) << status_; \
  } while (false)
#endif

namespace deft::test {

enum class QueryKind { kDecode, kExtend, kTokenTree, kMultiTree };

inline std::string query_kind_name(QueryKind kind) {
  switch (kind) {
    case QueryKind::kDecode:
      return "decode";
    case QueryKind::kExtend:
      return "extend";
    case QueryKind::kTokenTree:
      return "token_tree";
    case QueryKind::kMultiTree:
      return "multi_tree";
  }
  return "unknown";
}

struct RandomStepLimits {
  int32_t page_tokens = 16;
  int32_t max_width = 64;  // live leaves a random tree aims at, at most
  int32_t max_depth = 12;  // node levels of a random tree, at most
  int32_t max_node_tokens = 2000;
  // Tokens per tree beyond which new nodes get short (1..8 tokens): bounds the test's cost.
  int64_t tree_token_budget = 12000;
  int32_t max_extend_tokens = 200;  // a bare-root prefill takes up to max_node_tokens / 4
  int32_t max_token_tree_tokens = 64;
  int32_t max_trees_per_step = 4;

  // A pool that always suffices. Per tree: nodes made before the budget runs out hold at most
  // tree_token_budget + max_node_tokens tokens; every node (at most max_width per level, plus a
  // token tree's) holds at most one partial page; decoding may open a page per leaf; an extend
  // run or prefill needs a few more.
  int32_t num_pages() const {
    const int64_t nodes = int64_t{max_width} * max_depth + max_token_tree_tokens;
    const int64_t run = std::max<int64_t>(max_extend_tokens, max_node_tokens / 4);
    const int64_t per_tree = (tree_token_budget + max_node_tokens) / page_tokens + nodes +
                             max_width + run / page_tokens + 1;
    return static_cast<int32_t>(per_tree * max_trees_per_step);
  }
};

// One step's input: trees over one KV pool and each tree's queries.
struct RandomStep {
  std::unique_ptr<engine::KvCacheManager> kv;
  std::vector<std::unique_ptr<engine::SequenceTree>> trees;  // destroyed before kv
  std::vector<std::vector<engine::QueryToken>> queries;      // per tree

  std::vector<engine::TreeQueries> input() const {
    std::vector<engine::TreeQueries> result;
    for (size_t t = 0; t < trees.size(); ++t) result.push_back({trees[t].get(), queries[t]});
    return result;
  }

  int64_t num_queries() const {
    int64_t total = 0;
    for (const auto& tree_queries : queries) total += static_cast<int64_t>(tree_queries.size());
    return total;
  }

  int64_t max_queries_per_tree() const {
    size_t most = 0;
    for (const auto& tree_queries : queries) most = std::max(most, tree_queries.size());
    return static_cast<int64_t>(most);
  }

  // Per query row, in plan row order (trees in order, then each tree's queries in order): the
  // slots of its context, root first.
  std::vector<std::vector<int32_t>> context() const {
    std::vector<std::vector<int32_t>> result;
    for (size_t t = 0; t < trees.size(); ++t) {
      const engine::SequenceTree& tree = *trees[t];
      for (const engine::QueryToken& query : queries[t]) {
        std::vector<int32_t>& slots = result.emplace_back();
        const std::vector<engine::NodeId> path = tree.path(query.node).value();
        for (engine::NodeId node : path) {
          const int64_t visible = node == query.node
                                      ? int64_t{query.token_index} + 1
                                      : static_cast<int64_t>(tree.node(node).tokens.size());
          for (int64_t i = 0; i < visible; ++i) slots.push_back(kv->slot(tree.kv_key(node), i));
        }
      }
    }
    return result;
  }

  // "tree 2 node 7 token 3" for a slot, for failure messages.
  std::string describe_slot(int32_t slot) const {
    for (const auto& tree : trees) {
      for (engine::NodeId node : tree->dfs_order()) {
        for (size_t i = 0; i < tree->node(node).tokens.size(); ++i) {
          if (kv->slot(tree->kv_key(node), static_cast<int64_t>(i)) == slot) {
            std::ostringstream out;
            out << "tree " << tree->tree_id() << " node " << node << " token " << i;
            return out.str();
          }
        }
      }
    }
    return "a slot no live token owns";
  }
};

namespace random_tree_internal {

inline std::vector<engine::TokenId> random_tokens(TestRng& rng, int64_t count) {
  std::vector<engine::TokenId> tokens(count);
  for (engine::TokenId& token : tokens) {
    token = static_cast<engine::TokenId>(rng.uniform_int(0, 31999));
  }
  return tokens;
}

template <typename T>
void shuffle(std::vector<T>& values, TestRng& rng) {
  for (int64_t i = static_cast<int64_t>(values.size()) - 1; i > 0; --i) {
    std::swap(values[i], values[rng.uniform_int(0, i)]);
  }
}

// A fresh pool hands out pages in ascending order; scramble its free list so that a tree's
// slots are scattered as they are after a while of serving.
inline void scramble_free_pages(engine::KvCacheManager& kv, TestRng& rng) {
  const int32_t num_pages = kv.num_pages();
  for (int32_t page = 0; page < num_pages; ++page) {
    DEFT_ASSERT_OK(kv.reserve(~uint64_t{0} - page, 1));
  }
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  shuffle(order, rng);
  for (int32_t page : order) kv.release(~uint64_t{0} - page);
}

inline int64_t node_tokens(const RandomStepLimits& limits, TestRng& rng,
                           const engine::SequenceTree& tree) {
  if (rng.bernoulli(0.04)) return 0;  // an empty node now and then (e.g. a fresh branch)
  if (tree.total_tokens() >= limits.tree_token_budget) return rng.uniform_int(1, 8);
  return rng.log_uniform_int(1, limits.max_node_tokens);
}

template <typename T>
const T& pick(const std::vector<T>& values, TestRng& rng) {
  return values[rng.uniform_int(0, static_cast<int64_t>(values.size()) - 1)];
}

}  // namespace random_tree_internal

// A random tree of up to max_width leaves and max_depth node levels; leaves end at different
// depths, some nodes are empty, and now and then a subtree is pruned.
inline void grow_random_tree(const RandomStepLimits& limits, TestRng& rng,
                             engine::SequenceTree& tree) {
  using namespace random_tree_internal;
  // Half the trees narrow (log-uniform width), half anywhere up to max_width.
  const auto width =
      static_cast<int32_t>(rng.bernoulli(0.5) ? rng.uniform_int(1, limits.max_width)
                                              : rng.log_uniform_int(1, limits.max_width));
  const auto depth = static_cast<int32_t>(rng.uniform_int(1, limits.max_depth));
  DEFT_ASSERT_OK(tree.append(tree.root(), random_tokens(rng, node_tokens(limits, rng, tree))));
  std::vector<engine::NodeId> frontier = {tree.root()};
  int32_t leaves = 1;
  for (int32_t level = 1; level < depth && !frontier.empty(); ++level) {
    std::vector<engine::NodeId> next;
    for (engine::NodeId node : frontier) {
      if (level > 1 && rng.bernoulli(0.15)) continue;  // this branch stops here
      // The root may fan out wide at once (few-shot: one prompt, many samples); deeper nodes
      // branch a few ways at a time.
      const int32_t most = std::min(level == 1 ? limits.max_width : 4, width - leaves + 1);
      const auto fanout = static_cast<int32_t>(rng.uniform_int(1, std::max(1, most)));
      const absl::StatusOr<std::vector<engine::NodeId>> children = tree.branch(node, fanout);
      ASSERT_TRUE(children.ok()) << children.status();
      leaves += fanout - 1;
      for (engine::NodeId child : *children) {
        DEFT_ASSERT_OK(tree.append(child, random_tokens(rng, node_tokens(limits, rng, tree))));
        next.push_back(child);
      }
    }
    frontier = std::move(next);
  }
  if (tree.num_live_nodes() > 2 && rng.bernoulli(0.3)) {
    const std::vector<engine::NodeId> nodes = tree.dfs_order();
    DEFT_ASSERT_OK(tree.prune(nodes[rng.uniform_int(1, static_cast<int64_t>(nodes.size()) - 1)]));
  }
  ASSERT_TRUE(tree.check_invariants());
}

// Adds one tree with queries of `kind` (not kMultiTree) to `step`.
inline void add_random_tree(QueryKind kind, const RandomStepLimits& limits, TestRng& rng,
                            RandomStep& step) {
  using namespace random_tree_internal;
  const auto tree_id = static_cast<uint32_t>(step.trees.size() + 1);
  // Every other tree numbers its nodes past 2^32 + 2^31, as a long-running server's forest does
  // (ids are never reused): an id cut to 32 bits anywhere shows up as a wrong or unknown node.
  const engine::NodeId first_node_id =
      tree_id % 2 == 1 ? (engine::NodeId{1} << 32) + (engine::NodeId{1} << 31) : 1;
  step.trees.push_back(std::make_unique<engine::SequenceTree>(
      tree_id, step.kv.get(), std::numeric_limits<engine::NodeId>::max(), first_node_id));
  engine::SequenceTree& tree = *step.trees.back();
  std::vector<engine::QueryToken>& queries = step.queries.emplace_back();
  const bool bare_prefill = kind == QueryKind::kExtend && rng.bernoulli(0.25);
  if (!bare_prefill) {
    ASSERT_NO_FATAL_FAILURE(grow_random_tree(limits, rng, tree));
  }
  const std::vector<engine::NodeId> leaves = tree.live_leaves();

  switch (kind) {
    case QueryKind::kDecode:
      for (engine::NodeId leaf : leaves) {
        DEFT_ASSERT_OK(tree.append(leaf, random_tokens(rng, 1)));
        queries.push_back({leaf, static_cast<int32_t>(tree.node(leaf).tokens.size()) - 1});
      }
      break;
    case QueryKind::kExtend: {
      const engine::NodeId node = pick(leaves, rng);
      const auto old_size = static_cast<int32_t>(tree.node(node).tokens.size());
      const int64_t run = bare_prefill ? rng.log_uniform_int(1, limits.max_node_tokens / 4)
                                       : rng.log_uniform_int(1, limits.max_extend_tokens);
      DEFT_ASSERT_OK(tree.append(node, random_tokens(rng, run)));
      for (int32_t i = 0; i < run; ++i) queries.push_back({node, old_size + i});
      break;
    }
    case QueryKind::kTokenTree: {
      // Hung under a leaf (the usual case: the accepted path's end) or now and then under an
      // inner node; each token's parent is the anchor or an earlier token of the token tree.
      const engine::NodeId anchor =
          rng.bernoulli(0.8) ? pick(leaves, rng) : pick(tree.dfs_order(), rng);
      const int64_t count = rng.log_uniform_int(1, limits.max_token_tree_tokens);
      std::vector<engine::NodeId> token_nodes;
      for (int64_t i = 0; i < count; ++i) {
        const engine::NodeId parent =
            i == 0 || rng.bernoulli(0.2) ? anchor : token_nodes[rng.uniform_int(0, i - 1)];
        const absl::StatusOr<std::vector<engine::NodeId>> child = tree.branch(parent, 1);
        ASSERT_TRUE(child.ok()) << child.status();
        DEFT_ASSERT_OK(tree.append(child->front(), random_tokens(rng, 1)));
        token_nodes.push_back(child->front());
        queries.push_back({child->front(), 0});
      }
      break;
    }
    case QueryKind::kMultiTree:
      FAIL() << "multi_tree is a step of several trees, not a tree";
  }
  // Rows need not come in depth-first order.
  if (rng.bernoulli(0.5)) shuffle(queries, rng);
  ASSERT_TRUE(tree.check_invariants());
}

// A fresh step of `kind` into `step` (which must be empty).
inline void make_random_step(QueryKind kind, const RandomStepLimits& limits, TestRng& rng,
                             RandomStep& step) {
  step.kv = std::make_unique<engine::KvCacheManager>(
      engine::KvCacheConfig{.page_tokens = limits.page_tokens, .num_pages = limits.num_pages()});
  ASSERT_NO_FATAL_FAILURE(random_tree_internal::scramble_free_pages(*step.kv, rng));
  if (kind != QueryKind::kMultiTree) {
    ASSERT_NO_FATAL_FAILURE(add_random_tree(kind, limits, rng, step));
    return;
  }
  const int64_t num_trees = rng.uniform_int(2, limits.max_trees_per_step);
  for (int64_t t = 0; t < num_trees; ++t) {
    const auto tree_kind = static_cast<QueryKind>(rng.uniform_int(0, 2));
    ASSERT_NO_FATAL_FAILURE(add_random_tree(tree_kind, limits, rng, step));
  }
}

}  // namespace deft::test
