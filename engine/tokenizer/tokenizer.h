// Tokenizer: one interface over the two tokenizer formats of Llama-family checkpoints:
// sentencepiece `tokenizer.model` (engine/tokenizer/sentencepiece_tokenizer.h) and Hugging Face
// `tokenizer.json` BPE (engine/tokenizer/hf_tokenizer.h). load_tokenizer() picks one from a model
// folder and fills in BOS/EOS from tokenizer_config.json / generation_config.json.
//
// Thread safety: every const method may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::engine {

using TokenId = int32_t;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text`, with BOS first when `add_bos` (and the tokenizer has one). When
  // `parse_special` is true, special tokens written in the text ("<|eot_id|>", "</s>") become
  // their ids, as Hugging Face does by default; pass false for untrusted user text.
  // Fails (INVALID_ARGUMENT) on text that is not valid UTF-8, and on a character that has no
  // token when the tokenizer has neither an unk token nor a byte token for each of its bytes
  // (the message names the character): a tokenizer.json without byte fallback, unk_token or
  // a complete byte-level alphabet. The Llama-family files and tokenizer.model never do.
  virtual absl::StatusOr<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                                      bool parse_special = true) const = 0;

  // Text of `ids` as the reference decoder gives it (sentencepiece: leading space of the text
  // removed; byte-level: bytes joined). Invalid UTF-8 comes out as U+FFFD. Ids outside the
  // vocabulary are skipped.
  virtual std::string decode(std::span<const TokenId> ids, bool skip_special = false) const = 0;

  // The vocabulary string of one token ("▁Hello", "ĠHello", "<0x0A>", "<|eot_id|>"); empty for
  // an id outside the vocabulary.
  virtual std::string token_to_piece(TokenId id) const = 0;

  // The raw bytes one token contributes to decoded text, before the sentencepiece rule that
  // drops the text's leading space (see decode_strips_leading_space()). May be an incomplete
  // UTF-8 sequence (byte-fallback and byte-level tokens). Empty for special tokens when
  // `skip_special`, and for ids outside the vocabulary.
  virtual std::string token_bytes(TokenId id, bool skip_special = false) const = 0;

  // True when decoding removes one leading space from the text (sentencepiece-style
  // tokenizers, whose words carry a leading "▁"). (A tokenizer.json Metaspace decoder drops
  // every "▁" of the first token; for a first token that is a run of "▁" the streamed text of
  // IncrementalDetokenizer then keeps the spaces after the first.)
  virtual bool decode_strips_leading_space() const = 0;

  // Number of ids, added tokens included (the model's embedding table may be larger).
  virtual int32_t vocab_size() const = 0;

  // Id of a special or added token given by its text ("<|eot_id|>", "<s>"), or of any
  // vocabulary piece; nullopt when there is none.
  virtual std::optional<TokenId> token_id(std::string_view piece) const = 0;

  // Control/special tokens (BOS, EOS, chat headers): skipped by decode(skip_special=true).
  virtual bool is_special(TokenId id) const = 0;

  std::optional<TokenId> bos_id() const { return bos_id_; }
  const std::vector<TokenId>& eos_ids() const { return eos_ids_; }
  bool is_eos(TokenId id) const;

  void set_bos_id(std::optional<TokenId> id) { bos_id_ = id; }
  void set_eos_ids(std::vector<TokenId> ids) { eos_ids_ = std::move(ids); }

 protected:
  std::optional<TokenId> bos_id_;
  std::vector<TokenId> eos_ids_;
};

// Loads the tokenizer of a Hugging Face model folder: `tokenizer.json` when present, else
// `tokenizer.model`. BOS/EOS come from the tokenizer's own defaults, then
// tokenizer_config.json (bos_token, eos_token), then generation_config.json (bos_token_id,
// eos_token_id: a number or a list), later files overriding earlier ones.
absl::StatusOr<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& model_dir);

// Llama 3 chat format: one {role, content} turn.
struct ChatMessage {
  std::string role;
  std::string content;
};

// Token ids of the Llama 3 chat template:
//   <|begin_of_text|> then per message
//   <|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>
// and, when `add_generation_prompt`, <|start_header_id|>assistant<|end_header_id|>\n\n.
// Special tokens written inside roles or contents are not parsed (they stay text). Fails when
// the tokenizer lacks the Llama 3 header/eot special tokens.
absl::StatusOr<std::vector<TokenId>> encode_llama3_chat(const Tokenizer& tokenizer,
                                                        std::span<const ChatMessage> messages,
                                                        bool add_generation_prompt = true);

}  // namespace deft::engine
