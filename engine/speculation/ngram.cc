#include "engine/speculation/ngram.h"

#include <algorithm>

namespace deft::engine {

void ngram_continuations(std::span<const TokenId> context, int32_t count, int32_t length,
                         std::vector<std::vector<TokenId>>* out, int64_t window) {
  out->clear();
  if (count <= 0 || length <= 0) return;
  const auto size = static_cast<int64_t>(context.size());
  const int64_t begin = std::max<int64_t>(0, size - window);
  constexpr int64_t kMaxN = 4;
  for (int64_t n = std::min<int64_t>(kMaxN, size - 1); n >= 1; --n) {
    const std::span<const TokenId> suffix = context.subspan(static_cast<size_t>(size - n));
    // An occurrence at i (i + n < size, so at least one token follows it).
    for (int64_t i = size - n - 1; i >= begin; --i) {
      if (!std::equal(suffix.begin(), suffix.end(), context.begin() + i)) continue;
      const int64_t from = i + n;
      const int64_t to = std::min(size, from + length);
      std::vector<TokenId> continuation(context.begin() + from, context.begin() + to);
      if (std::find(out->begin(), out->end(), continuation) != out->end()) continue;
      out->push_back(std::move(continuation));
      if (static_cast<int32_t>(out->size()) >= count) return;
    }
  }
}

}  // namespace deft::engine
