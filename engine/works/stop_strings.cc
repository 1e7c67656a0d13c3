#include "engine/works/stop_strings.h"

#include <algorithm>

namespace deft::engine {

StopStringMatch find_stop_string(std::string_view text, size_t new_bytes,
                                 std::span<const std::string> stop_strings) {
  new_bytes = std::min(new_bytes, text.size());
  const size_t old_size = text.size() - new_bytes;
  StopStringMatch best;
  for (size_t i = 0; i < stop_strings.size(); ++i) {
    const std::string& stop = stop_strings[i];
    if (stop.empty() || stop.size() > text.size()) continue;
    // A match ending after old_size starts after old_size - stop.size().
    size_t from = old_size >= stop.size() ? old_size - stop.size() + 1 : 0;
    const size_t position = text.find(stop, from);
    if (position != std::string_view::npos && position < best.position) {
      best.position = position;
      best.stop_index = i;
    }
  }
  return best;
}

size_t stop_string_holdback(std::string_view text, std::span<const std::string> stop_strings) {
  size_t longest = 0;
  for (const std::string& stop : stop_strings) {
    // Proper prefixes only: a whole stop string is a match, not something to hold back.
    const size_t max_length = std::min(text.size(), stop.empty() ? 0 : stop.size() - 1);
    for (size_t length = max_length; length > longest; --length) {
      if (text.substr(text.size() - length) == std::string_view(stop).substr(0, length)) {
        longest = length;
        break;
      }
    }
  }
  return longest;
}

}  // namespace deft::engine
