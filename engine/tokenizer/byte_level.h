// Tokens that stand for raw bytes, in the two spellings Hugging Face BPE vocabularies use:
//  - byte-level BPE (GPT-2, Llama 3): every byte is one printable character of GPT-2's
//    alphabet, so a token is a string of those characters;
//  - byte fallback (sentencepiece-style BPE, Llama 2): a byte with no token of its own is the
//    token "<0xXX>".
// Internal to engine/tokenizer/ (used by HfTokenizer).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"

namespace deft::engine::hf {

// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
// themselves, the others to U+0100 onwards in byte order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of each byte's character
  absl::flat_hash_map<uint32_t, uint8_t> char_to_byte;

  ByteLevelAlphabet();
};

// The one alphabet, built on first use.
const ByteLevelAlphabet& byte_level_alphabet();

// Maps each character of a byte-level token (valid UTF-8) back to its byte and appends the
// bytes to `out`; false, leaving `out` as it was, when a character is not in the byte-level
// alphabet (added tokens), in which case the token stands for its own UTF-8.
bool byte_level_token_to_bytes(std::string_view token, std::string& out);

// "<0x41>" -> 0x41; -1 when the token is not a byte-fallback token.
int byte_fallback_value(std::string_view token);

}  // namespace deft::engine::hf
