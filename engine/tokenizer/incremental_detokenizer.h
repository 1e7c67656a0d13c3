// IncrementalDetokenizer: turns a stream of generated token ids into a stream of text pieces
// for streaming responses. A piece is emitted only once it is complete UTF-8, so a character
// split across byte tokens (an emoji as four <0xXX> byte-fallback tokens, or a byte-level token
// ending mid-character) is never cut in half. The concatenated output equals
// tokenizer.decode(ids) for valid UTF-8 (ill-formed bytes become U+FFFD).
#pragma once

#include <string>

#include "engine/tokenizer/tokenizer.h"

namespace deft::engine {

class IncrementalDetokenizer {
 public:
  // `starts_text`: the stream is the start of the decoded text, so the sentencepiece rule that
  // drops the leading space of the text applies to its first byte. Pass false when the tokens
  // continue a prompt: there "▁Paris" after "The capital is" is " Paris", with its space.
  // `skip_special`: special tokens (BOS, EOS, chat headers) produce no text.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool starts_text = false,
                                  bool skip_special = true);

  // Adds one token; returns the text that became complete (often empty or one piece).
  std::string feed(TokenId id);
  // Ends the stream: bytes still pending (an incomplete character) come out as U+FFFD.
  std::string finish();
  // Everything emitted so far.
  const std::string& text() const { return text_; }
  // Bytes held back waiting for the rest of a character.
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  bool strip_next_space_;  // the sentencepiece leading-space rule is still to apply
  std::string pending_;
  std::string text_;
};

}  // namespace deft::engine
