// Paged KV cache pool. Every tree node owns whole pages (so branching copies nothing); a page
// holds `page_tokens` consecutive tokens of one owner. The KV tensors themselves live with the
// model runner, indexed by slot = page * page_tokens + offset; this class only hands out and
// takes back pages and does the accounting.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/numeric/int128.h"
#include "absl/status/status.h"

namespace deft::engine {

struct KvCacheConfig {
  int32_t page_tokens = 16;  // tokens per page (DESIGN.md §4 default)
  int32_t num_pages = 0;     // pool size
};

class KvCacheManager {
 public:
  // Opaque owner key; SequenceTree uses (tree_id << 64) | node_id: 128 bits, so that its 64-bit
  // node ids (never reused, so they grow past 2^32 on a long-running server) stay whole.
  using OwnerKey = absl::uint128;

  // Aborts on a non-positive page size or a negative page count (a configuration bug).
  explicit KvCacheManager(KvCacheConfig config);

  // Makes `owner` hold pages for at least `num_tokens` tokens (creating the owner if new).
  // Never shrinks. Returns RESOURCE_EXHAUSTED and changes nothing when the pool is short.
  absl::Status reserve(OwnerKey owner, int64_t num_tokens);

  // True when reserve(owner, num_tokens) would succeed.
  bool can_reserve(OwnerKey owner, int64_t num_tokens) const;

  // Pages a set of growths would need together (for all-or-nothing multi-node operations).
  int64_t pages_needed(OwnerKey owner, int64_t num_tokens) const;

  // Frees every page of `owner` at once. Unknown owners are a no-op (returns false).
  bool release(OwnerKey owner);

  // Frees the pages of `owner` beyond those `num_tokens` tokens need (a truncated node).
  void shrink(OwnerKey owner, int64_t num_tokens);

  // Moves the first `count` pages of `from` to `to`, which must hold no pages (a node split
  // at a page boundary: the head takes the front pages, no KV is copied). Aborts when `from`
  // holds fewer pages or `to` holds some (a bug in the caller).
  void move_front_pages(OwnerKey from, OwnerKey to, int64_t count);

  bool has_owner(OwnerKey owner) const;
  // Pages of `owner` in token order (empty for an unknown owner); valid until the next call
  // that changes any owner's pages.
  std::span<const int32_t> pages(OwnerKey owner) const;
  // KV slot of token `token_index` of `owner`; aborts if the token has no page (a bug).
  int32_t slot(OwnerKey owner, int64_t token_index) const;

  int32_t page_tokens() const { return config_.page_tokens; }
  int32_t num_pages() const { return config_.num_pages; }
  int32_t free_pages() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t used_pages() const { return num_pages() - free_pages(); }
  int64_t num_slots() const { return int64_t{config_.num_pages} * config_.page_tokens; }
  size_t num_owners() const { return owners_.size(); }

  // Full consistency check (every page either free or owned exactly once); for tests.
  bool check_invariants() const;

 private:
  KvCacheConfig config_;
  std::vector<int32_t> free_list_;  // LIFO: recently freed pages are reused first
  std::vector<uint8_t> page_in_use_;
  // A speculative token tree's nodes hold one page each: their page lists live in the map's
  // slots, so creating and releasing such an owner allocates nothing.
  using PageList = absl::InlinedVector<int32_t, 3>;
  absl::flat_hash_map<OwnerKey, PageList> owners_;
};

}  // namespace deft::engine
