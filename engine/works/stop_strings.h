// Stop strings on decoded text. A branch's text grows by a few bytes per token; each check
// looks only at the tail the new bytes could have completed, so a long generation costs
// O(new bytes + longest stop string) per token, not O(text).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace deft::engine {

struct StopStringMatch {
  size_t position = std::string_view::npos;  // byte offset of the match in the text; npos: none
  size_t stop_index = 0;                     // which stop string matched
  bool found() const { return position != std::string_view::npos; }
};

// The earliest occurrence of any stop string that ends inside the last `new_bytes` bytes of
// `text` (occurrences wholly inside the older text were reported by an earlier call). The
// caller truncates the branch's text at `position`. Empty stop strings never match.
StopStringMatch find_stop_string(std::string_view text, size_t new_bytes,
                                 std::span<const std::string> stop_strings);

// How many bytes at the end of `text` are a proper prefix of some stop string: a streaming
// server holds those back until the next token shows whether a stop string completes.
size_t stop_string_holdback(std::string_view text, std::span<const std::string> stop_strings);

}  // namespace deft::engine
