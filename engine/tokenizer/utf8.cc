#include "engine/tokenizer/utf8.h"

namespace deft::engine::utf8 {

int sequence_length(std::string_view bytes) {
  if (bytes.empty()) return -1;
  const auto b0 = static_cast<uint8_t>(bytes[0]);
  if (b0 < 0x80) return 1;
  int length = 0;
  // Allowed range of the second byte (Unicode Table 3-7): excludes overlongs and surrogates.
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int i = 1; i < length; ++i) {
    if (static_cast<size_t>(i) >= bytes.size()) return -1;
    const auto b = static_cast<uint8_t>(bytes[i]);
    const uint8_t min = i == 1 ? lo : 0x80, max = i == 1 ? hi : 0xBF;
    if (b < min || b > max) return 0;
  }
  return length;
}

bool is_valid(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const int length = sequence_length(bytes.substr(pos));
    if (length <= 0) return false;
    pos += static_cast<size_t>(length);
  }
  return true;
}

void append_lossy(std::string_view bytes, std::string& out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const int length = sequence_length(bytes.substr(pos));
    if (length > 0) {
      out.append(bytes.substr(pos, static_cast<size_t>(length)));
      pos += static_cast<size_t>(length);
      continue;
    }
    // Maximal subpart: the lead byte plus the continuation bytes that were still allowed.
    size_t skip = 1;
    while (pos + skip < bytes.size() && skip < 4) {
      const int prefix = sequence_length(bytes.substr(pos, skip + 1));
      if (prefix != -1) break;  // adding this byte makes it ill-formed
      ++skip;
    }
    out.append(kReplacementChar);
    pos += skip;
  }
}

void append_code_point(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace deft::engine::utf8
