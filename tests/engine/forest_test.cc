// Forest: prefix placement with page-aligned splits, holds and collection, and the
// SequenceTree split/truncate it relies on, with the KV accounting checked throughout; the
// prefix cache (released nodes kept as cached KV, LRU eviction for room or the cap, discard).
#include "engine/forest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

namespace deft::engine {
namespace {

// Live prefix reuse alone: a released node is freed at once, as without a prefix cache.
constexpr PrefixCacheOptions kNoCache{.max_pages = 0};

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
  Forest forest(&kv, 1, kNoCache);
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
  Forest forest(&kv, kFirst, kNoCache);
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
  Forest forest(&kv, 1, kNoCache);
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
    ASSERT_TRUE(forest.check_invariants().ok()) << "round " << round;
  }
  for (NodeId node : held) forest.release(node);
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_TRUE(kv.check_invariants());
}

// The tokens of a node's path, root first.
std::vector<TokenId> path_tokens(const Forest& forest, NodeId node) {
  std::vector<TokenId> tokens;
  const std::vector<NodeId> path = *forest.tree().path(node);
  for (NodeId id : path) {
    const NodeTokens& own = forest.tree().node(id).tokens;
    tokens.insert(tokens.end(), own.begin(), own.end());
  }
  return tokens;
}

// The KV pages of a node's path, root first (splits move pages between nodes of the path but
// never change this list; appends only add to its end).
std::vector<int32_t> path_pages(const Forest& forest, NodeId node) {
  std::vector<int32_t> pages;
  const std::vector<NodeId> path = *forest.tree().path(node);
  for (NodeId id : path) {
    const std::span<const int32_t> own = forest.tree().kv()->pages(forest.tree().kv_key(id));
    pages.insert(pages.end(), own.begin(), own.end());
  }
  return pages;
}

// Places a prompt and appends its unshared tokens, as a work would.
PromptPlacement place_and_fill(Forest& forest, const std::vector<TokenId>& prompt) {
  const PromptPlacement placed = forest.place_prompt(prompt);
  EXPECT_TRUE(
      forest.append(placed.node, std::span(prompt).subspan(static_cast<size_t>(placed.shared)))
          .ok());
  return placed;
}

TEST(PrefixCacheTest, AReleasedPromptStaysCachedAndIsReused) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  Forest forest(&kv);
  const std::vector<TokenId> prompt = iota_tokens(22, 10);
  const PromptPlacement first = place_and_fill(forest, prompt);
  EXPECT_EQ(first.shared, 0);
  forest.release(first.node);
  EXPECT_EQ(kv.used_pages(), 6);
  EXPECT_EQ(forest.cached_pages(), 6);
  EXPECT_EQ(forest.referenced_pages(), 0);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();

  // The same prompt: every whole page but the one of its last token comes from the cache.
  const PromptPlacement again = place_and_fill(forest, prompt);
  EXPECT_EQ(again.shared, 20);
  EXPECT_EQ(again.cached, 20);
  EXPECT_EQ(path_tokens(forest, again.node), prompt);
  EXPECT_EQ(forest.cache_stats().hit_tokens, 20);
  EXPECT_EQ(kv.used_pages(), 7) << "5 shared pages, the cached tail's page, the new node's page";
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();

  // Reuse ends on a page boundary. A longer prompt goes on below the head `again` references,
  // but not into the cached 2-token tail: it ends inside a page, and the prompt's node would
  // start on a fresh page after it (one page more than the prompt's own, which admission
  // counted).
  std::vector<TokenId> longer = prompt;
  longer.insert(longer.end(), {1, 2, 3, 4, 5});
  const PromptPlacement below = place_and_fill(forest, longer);
  EXPECT_EQ(below.shared, 20);
  EXPECT_EQ(below.cached, 0);
  EXPECT_EQ(path_tokens(forest, below.node), longer);
  // Below a cached node that ends on a page boundary it goes on: the whole node is reused.
  const std::vector<TokenId> aligned = iota_tokens(24, 500);
  const PromptPlacement first_aligned = place_and_fill(forest, aligned);
  forest.release(first_aligned.node);
  std::vector<TokenId> aligned_longer = aligned;
  aligned_longer.insert(aligned_longer.end(), {7, 8});
  const PromptPlacement after = place_and_fill(forest, aligned_longer);
  EXPECT_EQ(after.shared, 24);
  EXPECT_EQ(after.cached, 24);
  EXPECT_EQ(forest.tree().node(after.node).parent, first_aligned.node);
  EXPECT_EQ(forest.cache_stats().hit_tokens, 20 + 24);
  forest.release(after.node);
  forest.release(again.node);
  forest.release(below.node);
  EXPECT_EQ(forest.referenced_pages(), 0);
  EXPECT_EQ(forest.cached_pages(), kv.used_pages());
  EXPECT_EQ(forest.cache_stats().evicted_pages, 0);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
}

