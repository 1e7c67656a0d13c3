// GPT-2's byte-level alphabet and the <0xXX> byte-fallback tokens.
#include "engine/tokenizer/byte_level.h"

#include "engine/tokenizer/utf8.h"

namespace deft::engine::hf {
namespace {

// Decodes the code point at the start of a valid UTF-8 string; sets `length`.
uint32_t code_point_at(std::string_view text, int* length) {
  const auto b0 = static_cast<uint8_t>(text[0]);
  if (b0 < 0x80) {
    *length = 1;
    return b0;
  }
  *length = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  uint32_t cp = b0 & (0x7F >> *length);
  for (int i = 1; i < *length; ++i) cp = (cp << 6) | (static_cast<uint8_t>(text[i]) & 0x3F);
  return cp;
}

}  // namespace

ByteLevelAlphabet::ByteLevelAlphabet() {
  uint32_t next_extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const uint32_t cp = printable ? b : next_extra++;
    utf8::append_code_point(cp, byte_to_char[b]);
    char_to_byte[cp] = static_cast<uint8_t>(b);
  }
}

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

bool byte_level_token_to_bytes(std::string_view token, std::string& out) {
  const auto& alphabet = byte_level_alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    int length = 0;
    const uint32_t cp = code_point_at(token.substr(pos), &length);
    const auto it = alphabet.char_to_byte.find(cp);
    if (it == alphabet.char_to_byte.end()) return false;
    bytes.push_back(static_cast<char>(it->second));
    pos += static_cast<size_t>(length);
  }
  out.append(bytes);
  return true;
}

int byte_fallback_value(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace deft::engine::hf
