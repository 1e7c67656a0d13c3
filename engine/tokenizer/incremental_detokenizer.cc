#include "engine/tokenizer/incremental_detokenizer.h"

#include "engine/tokenizer/utf8.h"

namespace deft::engine {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool starts_text,
                                               bool skip_special)
    : tokenizer_(tokenizer),
      skip_special_(skip_special),
      strip_next_space_(starts_text && tokenizer.decode_strips_leading_space()) {}

std::string IncrementalDetokenizer::feed(TokenId id) {
  std::string bytes = tokenizer_.token_bytes(id, skip_special_);
  if (bytes.empty()) return {};
  if (strip_next_space_) {
    if (bytes[0] == ' ') bytes.erase(0, 1);
    strip_next_space_ = false;
  }
  pending_ += bytes;
  // Emit the longest prefix that is complete: well-formed characters, and ill-formed bytes
  // (as U+FFFD) once they can no longer become a character.
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const std::string_view rest = std::string_view(pending_).substr(pos);
    const int length = utf8::sequence_length(rest);
    if (length > 0) {
      out.append(rest.substr(0, static_cast<size_t>(length)));
      pos += static_cast<size_t>(length);
      continue;
    }
    if (length < 0) break;  // an incomplete character: wait for more bytes
    // Ill-formed: replace its maximal subpart, as utf8::append_lossy does.
    size_t subpart = 1;
    while (subpart < rest.size() && utf8::sequence_length(rest.substr(0, subpart + 1)) == -1) {
      ++subpart;
    }
    out.append(utf8::kReplacementChar);
    pos += subpart;
  }
  pending_.erase(0, pos);
  text_ += out;
  return out;
}

std::string IncrementalDetokenizer::finish() {
  std::string out;
  utf8::append_lossy(pending_, out);
  pending_.clear();
  text_ += out;
  return out;
}

}  // namespace deft::engine
