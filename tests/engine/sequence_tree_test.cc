#include "engine/sequence_tree.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <set>

#include "absl/numeric/int128.h"

namespace deft::engine {
namespace {

std::vector<TokenId> tokens(int n, TokenId first = 1) {
  std::vector<TokenId> out(n);
  for (int i = 0; i < n; ++i) out[i] = first + i;
  return out;
}

TEST(SequenceTree, AppendBranchDepthAndPath) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  SequenceTree tree(3, &kv);
  ASSERT_TRUE(tree.append(tree.root(), tokens(10)).ok());
  auto children = tree.branch(tree.root(), 3);
  ASSERT_TRUE(children.ok());
  ASSERT_EQ(children->size(), 3u);
  const NodeId b = (*children)[1];
  ASSERT_TRUE(tree.append(b, tokens(5)).ok());
  EXPECT_EQ(tree.node(b).depth_begin, 10);
  EXPECT_EQ(tree.depth(b, 4), 14);
  auto grand = tree.branch(b, 2);
  ASSERT_TRUE(grand.ok());
  EXPECT_EQ(tree.node((*grand)[0]).depth_begin, 15);
  auto path = tree.path((*grand)[1]);
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(*path, (std::vector<NodeId>{0, b, (*grand)[1]}));
  EXPECT_EQ(tree.live_leaves(),
            (std::vector<NodeId>{(*children)[0], (*grand)[0], (*grand)[1], (*children)[2]}));
  EXPECT_EQ(tree.total_tokens(), 15);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

TEST(SequenceTree, MisuseIsAnErrorNotUndefinedBehaviour) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 8});
  SequenceTree tree(0, &kv);
  ASSERT_TRUE(tree.append(tree.root(), tokens(3)).ok());
  auto children = tree.branch(tree.root(), 2);
  ASSERT_TRUE(children.ok());
  EXPECT_EQ(tree.append(tree.root(), tokens(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(tree.append(99, tokens(1)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tree.append(-1, tokens(1)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tree.prune(tree.root()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(tree.branch(42, 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tree.branch(tree.root(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tree.path(77).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(tree.prune((*children)[0]).ok());
  EXPECT_EQ(tree.prune((*children)[0]).code(), absl::StatusCode::kNotFound);  // stale id
  EXPECT_EQ(tree.append((*children)[0], tokens(1)).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tree.check_invariants());
}

// add_child = branch(node, 1) + append in one step: same depth, tokens, KV pages and ids; its
// errors change nothing.
TEST(SequenceTree, AddChildIsBranchThenAppend) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 6});
  SequenceTree tree(0, &kv, /*max_node_ids=*/4);
  ASSERT_TRUE(tree.append(tree.root(), tokens(6)).ok());
  const NodeId a = tree.add_child(tree.root(), tokens(5, 10)).value();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(tree.node(a).parent, tree.root());
  EXPECT_EQ(tree.node(a).depth_begin, 6);
  EXPECT_EQ(tree.node(a).tokens.size(), 5u);
  EXPECT_EQ(tree.node(a).tokens[0], 10);
  EXPECT_EQ(kv.pages(tree.kv_key(a)).size(), 2u);
  EXPECT_EQ(tree.depth(a, 4), 10);
  const NodeId b = tree.add_child(a, {}).value();  // empty: no pages yet
  EXPECT_EQ(kv.pages(tree.kv_key(b)).size(), 0u);
  ASSERT_TRUE(tree.append(b, tokens(2)).ok());
  EXPECT_EQ(tree.total_tokens(), 13);
  EXPECT_EQ(tree.num_live_nodes(), 3);
  // Errors: an unknown node, KV short (2 pages free, 9 tokens need 3), ids used up.
  EXPECT_EQ(tree.add_child(99, tokens(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tree.add_child(b, tokens(9)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tree.num_live_nodes(), 3);
  EXPECT_EQ(tree.total_tokens(), 13);
  EXPECT_EQ(kv.free_pages(), 1);
  EXPECT_EQ(tree.add_child(b, tokens(1)).value(), 3);  // the id the failed call did not take
  EXPECT_EQ(tree.add_child(b, tokens(1)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

TEST(SequenceTree, KvExhaustionLeavesTreeUnchanged) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 2});
  SequenceTree tree(0, &kv);
  ASSERT_TRUE(tree.append(tree.root(), tokens(6)).ok());
  EXPECT_EQ(tree.append(tree.root(), tokens(3)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tree.node(tree.root()).tokens.size(), 6u);
  EXPECT_EQ(tree.total_tokens(), 6);
  EXPECT_TRUE(tree.check_invariants());
}

TEST(SequenceTree, PruneFreesTheWholeSubtreeAtOnce) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  SequenceTree tree(1, &kv);
  ASSERT_TRUE(tree.append(tree.root(), tokens(8)).ok());
  auto a = tree.branch(tree.root(), 2).value();
  ASSERT_TRUE(tree.append(a[0], tokens(9)).ok());
  auto b = tree.branch(a[0], 3).value();
  for (NodeId n : b) ASSERT_TRUE(tree.append(n, tokens(5)).ok());
  const int used = kv.used_pages();
  ASSERT_TRUE(tree.prune(a[0]).ok());
  EXPECT_EQ(kv.used_pages(), used - 3 - 3 * 2);
  EXPECT_EQ(tree.num_live_nodes(), 2);
  // The parent is a leaf again once its last child goes, and can grow.
  ASSERT_TRUE(tree.prune(a[1]).ok());
  EXPECT_TRUE(tree.append(tree.root(), tokens(2)).ok());
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

// A speculative session: every step hangs a 64-node token tree under the prefix and prunes it.
// Pruned nodes leave the tree (their ids stay dead: never handed out again), the KV pool and
// the owner table return to the prefix alone, and the ids keep growing.
TEST(SequenceTree, PrunedIdsAreNeverReusedAcrossManySteps) {
  KvCacheManager kv({.page_tokens = 16, .num_pages = 128});
  SequenceTree tree(3, &kv);
  ASSERT_TRUE(tree.append(tree.root(), tokens(100)).ok());
  const int used = kv.used_pages();
  std::set<NodeId> seen = {tree.root()};
  for (int step = 0; step < 200; ++step) {
    NodeId parent = tree.root();
    NodeId first = -1;
    for (int i = 0; i < 64; ++i) {
      const NodeId child = tree.branch(i % 8 == 0 ? tree.root() : parent, 1).value()[0];
      ASSERT_TRUE(seen.insert(child).second) << "id " << child << " handed out twice";
      ASSERT_TRUE(tree.append(child, tokens(1)).ok());
      if (first < 0) first = child;
      parent = child;
    }
    ASSERT_EQ(tree.num_live_nodes(), 65);
    for (NodeId child : NodeChildren(tree.node(tree.root()).children)) {
      ASSERT_TRUE(tree.prune(child).ok());
    }
    ASSERT_FALSE(tree.contains(first));
    ASSERT_EQ(tree.prune(first).code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(tree.num_live_nodes(), 1);
  EXPECT_EQ(tree.node_id_limit(), 1 + 200 * 64);
  EXPECT_EQ(kv.used_pages(), used);
  EXPECT_EQ(kv.num_owners(), 1u);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

TEST(SequenceTree, RunningOutOfIdsIsAnErrorThatChangesNothing) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 16});
  SequenceTree tree(2, &kv, /*max_node_ids=*/6);
  ASSERT_TRUE(tree.append(tree.root(), tokens(8)).ok());
  const std::vector<NodeId> children = tree.branch(tree.root(), 4).value();  // ids 1-4
  EXPECT_EQ(tree.branch(tree.root(), 2).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tree.num_live_nodes(), 5);
  ASSERT_TRUE(tree.append(children[0], tokens(8)).ok());
  ASSERT_TRUE(tree.split(children[0], 4).ok());  // id 5, the last one
  EXPECT_EQ(tree.split(children[0], 2).status().code(), absl::StatusCode::kResourceExhausted);
  // Pruning frees nodes, not ids.
  for (NodeId child : children) ASSERT_TRUE(tree.prune(child).ok());
  EXPECT_EQ(tree.branch(tree.root(), 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tree.node_id_limit(), 6);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

// A long-running server's ids pass 2^31 and 2^32 (ids are never reused); a tree that starts
// there shows every operation keeps them whole, as ids and as KV owner keys. The ids cross
// 2^32 + 2^31, where a cut to 32 bits would turn them negative.
TEST(SequenceTree, IdsPast32BitsWorkThroughBranchSplitAndPrune) {
  constexpr NodeId kFirst = (NodeId{1} << 32) + (NodeId{1} << 31) - 2;
  KvCacheManager kv({.page_tokens = 4, .num_pages = 16});
  SequenceTree tree(3, &kv, std::numeric_limits<NodeId>::max(), /*first_node_id=*/kFirst);
  ASSERT_TRUE(tree.append(tree.root(), tokens(8)).ok());
  const std::vector<NodeId> children = tree.branch(tree.root(), 4).value();
  EXPECT_EQ(children, (std::vector<NodeId>{kFirst, kFirst + 1, kFirst + 2, kFirst + 3}));
  for (NodeId child : children) ASSERT_TRUE(tree.append(child, tokens(8, 100)).ok());

  const NodeId head = tree.split(children[2], 4).value();
  EXPECT_EQ(head, kFirst + 4);
  EXPECT_EQ(tree.node(children[2]).parent, head);
  EXPECT_EQ(tree.path(children[2]).value(), (std::vector<NodeId>{tree.root(), head, children[2]}));
  EXPECT_EQ(tree.depth(children[2], 0), 12);
  EXPECT_EQ(absl::Uint128Low64(tree.kv_key(head)), static_cast<uint64_t>(head));
  EXPECT_EQ(absl::Uint128High64(tree.kv_key(head)), 3u);
  EXPECT_EQ(kv.pages(tree.kv_key(head)).size(), 1u);
  EXPECT_EQ(kv.pages(tree.kv_key(children[2])).size(), 1u);
  EXPECT_TRUE(tree.check_invariants());

  ASSERT_TRUE(tree.prune(children[0]).ok());
  ASSERT_TRUE(tree.prune(head).ok());  // and children[2] below it
  EXPECT_FALSE(tree.contains(children[2]));
  EXPECT_EQ(tree.prune(children[2]).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tree.live_leaves(), (std::vector<NodeId>{children[1], children[3]}));
  EXPECT_EQ(tree.branch(children[1], 1).value(), std::vector<NodeId>{kFirst + 5});
  EXPECT_EQ(tree.node_id_limit(), kFirst + 6);
  EXPECT_EQ(kv.used_pages(), 2 + 2 * 2);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

TEST(SequenceTree, DestructorReturnsEveryPage) {
  KvCacheManager kv({.page_tokens = 16, .num_pages = 32});
  {
    SequenceTree tree(5, &kv);
    ASSERT_TRUE(tree.append(tree.root(), tokens(40)).ok());
    const std::vector<NodeId> children = tree.branch(tree.root(), 4).value();
    for (NodeId n : children) ASSERT_TRUE(tree.append(n, tokens(20)).ok());
    EXPECT_GT(kv.used_pages(), 0);
  }
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_EQ(kv.num_owners(), 0u);
}

// Long random sequences of append / branch / prune over several trees sharing one pool.
TEST(SequenceTree, RandomOperationsNeverLeakOrShareSlots) {
  const uint32_t seed = 7;
  std::mt19937 rng(seed);
  KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  std::vector<std::unique_ptr<SequenceTree>> trees;
  for (uint32_t t = 0; t < 4; ++t) trees.push_back(std::make_unique<SequenceTree>(t, &kv));
  for (int step = 0; step < 6000; ++step) {
    SequenceTree& tree = *trees[rng() % trees.size()];
    std::vector<NodeId> nodes = tree.dfs_order();
    const NodeId node = nodes[rng() % nodes.size()];
    const int free_before = kv.free_pages();
    const int64_t tokens_before = tree.total_tokens();
    switch (rng() % 4) {
      case 0:
      case 1: {
        absl::Status status = tree.append(node, tokens(1 + rng() % 40));
        if (!status.ok()) {
          ASSERT_EQ(kv.free_pages(), free_before) << "seed " << seed;
          ASSERT_EQ(tree.total_tokens(), tokens_before) << "seed " << seed;
        }
        break;
      }
      case 2:
        if (rng() % 2 == 0) {
          (void)tree.branch(node, 1 + rng() % 4);
        } else {
          absl::StatusOr<NodeId> child = tree.add_child(node, tokens(rng() % 20));
          if (!child.ok()) {
            ASSERT_EQ(kv.free_pages(), free_before) << "seed " << seed;
            ASSERT_EQ(tree.total_tokens(), tokens_before) << "seed " << seed;
          }
        }
        break;
      case 3:
        (void)tree.prune(node);
        break;
    }
    if (step % 50 == 0) {
      ASSERT_TRUE(kv.check_invariants()) << "seed " << seed << " step " << step;
      std::set<int32_t> slots;
      for (const auto& t : trees) {
        ASSERT_TRUE(t->check_invariants()) << "seed " << seed << " step " << step;
        for (NodeId n : t->dfs_order()) {
          for (size_t i = 0; i < t->node(n).tokens.size(); ++i) {
            ASSERT_TRUE(slots.insert(kv.slot(t->kv_key(n), static_cast<int64_t>(i))).second)
                << "slot shared, seed " << seed << " step " << step;
          }
        }
      }
    }
  }
  trees.clear();
  EXPECT_EQ(kv.used_pages(), 0);
}

}  // namespace
}  // namespace deft::engine
