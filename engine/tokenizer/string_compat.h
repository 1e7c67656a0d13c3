// Debian's Abseil is built with its own absl::string_view class, which does not convert from
// std::string_view. These helpers bridge the two wherever our interfaces use std::string_view.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace deft::engine {

inline absl::string_view to_absl(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

// absl::StrCat that also takes std::string_view arguments.
template <typename T>
decltype(auto) to_alpha_num(const T& value) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return to_absl(value);
  } else {
    return (value);
  }
}
template <typename... Args>
std::string str_cat(const Args&... args) {
  return absl::StrCat(to_alpha_num(args)...);
}

// `text` with every occurrence of `from` (non-empty) replaced by `to`.
inline std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (true) {
    const size_t found = from.empty() ? std::string_view::npos : text.find(from, pos);
    if (found == std::string_view::npos) break;
    out.append(text.substr(pos, found - pos));
    out.append(to);
    pos = found + from.size();
  }
  out.append(text.substr(pos));
  return out;
}

}  // namespace deft::engine
