#include "engine/kv_cache_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

int64_t pages_for(int64_t num_tokens, int32_t page_tokens) {
  return (num_tokens + page_tokens - 1) / page_tokens;
}

}  // namespace

KvCacheManager::KvCacheManager(KvCacheConfig config) : config_(config) {
  DEFT_CHECK(config.page_tokens > 0 && config.num_pages >= 0,
             "KvCacheManager: bad config (page_tokens=%d, num_pages=%d)", config.page_tokens,
             config.num_pages);
  free_list_.reserve(config.num_pages);
  // Highest page last so that pages are handed out in ascending order (easier to read in logs).
  for (int32_t page = config.num_pages - 1; page >= 0; --page) free_list_.push_back(page);
  page_in_use_.assign(config.num_pages, 0);
}

int64_t KvCacheManager::pages_needed(OwnerKey owner, int64_t num_tokens) const {
  const int64_t wanted = pages_for(num_tokens, config_.page_tokens);
  auto it = owners_.find(owner);
  const int64_t held = it == owners_.end() ? 0 : static_cast<int64_t>(it->second.size());
  return wanted > held ? wanted - held : 0;
}

bool KvCacheManager::can_reserve(OwnerKey owner, int64_t num_tokens) const {
  return num_tokens >= 0 && pages_needed(owner, num_tokens) <= free_pages();
}

absl::Status KvCacheManager::reserve(OwnerKey owner, int64_t num_tokens) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV reserve: negative token count ", num_tokens));
  }
  // One lookup (a speculative step reserves a page for each of its new one-token nodes).
  const auto [it, inserted] = owners_.try_emplace(owner);
  PageList& pages = it->second;
  const int64_t wanted = pages_for(num_tokens, config_.page_tokens);
  const int64_t needed = std::max<int64_t>(wanted - static_cast<int64_t>(pages.size()), 0);
  if (needed > free_pages()) {
    if (inserted) owners_.erase(it);  // a refused new owner is not created
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache exhausted: ", num_tokens, " tokens need ", needed,
                     " more pages of ", config_.page_tokens, " tokens, ", free_pages(),
                     " of ", num_pages(), " pages free"));
  }
  for (int64_t i = 0; i < needed; ++i) {
    const int32_t page = free_list_.back();
    free_list_.pop_back();
    page_in_use_[page] = 1;
    pages.push_back(page);
  }
  return absl::OkStatus();
}

bool KvCacheManager::release(OwnerKey owner) {
  auto it = owners_.find(owner);
  if (it == owners_.end()) return false;
  for (int32_t page : it->second) {
    page_in_use_[page] = 0;
    free_list_.push_back(page);
  }
  owners_.erase(it);
  return true;
}

void KvCacheManager::shrink(OwnerKey owner, int64_t num_tokens) {
  auto it = owners_.find(owner);
  if (it == owners_.end()) return;
  const auto keep = static_cast<size_t>(pages_for(std::max<int64_t>(num_tokens, 0),
                                                  config_.page_tokens));
  PageList& pages = it->second;
  while (pages.size() > keep) {
    page_in_use_[pages.back()] = 0;
    free_list_.push_back(pages.back());
    pages.pop_back();
  }
  if (pages.empty()) owners_.erase(it);
}

void KvCacheManager::move_front_pages(OwnerKey from, OwnerKey to, int64_t count) {
  if (count <= 0) return;
  auto it = owners_.find(from);
  DEFT_CHECK(it != owners_.end() && static_cast<int64_t>(it->second.size()) >= count &&
                 pages(to).empty(),
             "KvCacheManager::move_front_pages: cannot move %lld pages %llx:%llx -> %llx:%llx",
             static_cast<long long>(count),
             static_cast<unsigned long long>(absl::Uint128High64(from)),
             static_cast<unsigned long long>(absl::Uint128Low64(from)),
             static_cast<unsigned long long>(absl::Uint128High64(to)),
             static_cast<unsigned long long>(absl::Uint128Low64(to)));
  PageList& source = it->second;
  PageList head(source.begin(), source.begin() + count);
  source.erase(source.begin(), source.begin() + count);
  if (source.empty()) owners_.erase(it);
  owners_[to] = std::move(head);  // may rehash: `source` is not used after this
}

bool KvCacheManager::has_owner(OwnerKey owner) const { return owners_.count(owner) != 0; }

std::span<const int32_t> KvCacheManager::pages(OwnerKey owner) const {
  auto it = owners_.find(owner);
  if (it == owners_.end()) return {};
  return it->second;
}

int32_t KvCacheManager::slot(OwnerKey owner, int64_t token_index) const {
  std::span<const int32_t> owned = pages(owner);
  const int64_t page_index = token_index / config_.page_tokens;
  DEFT_CHECK(token_index >= 0 && page_index < static_cast<int64_t>(owned.size()),
             "KvCacheManager::slot: token %lld of owner %llx:%llx has no page",
             static_cast<long long>(token_index),
             static_cast<unsigned long long>(absl::Uint128High64(owner)),
             static_cast<unsigned long long>(absl::Uint128Low64(owner)));
  return owned[page_index] * config_.page_tokens +
         static_cast<int32_t>(token_index % config_.page_tokens);
}

bool KvCacheManager::check_invariants() const {
  std::vector<int32_t> seen(config_.num_pages, 0);
  for (int32_t page : free_list_) {
    if (page < 0 || page >= config_.num_pages || page_in_use_[page]) return false;
    ++seen[page];
  }
  for (const auto& [owner, pages] : owners_) {
    for (int32_t page : pages) {
      if (page < 0 || page >= config_.num_pages || !page_in_use_[page]) return false;
      ++seen[page];
    }
  }
  for (int32_t count : seen) {
    if (count != 1) return false;
  }
  return true;
}

}  // namespace deft::engine
