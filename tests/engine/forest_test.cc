// Forest: prefix placement with page-aligned splits, holds and collection, and the
// SequenceTree split/truncate it relies on, with the KV accounting checked throughout.
#include "engine/forest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

namespace deft::engine {
namespace {

std::vector<TokenId> iota_tokens(int n, TokenId first) {
  std::vector<TokenId> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

TEST(SequenceTreeSplitTest, HeadTakesTheFrontPagesAndTheTailKeepsItsId) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 16});
  SequenceTree tree(0, &kv);
  const NodeId node = tree.branch(tree.root(), 1)->front();
  ASSERT_TRUE(tree.append(node, iota_tokens(10, 100)).ok());
  const int32_t slot_8 = kv.slot(tree.kv_key(node), 8);
  absl::StatusOr<NodeId> head = tree.split(node, 8);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_THAT(tree.node(*head).tokens, testing::ElementsAreArray(iota_tokens(8, 100)));
  EXPECT_THAT(tree.node(node).tokens, testing::ElementsAreArray(iota_tokens(2, 108)));
  EXPECT_EQ(tree.node(node).parent, *head);
  EXPECT_EQ(tree.node(node).depth_begin, 8);
  EXPECT_EQ(kv.slot(tree.kv_key(node), 0), slot_8);  // no KV moved
  EXPECT_EQ(kv.used_pages(), 3);
  EXPECT_TRUE(tree.check_invariants());
  EXPECT_FALSE(tree.split(node, 1).ok());   // not a page boundary
  EXPECT_FALSE(tree.split(tree.root(), 4).ok());
  ASSERT_TRUE(tree.truncate(node, 1).ok());
  EXPECT_EQ(tree.node(node).tokens.size(), 1u);
  EXPECT_FALSE(tree.truncate(*head, 2).ok());  // inner node
  EXPECT_TRUE(tree.check_invariants());
}

TEST(ForestTest, PromptsShareWholePagesOfALivePrefix) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  Forest forest(&kv);
  const std::vector<TokenId> first = iota_tokens(22, 10);
  const PromptPlacement a = forest.place_prompt(first);
  EXPECT_EQ(a.shared, 0);
  ASSERT_TRUE(forest.tree().append(a.node, first).ok());

  // Shares 13 tokens: the last page boundary is 12; `a` keeps its id and its holder's view.
  std::vector<TokenId> second = iota_tokens(13, 10);
  second.push_back(999);
  second.push_back(998);
  const PromptPlacement b = forest.place_prompt(second);
  EXPECT_EQ(b.shared, 12);
  EXPECT_EQ(forest.tree().node(b.node).depth_begin, 12);
  const absl::StatusOr<std::vector<NodeId>> path_a = forest.tree().path(a.node);
  const absl::StatusOr<std::vector<NodeId>> path_b = forest.tree().path(b.node);
  ASSERT_TRUE(path_a.ok() && path_b.ok());
  EXPECT_EQ((*path_a)[1], (*path_b)[1]);  // the shared head
  int64_t a_tokens = 0;
  for (NodeId id : *path_a) a_tokens += static_cast<int64_t>(forest.tree().node(id).tokens.size());
  EXPECT_EQ(a_tokens, 22);

  // The same prompt again shares all but its last token's page.
  const PromptPlacement c = forest.place_prompt(first);
  EXPECT_EQ(c.shared, 20);

  // A prompt equal to a held leaf's tokens never hangs below that leaf.
  EXPECT_TRUE(forest.tree().node(a.node).children.empty());

  // Releasing everything frees every page.
  forest.release(c.node);
  forest.release(b.node);
  EXPECT_GT(kv.used_pages(), 0);
  forest.release(a.node);
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_EQ(forest.tree().num_live_nodes(), 1);
  EXPECT_TRUE(forest.tree().check_invariants());
  EXPECT_TRUE(kv.check_invariants());
}

// The forest a server would have after days: ids past 2^32. Placement (with its split), holds
// and collection work as with small ids; a start beyond 2^62 is refused (ids must never run out).
TEST(ForestTest, IdsPast32BitsPlaceHoldAndRelease) {
  constexpr NodeId kFirst = (NodeId{1} << 32) + 11;
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  Forest forest(&kv, kFirst);
  const std::vector<TokenId> prompt = iota_tokens(10, 10);
  const PromptPlacement a = forest.place_prompt(prompt);
  EXPECT_EQ(a.node, kFirst);
  ASSERT_TRUE(forest.tree().append(a.node, prompt).ok());
  const PromptPlacement b = forest.place_prompt(prompt);  // splits `a` after 8 tokens
  EXPECT_EQ(b.shared, 8);
  EXPECT_EQ(forest.tree().node(a.node).parent, kFirst + 1);
  EXPECT_EQ(b.node, kFirst + 2);
  EXPECT_EQ(forest.holds(b.node), 1);
  forest.release(a.node);
  EXPECT_TRUE(forest.tree().contains(kFirst + 1));  // b still hangs below the head
  forest.release(b.node);
  EXPECT_EQ(forest.tree().num_live_nodes(), 1);
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_TRUE(forest.tree().check_invariants());
  EXPECT_DEATH({ Forest refused(&kv, kMaxFirstNodeId + 1); }, "first node id");
}

TEST(ForestTest, RandomPromptsHoldsAndReleasesKeepTheKvConsistent) {
  std::mt19937 random(7);
  KvCacheManager kv({.page_tokens = 4, .num_pages = 4096});
  Forest forest(&kv);
  std::vector<NodeId> held;
  std::vector<std::vector<TokenId>> prompts;
  for (int round = 0; round < 400; ++round) {
    if (!held.empty() && random() % 3 == 0) {
      const size_t pick = random() % held.size();
      forest.release(held[pick]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(pick));
    } else {
      // Prompts from a small alphabet so that prefixes collide often.
      std::vector<TokenId> prompt;
      if (!prompts.empty() && random() % 2 == 0) {
        const std::vector<TokenId>& base = prompts[random() % prompts.size()];
        prompt.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(
                                                       random() % base.size() + 1));
      }
      const int extra = static_cast<int>(random() % 12) + (prompt.empty() ? 1 : 0);
      for (int i = 0; i < extra; ++i) prompt.push_back(static_cast<TokenId>(random() % 3));
      const PromptPlacement placed = forest.place_prompt(prompt);
      ASSERT_GE(placed.shared, 0);
      ASSERT_LT(placed.shared, static_cast<int64_t>(prompt.size()));
      ASSERT_EQ(placed.shared % 4, 0);
      // The shared path holds exactly the prompt's first `shared` tokens.
      std::vector<TokenId> path_tokens;
      const absl::StatusOr<std::vector<NodeId>> path = forest.tree().path(placed.node);
      ASSERT_TRUE(path.ok());
      for (NodeId id : *path) {
        const auto& tokens = forest.tree().node(id).tokens;
        path_tokens.insert(path_tokens.end(), tokens.begin(), tokens.end());
      }
      ASSERT_EQ(path_tokens, std::vector<TokenId>(prompt.begin(),
                                                  prompt.begin() + placed.shared));
      ASSERT_TRUE(forest.tree()
                      .append(placed.node, std::span(prompt).subspan(
                                               static_cast<size_t>(placed.shared)))
                      .ok());
      held.push_back(placed.node);
      prompts.push_back(prompt);
    }
    ASSERT_TRUE(forest.tree().check_invariants()) << "round " << round;
  }
  for (NodeId node : held) forest.release(node);
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_TRUE(kv.check_invariants());
}

}  // namespace
}  // namespace deft::engine
