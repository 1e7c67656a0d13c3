// The plugin module libdeft_sentencepiece.so: the only code that calls libsentencepiece (see
// sentencepiece_plugin.h). Must not include any Abseil header: Debian's
// sentencepiece_processor.h declares absl::string_view as std::string_view, which clashes with
// Debian's Abseil.
#include "engine/tokenizer/sentencepiece_plugin.h"

#include <sentencepiece_processor.h>

#include <string_view>

namespace {

using sentencepiece::SentencePieceProcessor;

const SentencePieceProcessor& processor(const void* handle) {
  return *static_cast<const SentencePieceProcessor*>(handle);
}

void* load(const char* path, std::string* error) {
  auto* result = new SentencePieceProcessor();  // owned by the caller through destroy()
  const sentencepiece::util::Status status = result->Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    delete result;
    return nullptr;
  }
  return result;
}

void destroy(void* handle) { delete static_cast<SentencePieceProcessor*>(handle); }

void encode(const void* handle, const char* text, size_t size, std::vector<int>* ids) {
  *ids = processor(handle).EncodeAsIds(std::string_view(text, size));
}

void decode(const void* handle, const int* ids, size_t count, std::string* text) {
  *text = processor(handle).DecodeIds(std::vector<int>(ids, ids + count));
}

constexpr deft::engine::SentencePiecePluginApi kApi = {
    .abi_version = deft::engine::kSentencePiecePluginAbi,
    .load = load,
    .destroy = destroy,
    .encode = encode,
    .decode = decode,
    .piece_size = [](const void* h) { return processor(h).GetPieceSize(); },
    .id_to_piece = [](const void* h, int id) { return &processor(h).IdToPiece(id); },
    .piece_to_id =
        [](const void* h, const char* piece, size_t size) {
          return processor(h).PieceToId(std::string_view(piece, size));
        },
    .is_control = [](const void* h, int id) { return processor(h).IsControl(id); },
    .is_byte = [](const void* h, int id) { return processor(h).IsByte(id); },
    .is_unknown = [](const void* h, int id) { return processor(h).IsUnknown(id); },
    .bos_id = [](const void* h) { return processor(h).bos_id(); },
    .eos_id = [](const void* h) { return processor(h).eos_id(); },
    .unk_id = [](const void* h) { return processor(h).unk_id(); },
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const deft::engine::SentencePiecePluginApi*
deft_sentencepiece_plugin_api() {
  return &kApi;
}
