// Prompt-lookup drafting (n-gram speculation, no draft model): text that repeats itself (code,
// quotes of the prompt, lists) is drafted by copying what followed the context's last few
// tokens where they appeared before.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/sequence_tree.h"

namespace deft::engine {

// Up to `count` distinct continuations of `context`, each up to `length` tokens: for n from 4
// down to 1, the tokens that followed each earlier occurrence of the context's last n tokens,
// the most recent occurrence first. Longer matches come first (they predict better). Scans at
// most the last `window` tokens of the context (bounded work per step).
void ngram_continuations(std::span<const TokenId> context, int32_t count, int32_t length,
                         std::vector<std::vector<TokenId>>* out, int64_t window = 8192);

}  // namespace deft::engine
