#include "engine/tokenizer/sentencepiece_tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/sentencepiece_backend.h"
#include "engine/tokenizer/string_compat.h"
#include "engine/tokenizer/utf8.h"

namespace deft::engine {
namespace {

constexpr std::string_view kSentencePieceSpace = "\xE2\x96\x81";  // "▁" U+2581
// What sentencepiece prints for an unknown piece (its default unk_surface, " ⁇ ").
constexpr std::string_view kUnknownSurface = " \xE2\x81\x87 ";

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::load(
    const std::string& path) {
  std::string error;
  std::unique_ptr<SentencePieceBackend> backend = SentencePieceBackend::load(path, &error);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot load sentencepiece model ", path, ": ", error));
  }
  auto tokenizer =
      std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(backend)));
  return tokenizer;
}

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<SentencePieceBackend> backend)
    : backend_(std::move(backend)) {
  if (backend_->bos_id() >= 0) bos_id_ = backend_->bos_id();
  if (backend_->eos_id() >= 0) eos_ids_ = {backend_->eos_id()};
  for (int id = 0; id < backend_->piece_size(); ++id) {
    if (backend_->is_control(id) && !backend_->id_to_piece(id).empty()) {
      control_pieces_.emplace_back(backend_->id_to_piece(id), id);
    }
  }
  std::stable_sort(control_pieces_.begin(), control_pieces_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  // Whether decoding drops the leading "▁" of the text: ask the library with a word piece.
  for (int id = 0; id < backend_->piece_size(); ++id) {
    const std::string& piece = backend_->id_to_piece(id);
    if (!backend_->is_control(id) && !backend_->is_byte(id) && !backend_->is_unknown(id) &&
        piece.size() > kSentencePieceSpace.size() && piece.starts_with(kSentencePieceSpace)) {
      strips_leading_space_ = !backend_->decode({id}).starts_with(' ');
      break;
    }
  }
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

absl::StatusOr<std::vector<TokenId>> SentencePieceTokenizer::encode(std::string_view text,
                                                                    bool add_bos,
                                                                    bool parse_special) const {
  if (!utf8::is_valid(text)) {
    return absl::InvalidArgumentError("text to encode is not valid UTF-8");
  }
  std::vector<TokenId> ids;
  if (add_bos && bos_id_.has_value()) ids.push_back(*bos_id_);
  auto append_text = [&](std::string_view piece) {
    if (piece.empty()) return;
    const std::vector<int> piece_ids = backend_->encode(piece);
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
  };
  if (!parse_special || control_pieces_.empty()) {
    append_text(text);
    return ids;
  }
  size_t text_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto match =
        std::find_if(control_pieces_.begin(), control_pieces_.end(), [&](const auto& control) {
          return text.compare(pos, control.first.size(), control.first) == 0;
        });
    if (match == control_pieces_.end()) {
      ++pos;
      continue;
    }
    append_text(text.substr(text_start, pos - text_start));
    ids.push_back(match->second);
    pos += match->first.size();
    text_start = pos;
  }
  append_text(text.substr(text_start));
  return ids;
}

std::string SentencePieceTokenizer::token_bytes(TokenId id, bool skip_special) const {
  if (id < 0 || id >= vocab_size()) return {};
  const std::string& piece = backend_->id_to_piece(id);
  if (backend_->is_control(id)) return skip_special ? std::string() : piece;
  if (backend_->is_unknown(id)) return std::string(kUnknownSurface);
  if (backend_->is_byte(id)) {
    // "<0x41>"
    return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
  }
  return replace_all(piece, kSentencePieceSpace, " ");
}

std::string SentencePieceTokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  std::string bytes;
  for (TokenId id : ids) bytes += token_bytes(id, skip_special);
  if (strips_leading_space_ && bytes.starts_with(' ')) bytes.erase(0, 1);
  std::string text;
  utf8::append_lossy(bytes, text);
  return text;
}

std::string SentencePieceTokenizer::token_to_piece(TokenId id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return backend_->id_to_piece(id);
}

int32_t SentencePieceTokenizer::vocab_size() const { return backend_->piece_size(); }

std::optional<TokenId> SentencePieceTokenizer::token_id(std::string_view piece) const {
  const int id = backend_->piece_to_id(piece);
  if (id < 0) return std::nullopt;
  if (id == backend_->unk_id() && piece != backend_->id_to_piece(id)) return std::nullopt;
  return id;
}

bool SentencePieceTokenizer::is_special(TokenId id) const {
  return id >= 0 && id < vocab_size() && backend_->is_control(id);
}

}  // namespace deft::engine
