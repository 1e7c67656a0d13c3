// PCRE2 behind hf::Regex, and the rewrite of Oniguruma patterns into PCRE2 syntax.
#include "engine/tokenizer/pcre_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/string_compat.h"
#include "engine/tokenizer/utf8.h"

namespace deft::engine::hf {
namespace {

// Oniguruma (the regex engine of `tokenizers`) reads \s as [\t\n\v\f\r\x85] plus the Unicode
// separators Z; PCRE2 with UCP leaves out U+0085. Spell the class out so both agree.
constexpr std::string_view kOnigSpaceClassBody = "\\t\\n\\x0B\\f\\r\\x{85}\\p{Z}";

}  // namespace

std::string onig_compatible_pattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's') {
        if (in_class) {
          out.append(kOnigSpaceClassBody);
        } else {
          absl::StrAppend(&out, "[", to_absl(kOnigSpaceClassBody), "]");
        }
      } else if (next == 'S' && !in_class) {
        absl::StrAppend(&out, "[^", to_absl(kOnigSpaceClassBody), "]");
      } else {
        out.push_back(c);
        out.push_back(next);
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' or '^]' right after '[' is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

struct Regex::Compiled {
  explicit Compiled(pcre2_code* pcre) : code(pcre) {}
  ~Compiled() { pcre2_code_free(code); }
  Compiled(const Compiled&) = delete;
  Compiled& operator=(const Compiled&) = delete;
  pcre2_code* code;
};

absl::StatusOr<std::unique_ptr<Regex>> Regex::compile(const std::string& pattern,
                                                      std::string_view where) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error_code, message.data(), message.size());
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: regex '%s' does not compile at offset %d: %s", to_absl(where), pattern,
        static_cast<int>(error_offset), reinterpret_cast<const char*>(message.data())));
  }
  // JIT is an optimisation only: without it pcre2_match interprets the pattern.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return std::unique_ptr<Regex>(new Regex(std::make_unique<Compiled>(code)));
}

Regex::Regex(std::unique_ptr<Compiled> compiled) : compiled_(std::move(compiled)) {}
Regex::~Regex() = default;

bool Regex::for_each_match(std::string_view text,
                           absl::FunctionRef<void(size_t begin, size_t end)> on_match) const {
  pcre2_code* code = compiled_->code;
  bool ok = true;
  pcre2_match_data* match_data = pcre2_match_data_create_from_pattern(code, nullptr);
  size_t offset = 0;
  while (offset <= text.size()) {
    // The text was checked to be valid UTF-8 before: skip PCRE2's own check.
    const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), offset,
                               PCRE2_NO_UTF_CHECK, match_data, nullptr);
    if (rc < 0) {
      ok = rc == PCRE2_ERROR_NOMATCH;
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      on_match(begin, end);
      offset = end;
    } else {
      // Empty match: step over one character so the loop ends.
      if (begin >= text.size()) break;
      const int length = utf8::sequence_length(text.substr(begin));
      offset = begin + static_cast<size_t>(length > 0 ? length : 1);
    }
  }
  pcre2_match_data_free(match_data);
  return ok;
}

}  // namespace deft::engine::hf
