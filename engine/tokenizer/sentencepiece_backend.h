// A thin facade over Debian's libsentencepiece that uses only standard types.
//
// Why a separate file: Debian's sentencepiece_processor.h declares `absl::string_view` as
// std::string_view, which clashes with Debian's Abseil (its own absl::string_view class), so
// that header may only be included by a file that includes no Abseil header. Only
// sentencepiece_backend.cc includes it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace deft::engine {

class SentencePieceBackend {
 public:
  // Loads a serialized ModelProto (tokenizer.model); on failure returns nullptr and sets `error`.
  static std::unique_ptr<SentencePieceBackend> load(const std::string& path, std::string* error);
  ~SentencePieceBackend();
  SentencePieceBackend(const SentencePieceBackend&) = delete;
  SentencePieceBackend& operator=(const SentencePieceBackend&) = delete;

  std::vector<int> encode(std::string_view text) const;
  std::string decode(const std::vector<int>& ids) const;
  int piece_size() const;
  const std::string& id_to_piece(int id) const;
  int piece_to_id(std::string_view piece) const;  // unk_id() when absent
  bool is_control(int id) const;
  bool is_byte(int id) const;
  bool is_unknown(int id) const;
  int bos_id() const;  // -1 when the model has none
  int eos_id() const;
  int unk_id() const;

 private:
  struct Impl;
  explicit SentencePieceBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deft::engine
