// Small UTF-8 helpers shared by the tokenizers and the incremental detokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace deft::engine::utf8 {

// Length in bytes of the well-formed UTF-8 sequence at the start of `bytes` (1..4), or 0 when
// it starts with an ill-formed sequence, or -1 when it is a valid but incomplete prefix of a
// sequence (more bytes could complete it).
int sequence_length(std::string_view bytes);

// True when all of `bytes` is well-formed UTF-8.
bool is_valid(std::string_view bytes);

// Appends `bytes` to `out`, replacing each maximal ill-formed subpart by U+FFFD (the WHATWG /
// Unicode "substitution of maximal subparts" that Rust's from_utf8_lossy and JavaScript's
// TextDecoder use).
void append_lossy(std::string_view bytes, std::string& out);

// Appends the UTF-8 encoding of code point `cp` to `out`.
void append_code_point(uint32_t cp, std::string& out);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace deft::engine::utf8
