// HfTokenizer: our implementation of Hugging Face `tokenizer.json` BPE tokenizers, token for
// token equal to the `tokenizers` library on Llama-family files:
//  - byte-level BPE (Llama 3, Qwen2, GPT-2 style): regex pre-tokenizer (PCRE2 with UTF and UCP,
//    `\s` rewritten to Oniguruma's meaning), bytes mapped to printable characters, merges by rank;
//    `ignore_merges` (a pre-token that is itself in the vocabulary is one token).
//  - sentencepiece-style BPE (Llama 2, Mistral, CodeLlama): normalizer that prepends "▁" and
//    replaces spaces by "▁", byte fallback to <0xXX> tokens, decoder that strips the leading
//    space.
// Added and special tokens are matched (leftmost, longest) before anything else, so the text
// is split on them. The supported tokenizer.json components are listed in hf_tokenizer.cc;
// anything else fails to load with a message naming the field.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "engine/tokenizer/tokenizer.h"

namespace deft::engine {

class HfTokenizer final : public Tokenizer {
 public:
  // Reads and parses `path` (a tokenizer.json file).
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> load(const std::string& path);
  // Parses tokenizer.json text; `source_name` names it in error messages.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> from_json(std::string_view json_text,
                                                                std::string_view source_name);
  ~HfTokenizer() override;

  absl::StatusOr<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                              bool parse_special = true) const override;
  std::string decode(std::span<const TokenId> ids, bool skip_special = false) const override;
  std::string token_to_piece(TokenId id) const override;
  std::string token_bytes(TokenId id, bool skip_special = false) const override;
  bool decode_strips_leading_space() const override;
  int32_t vocab_size() const override;
  std::optional<TokenId> token_id(std::string_view piece) const override;
  bool is_special(TokenId id) const override;

  // True for byte-level BPE (Llama 3), false for sentencepiece-style BPE (Llama 2).
  bool is_byte_level() const;

 private:
  struct Impl;
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deft::engine
