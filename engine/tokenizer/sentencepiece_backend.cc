// Calls libsentencepiece through the plugin module (see sentencepiece_plugin.h for why).
#include "engine/tokenizer/sentencepiece_backend.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "engine/tokenizer/sentencepiece_plugin.h"

#ifndef DEFT_SENTENCEPIECE_PLUGIN_PATH
#define DEFT_SENTENCEPIECE_PLUGIN_PATH "libdeft_sentencepiece.so"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define DEFT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DEFT_SANITIZED 1
#endif
#endif

namespace deft::engine {
namespace {

struct Plugin {
  const SentencePiecePluginApi* api = nullptr;
  std::string error;
};

// The dlopen that loads the plugin. The sanitizer runtimes intercept dlopen and refuse
// RTLD_DEEPBIND, because a deep-bound library may bind malloc and free past their interceptors.
// A sanitized build's plugin is itself sanitized: with gcc it lists the runtime (libasan) as its
// first dependency, so its deep-bound lookups still find the runtime's allocator first, and
// libc's own dlopen, called past the interceptor, loads it. Without RTLD_DEEPBIND the plugin's
// protobuf 3.14 would bind to the server's libprotobuf and abort in its version check.
using DlopenFunction = void* (*)(const char*, int);
DlopenFunction plugin_dlopen() {
#ifdef DEFT_SANITIZED
  if (void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD); libc != nullptr) {
    if (auto* libc_dlopen = reinterpret_cast<DlopenFunction>(dlsym(libc, "dlopen"))) {
      return libc_dlopen;
    }
  }
#endif
  return &dlopen;
}

// Loads the plugin once per process: $DEFT_SENTENCEPIECE_PLUGIN, an installed copy
// (<prefix>/bin/../lib/deft/, as `cmake --install` lays it out), the build tree's copy, one beside
// the executable, then the loader's search path.
const Plugin& plugin() {
  static const Plugin loaded = [] {
    Plugin result;
    // RTLD_DEEPBIND keeps libsentencepiece's bundled protobuf private to it (plugin_dlopen()
    // says how sanitized builds do it too).
    const int flags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
    const DlopenFunction open_plugin = plugin_dlopen();
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("DEFT_SENTENCEPIECE_PLUGIN")) candidates.push_back(path);
    std::error_code error;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
    if (!error) {
      candidates.push_back(
          (self.parent_path().parent_path() / "lib" / "deft" / "libdeft_sentencepiece.so")
              .string());
    }
    candidates.push_back(DEFT_SENTENCEPIECE_PLUGIN_PATH);
    if (!error) candidates.push_back((self.parent_path() / "libdeft_sentencepiece.so").string());
    candidates.push_back("libdeft_sentencepiece.so");
    for (const std::string& candidate : candidates) {
      void* handle = open_plugin(candidate.c_str(), flags);
      if (handle == nullptr) {
        result.error += std::string(result.error.empty() ? "" : "; ") + dlerror();
        continue;
      }
      using Entry = const SentencePiecePluginApi* (*)();
      auto entry = reinterpret_cast<Entry>(dlsym(handle, "deft_sentencepiece_plugin_api"));
      if (entry == nullptr || entry()->abi_version != kSentencePiecePluginAbi) {
        result.error += "; " + candidate + ": not a matching deft sentencepiece plugin";
        continue;
      }
      result.api = entry();  // the handle stays open for the life of the process
      result.error.clear();
      break;
    }
    return result;
  }();
  return loaded;
}

}  // namespace

struct SentencePieceBackend::Impl {
  const SentencePiecePluginApi* api = nullptr;
  void* processor = nullptr;
  ~Impl() {
    if (processor != nullptr) api->destroy(processor);
  }
};

std::unique_ptr<SentencePieceBackend> SentencePieceBackend::load(const std::string& path,
                                                                 std::string* error) {
  const Plugin& loaded = plugin();
  if (loaded.api == nullptr) {
    *error = "cannot load the sentencepiece plugin libdeft_sentencepiece.so: " + loaded.error;
    return nullptr;
  }
  auto impl = std::make_unique<Impl>();
  impl->api = loaded.api;
  impl->processor = loaded.api->load(path.c_str(), error);
  if (impl->processor == nullptr) return nullptr;
  return std::unique_ptr<SentencePieceBackend>(new SentencePieceBackend(std::move(impl)));
}

SentencePieceBackend::SentencePieceBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SentencePieceBackend::~SentencePieceBackend() = default;

std::vector<int> SentencePieceBackend::encode(std::string_view text) const {
  std::vector<int> ids;
  impl_->api->encode(impl_->processor, text.data(), text.size(), &ids);
  return ids;
}
std::string SentencePieceBackend::decode(const std::vector<int>& ids) const {
  std::string text;
  impl_->api->decode(impl_->processor, ids.data(), ids.size(), &text);
  return text;
}
int SentencePieceBackend::piece_size() const { return impl_->api->piece_size(impl_->processor); }
const std::string& SentencePieceBackend::id_to_piece(int id) const {
  return *impl_->api->id_to_piece(impl_->processor, id);
}
int SentencePieceBackend::piece_to_id(std::string_view piece) const {
  return impl_->api->piece_to_id(impl_->processor, piece.data(), piece.size());
}
bool SentencePieceBackend::is_control(int id) const {
  return impl_->api->is_control(impl_->processor, id);
}
bool SentencePieceBackend::is_byte(int id) const {
  return impl_->api->is_byte(impl_->processor, id);
}
bool SentencePieceBackend::is_unknown(int id) const {
  return impl_->api->is_unknown(impl_->processor, id);
}
int SentencePieceBackend::bos_id() const { return impl_->api->bos_id(impl_->processor); }
int SentencePieceBackend::eos_id() const { return impl_->api->eos_id(impl_->processor); }
int SentencePieceBackend::unk_id() const { return impl_->api->unk_id(impl_->processor); }

}  // namespace deft::engine