TEST(PrefixCacheTest, RoomIsMadeByEvictingTheLeastRecentlyUsedLeavesFirst) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 10});
  Forest forest(&kv);
  // A prompt with two finished branches: the branches are leaves, the prompt their parent.
  const PromptPlacement stem = place_and_fill(forest, iota_tokens(8, 100));
  const std::vector<NodeId> branches = *forest.branch(stem.node, 2);
  ASSERT_TRUE(forest.append(branches[0], iota_tokens(8, 200)).ok());
  ASSERT_TRUE(forest.append(branches[1], iota_tokens(8, 300)).ok());
  forest.release(stem.node);
  forest.release(branches[1]);  // older
  forest.release(branches[0]);
  const PromptPlacement other = place_and_fill(forest, iota_tokens(4, 400));
  forest.release(other.node);  // newest
  EXPECT_EQ(forest.cached_pages(), 7);
  EXPECT_EQ(kv.free_pages(), 3);

  // 4 pages for a new prompt, 3 free: branch 1, the least recently used leaf, goes.
  const PromptPlacement fresh = place_and_fill(forest, iota_tokens(16, 500));
  EXPECT_FALSE(forest.tree().contains(branches[1]));
  EXPECT_TRUE(forest.tree().contains(branches[0]));
  EXPECT_EQ(forest.cache_stats().evicted_pages, 2);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
  // 4 more pages, 1 free: branch 0, then the stem (a leaf only now, but cached with branch 0,
  // before `other`); `other` stays.
  ASSERT_TRUE(forest.append(fresh.node, iota_tokens(16, 600)).ok());
  EXPECT_FALSE(forest.tree().contains(branches[0]));
  EXPECT_FALSE(forest.tree().contains(stem.node));
  EXPECT_TRUE(forest.tree().contains(other.node));
  EXPECT_EQ(forest.cache_stats().evicted_pages, 6);
  // Referenced KV is never evicted: a request for more than the free and cached pages together
  // fails, and evicts nothing.
  EXPECT_EQ(kv.free_pages(), 1);
  EXPECT_FALSE(forest.append(fresh.node, iota_tokens(12, 700)).ok());
  EXPECT_TRUE(forest.tree().contains(other.node));
  EXPECT_EQ(forest.referenced_pages(), 8);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
}

TEST(PrefixCacheTest, TheCapEvictsTheOldestDownToIt) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  Forest forest(&kv, 1, {.max_pages = 3});
  const PromptPlacement a = place_and_fill(forest, iota_tokens(8, 100));
  const PromptPlacement b = place_and_fill(forest, iota_tokens(8, 200));
  forest.release(a.node);
  forest.release(b.node);
  EXPECT_FALSE(forest.tree().contains(a.node));
  EXPECT_TRUE(forest.tree().contains(b.node));
  EXPECT_EQ(forest.cached_pages(), 2);
  EXPECT_EQ(forest.cache_stats().evicted_pages, 2);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
}

TEST(PrefixCacheTest, DiscardFreesAtOnceAndKeepsTheCachedPath) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 64});
  Forest forest(&kv);
  const PromptPlacement stem = place_and_fill(forest, iota_tokens(8, 100));
  const NodeId draft = *forest.add_child(stem.node);
  ASSERT_TRUE(forest.append(draft, iota_tokens(1, 7)).ok());
  forest.release(stem.node);
  EXPECT_TRUE(forest.referenced(stem.node)) << "its child is held";
  forest.discard(draft);
  EXPECT_FALSE(forest.tree().contains(draft));
  EXPECT_TRUE(forest.tree().contains(stem.node));
  EXPECT_EQ(kv.used_pages(), 2);
  EXPECT_EQ(forest.cached_pages(), 2);
  EXPECT_EQ(forest.cache_stats().evicted_pages, 0) << "a discard is no eviction";
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
  forest.clear_cache();
  EXPECT_EQ(kv.used_pages(), 0);
  EXPECT_EQ(forest.tree().num_live_nodes(), 1);
  ASSERT_TRUE(forest.check_invariants().ok()) << forest.check_invariants();
}

