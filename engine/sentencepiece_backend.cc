// Must not include any Abseil header: see sentencepiece_backend.h.
#include "engine/sentencepiece_backend.h"

#include <sentencepiece_processor.h>

namespace deft::engine {

struct SentencePieceBackend::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

std::unique_ptr<SentencePieceBackend> SentencePieceBackend::load(const std::string& path,
                                                                 std::string* error) {
  auto impl = std::make_unique<Impl>();
  const sentencepiece::util::Status status = impl->processor.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return std::unique_ptr<SentencePieceBackend>(new SentencePieceBackend(std::move(impl)));
}

SentencePieceBackend::SentencePieceBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SentencePieceBackend::~SentencePieceBackend() = default;

std::vector<int> SentencePieceBackend::encode(std::string_view text) const {
  return impl_->processor.EncodeAsIds(text);
}
std::string SentencePieceBackend::decode(const std::vector<int>& ids) const {
  return impl_->processor.DecodeIds(ids);
}
int SentencePieceBackend::piece_size() const { return impl_->processor.GetPieceSize(); }
const std::string& SentencePieceBackend::id_to_piece(int id) const {
  return impl_->processor.IdToPiece(id);
}
int SentencePieceBackend::piece_to_id(std::string_view piece) const {
  return impl_->processor.PieceToId(piece);
}
bool SentencePieceBackend::is_control(int id) const { return impl_->processor.IsControl(id); }
bool SentencePieceBackend::is_byte(int id) const { return impl_->processor.IsByte(id); }
bool SentencePieceBackend::is_unknown(int id) const { return impl_->processor.IsUnknown(id); }
int SentencePieceBackend::bos_id() const { return impl_->processor.bos_id(); }
int SentencePieceBackend::eos_id() const { return impl_->processor.eos_id(); }
int SentencePieceBackend::unk_id() const { return impl_->processor.unk_id(); }

}  // namespace deft::engine
