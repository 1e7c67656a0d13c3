#include "engine/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

namespace deft::engine {
namespace {

TEST(KvCacheManager, ReservesWholePagesAndFreesThemOnRelease) {
  KvCacheManager kv({.page_tokens = 16, .num_pages = 4});
  ASSERT_TRUE(kv.reserve(1, 17).ok());
  EXPECT_EQ(kv.pages(1).size(), 2u);
  EXPECT_EQ(kv.free_pages(), 2);
  ASSERT_TRUE(kv.reserve(1, 20).ok());  // still two pages
  EXPECT_EQ(kv.pages(1).size(), 2u);
  EXPECT_EQ(kv.slot(1, 0) / 16, kv.pages(1)[0]);
  EXPECT_EQ(kv.slot(1, 17), kv.pages(1)[1] * 16 + 1);
  EXPECT_TRUE(kv.release(1));
  EXPECT_FALSE(kv.release(1));
  EXPECT_EQ(kv.free_pages(), 4);
  EXPECT_TRUE(kv.check_invariants());
}

TEST(KvCacheManager, ExhaustionReturnsErrorAndChangesNothing) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 3});
  ASSERT_TRUE(kv.reserve(7, 8).ok());
  const std::vector<int32_t> before(kv.pages(7).begin(), kv.pages(7).end());
  absl::Status status = kv.reserve(7, 13);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("exhausted"), std::string_view::npos);
  EXPECT_EQ(std::vector<int32_t>(kv.pages(7).begin(), kv.pages(7).end()), before);
  EXPECT_EQ(kv.free_pages(), 1);
  EXPECT_FALSE(kv.reserve(8, 5).ok());
  EXPECT_FALSE(kv.has_owner(8));
  EXPECT_TRUE(kv.check_invariants());
}

TEST(KvCacheManager, NegativeTokenCountIsRejected) {
  KvCacheManager kv({.page_tokens = 16, .num_pages = 2});
  EXPECT_EQ(kv.reserve(1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(kv.has_owner(1));
  EXPECT_FALSE(kv.can_reserve(1, -1));
}

// A new owner's first reserve (one map lookup); short of pages, it is not created.
TEST(KvCacheManager, ReserveCreatesANewOwnerOnlyWhenItFits) {
  KvCacheManager kv({.page_tokens = 4, .num_pages = 4});
  ASSERT_TRUE(kv.reserve(3, 5).ok());
  EXPECT_EQ(kv.pages(3).size(), 2u);
  ASSERT_TRUE(kv.reserve(4, 0).ok());  // an owner without pages
  EXPECT_TRUE(kv.has_owner(4));
  EXPECT_EQ(kv.reserve(5, 9).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(kv.has_owner(5));
  EXPECT_EQ(kv.free_pages(), 2);
  ASSERT_TRUE(kv.reserve(3, 12).ok());  // grows like any owner
  EXPECT_EQ(kv.pages(3).size(), 3u);
  EXPECT_TRUE(kv.check_invariants());
}

// Long random sequences of grow / release: no leak, no double free, no page shared.
TEST(KvCacheManager, RandomGrowReleaseKeepsInvariants) {
  const uint32_t seed = 20261123;
  std::mt19937 rng(seed);
  KvCacheManager kv({.page_tokens = 8, .num_pages = 64});
  std::map<uint64_t, int64_t> tokens;  // model of what each owner holds
  for (int step = 0; step < 20000; ++step) {
    const uint64_t owner = rng() % 24;
    if (rng() % 4 == 0) {
      kv.release(owner);
      tokens.erase(owner);
    } else {
      const int64_t want = tokens[owner] + static_cast<int64_t>(rng() % 40);
      const int free_before = kv.free_pages();
      const bool expect_ok = kv.can_reserve(owner, want);
      absl::Status status = kv.reserve(owner, want);
      ASSERT_EQ(status.ok(), expect_ok) << "seed " << seed << " step " << step;
      if (status.ok()) {
        tokens[owner] = std::max(tokens[owner], want);
      } else {
        ASSERT_EQ(kv.free_pages(), free_before) << "seed " << seed;
        if (tokens[owner] == 0 && !kv.has_owner(owner)) tokens.erase(owner);
      }
    }
    if (step % 97 == 0) {
      ASSERT_TRUE(kv.check_invariants()) << "seed " << seed << " step " << step;
    }
  }
  std::set<int32_t> pages;
  for (const auto& [owner, count] : tokens) {
    ASSERT_EQ(static_cast<int64_t>(kv.pages(owner).size()), (count + 7) / 8);
    for (int32_t page : kv.pages(owner)) ASSERT_TRUE(pages.insert(page).second);
  }
  for (const auto& [owner, count] : tokens) kv.release(owner);
  EXPECT_EQ(kv.free_pages(), kv.num_pages());
  EXPECT_TRUE(kv.check_invariants());
}

}  // namespace
}  // namespace deft::engine