// Random sequences of placements (prompts that often share prefixes), appends, branches, extra
// holds (pins), releases and discards on a small pool, where appends keep evicting cached KV:
// after every operation the forest's invariants hold, and every held node's path keeps its
// tokens and KV pages (appends only add to them): eviction never frees a page that a live or
// pinned node uses.
TEST(PrefixCacheTest, RandomOperationsNeverEvictReferencedKv) {
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 random(seed);
    const auto pick = [&](size_t n) { return static_cast<size_t>(random() % n); };
    KvCacheManager kv({.page_tokens = 4, .num_pages = 40});
    Forest forest(&kv, 1, {.max_pages = seed % 3 == 0 ? 12 : -1});
    std::vector<NodeId> held;  // one entry per hold
    std::vector<std::vector<TokenId>> prompts;
    for (int round = 0; round < 400; ++round) {
      SCOPED_TRACE(testing::Message() << "round " << round);
      // Every held node's path before the operation.
      std::vector<std::pair<std::vector<TokenId>, std::vector<int32_t>>> before;
      for (NodeId node : held)
        before.push_back({path_tokens(forest, node), path_pages(forest, node)});
      const size_t op = pick(10);
      if (op < 3 || held.empty()) {
        std::vector<TokenId> prompt;
        if (!prompts.empty() && pick(3) != 0) {
          const std::vector<TokenId>& base = prompts[pick(prompts.size())];
          prompt.assign(base.begin(),
                        base.begin() + static_cast<std::ptrdiff_t>(pick(base.size()) + 1));
        }
        for (size_t i = pick(14) + (prompt.empty() ? 1 : 0); i > 0; --i) {
          prompt.push_back(static_cast<TokenId>(pick(3)));
        }
        const int64_t referenced_before = forest.referenced_pages();
        const PromptPlacement placed = forest.place_prompt(prompt);
        ASSERT_EQ(path_tokens(forest, placed.node),
                  std::vector<TokenId>(prompt.begin(), prompt.begin() + placed.shared));
        ASSERT_LE(placed.cached, placed.shared);
        // Admission counts a prompt's own pages (Work::pending_pages): the cached pages its
        // placement comes to reference, plus the pages of what it still prefills, stay within.
        const auto pages_for = [](int64_t tokens) { return (tokens + 3) / 4; };
        ASSERT_LE(forest.referenced_pages() - referenced_before +
                      pages_for(static_cast<int64_t>(prompt.size()) - placed.shared),
                  pages_for(static_cast<int64_t>(prompt.size())));
        held.push_back(placed.node);
        const std::span<const TokenId> rest =
            std::span(prompt).subspan(static_cast<size_t>(placed.shared));
        const int64_t room = kv.free_pages() + forest.cached_pages();
        const int64_t needed =
            kv.pages_needed(forest.tree().kv_key(placed.node), static_cast<int64_t>(rest.size()));
        const absl::Status appended = forest.append(placed.node, rest);
        if (appended.ok()) {
          prompts.push_back(prompt);
        } else {
          // Only when the referenced KV leaves too little room, even with every cached page.
          ASSERT_EQ(appended.code(), absl::StatusCode::kResourceExhausted);
          ASSERT_LT(room, needed) << appended;
        }
      } else if (op < 5) {
        const NodeId node = held[pick(held.size())];
        if (forest.tree().node(node).children.empty()) {
          std::vector<TokenId> run;
          for (size_t i = pick(9) + 1; i > 0; --i) run.push_back(static_cast<TokenId>(pick(3)));
          const int64_t room = kv.free_pages() + forest.cached_pages();
          const int64_t needed = kv.pages_needed(
              forest.tree().kv_key(node),
              static_cast<int64_t>(forest.tree().node(node).tokens.size() + run.size()));
          const absl::Status appended = forest.append(node, run);
          if (!appended.ok()) {
            ASSERT_LT(room, needed) << appended;
          }
        }
      } else if (op == 5) {
        const NodeId node = held[pick(held.size())];
        const std::vector<NodeId> children =
            *forest.branch(node, static_cast<int32_t>(pick(3) + 1));
        held.insert(held.end(), children.begin(), children.end());
      } else if (op == 6) {
        const NodeId node = held[pick(held.size())];
        forest.hold(node);  // a pin, as a session's
        held.push_back(node);
      } else if (op == 7) {
        const size_t index = pick(held.size());
        forest.discard(held[index]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(index));
        before.erase(before.begin() + static_cast<std::ptrdiff_t>(index));
      } else {
        const size_t index = pick(held.size());
        forest.release(held[index]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(index));
        before.erase(before.begin() + static_cast<std::ptrdiff_t>(index));
      }
      const absl::Status invariants = forest.check_invariants();
      ASSERT_TRUE(invariants.ok()) << invariants;
      for (size_t i = 0; i < before.size(); ++i) {
        ASSERT_TRUE(forest.tree().contains(held[i])) << "held node " << held[i] << " is gone";
        const std::vector<TokenId> tokens = path_tokens(forest, held[i]);
        const std::vector<int32_t> pages = path_pages(forest, held[i]);
        ASSERT_GE(tokens.size(), before[i].first.size());
        ASSERT_TRUE(std::equal(before[i].first.begin(), before[i].first.end(), tokens.begin()))
            << "held node " << held[i] << " lost tokens of its path";
        ASSERT_GE(pages.size(), before[i].second.size());
        ASSERT_TRUE(std::equal(before[i].second.begin(), before[i].second.end(), pages.begin()))
            << "held node " << held[i] << " lost KV pages of its path";
      }
    }
    for (NodeId node : held) forest.release(node);
    EXPECT_EQ(forest.referenced_pages(), 0);
    forest.clear_cache();
    EXPECT_EQ(kv.used_pages(), 0);
    EXPECT_EQ(forest.tree().num_live_nodes(), 1);
    const absl::Status invariants = forest.check_invariants();
    EXPECT_TRUE(invariants.ok()) << invariants;
  }
}

}  // namespace
}  // namespace deft::engine
