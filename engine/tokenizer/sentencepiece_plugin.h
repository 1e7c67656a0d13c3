// The interface between SentencePieceBackend (in deft_engine) and the plugin module that holds
// the only code touching libsentencepiece (sentencepiece_plugin.cc, built as the shared module
// libdeft_sentencepiece.so).
//
// Why a plugin: Debian's libsentencepiece.so exports its bundled copy of protobuf-lite 3.14,
// and a process that also holds libprotobuf.so 3.21 (deft-server: the generated gRPC code and
// server reflection) aborts at start-up in protobuf's version check, whichever copy the dynamic
// linker binds first. The engine therefore loads the plugin with dlopen(RTLD_LOCAL |
// RTLD_DEEPBIND): libsentencepiece then binds to its own protobuf and never enters the global
// symbol scope. Plain C++ types cross the boundary (both sides share one libstdc++).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace deft::engine {

struct SentencePiecePluginApi {
  int abi_version;  // kSentencePiecePluginAbi
  // Returns an opaque processor, or nullptr with `error` set.
  void* (*load)(const char* path, std::string* error);
  void (*destroy)(void* processor);
  void (*encode)(const void* processor, const char* text, size_t size, std::vector<int>* ids);
  void (*decode)(const void* processor, const int* ids, size_t count, std::string* text);
  int (*piece_size)(const void* processor);
  const std::string* (*id_to_piece)(const void* processor, int id);
  int (*piece_to_id)(const void* processor, const char* piece, size_t size);
  bool (*is_control)(const void* processor, int id);
  bool (*is_byte)(const void* processor, int id);
  bool (*is_unknown)(const void* processor, int id);
  int (*bos_id)(const void* processor);
  int (*eos_id)(const void* processor);
  int (*unk_id)(const void* processor);
};

inline constexpr int kSentencePiecePluginAbi = 1;

}  // namespace deft::engine

// Exported by the plugin module.
extern "C" const deft::engine::SentencePiecePluginApi* deft_sentencepiece_plugin_api();
