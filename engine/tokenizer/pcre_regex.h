// The pre-tokenizer regex of a tokenizer.json, as the `tokenizers` library reads it (Oniguruma
// syntax), run by PCRE2 with UTF and UCP. Internal to engine/tokenizer/ (used by HfTokenizer);
// PCRE2's own header stays in pcre_regex.cc.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"

namespace deft::engine::hf {

// `pattern` with Oniguruma's meaning of \s and \S spelled out for PCRE2: Oniguruma reads \s as
// [\t\n\v\f\r\x85] plus the Unicode separators Z, where PCRE2 with UCP leaves out U+0085.
std::string onig_compatible_pattern(std::string_view pattern);

// A compiled PCRE2 pattern (UTF + UCP, JIT when available). The compiled code is shared by all
// threads; each match gets its own match data.
class Regex {
 public:
  // Fails with a message naming `where`, the pattern and PCRE2's reason when it does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> compile(const std::string& pattern,
                                                        std::string_view where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for each non-overlapping match in `text`, left to right.
  // `text` must be valid UTF-8 (PCRE2's own check is skipped).
  // Returns false when matching failed (a PCRE2 resource limit), not merely ended.
  bool for_each_match(std::string_view text,
                      absl::FunctionRef<void(size_t begin, size_t end)> on_match) const;

 private:
  struct Compiled;  // owns the pcre2_code
  explicit Regex(std::unique_ptr<Compiled> compiled);
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace deft::engine::hf
