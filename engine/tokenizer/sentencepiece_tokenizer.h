// SentencePieceTokenizer: a sentencepiece `tokenizer.model` (Llama, Llama 2, CodeLlama, Mistral)
// through Debian's libsentencepiece (engine/tokenizer/sentencepiece_backend.h).
#pragma once

#include <memory>
#include <string>

#include "engine/tokenizer/tokenizer.h"

namespace deft::engine {

class SentencePieceBackend;

class SentencePieceTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> load(const std::string& path);
  ~SentencePieceTokenizer() override;

  // With `parse_special`, control pieces written in the text ("<s>", "</s>") become their ids
  // and the text between them is encoded piece by piece (each piece gets sentencepiece's dummy
  // "▁" prefix, as the Hugging Face Llama tokenizer does in its default legacy mode).
  absl::StatusOr<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                              bool parse_special = true) const override;
  // Equal to sentencepiece's DecodeIds when `skip_special`; otherwise control tokens appear as
  // their text ("<s>"), as in Hugging Face.
  std::string decode(std::span<const TokenId> ids, bool skip_special = false) const override;
  std::string token_to_piece(TokenId id) const override;
  std::string token_bytes(TokenId id, bool skip_special = false) const override;
  bool decode_strips_leading_space() const override { return strips_leading_space_; }
  int32_t vocab_size() const override;
  std::optional<TokenId> token_id(std::string_view piece) const override;
  bool is_special(TokenId id) const override;

 private:
  explicit SentencePieceTokenizer(std::unique_ptr<SentencePieceBackend> backend);
  std::unique_ptr<SentencePieceBackend> backend_;
  std::vector<std::pair<std::string, TokenId>> control_pieces_;  // longest first
  bool strips_leading_space_ = true;
};

}  // namespace deft::engine
