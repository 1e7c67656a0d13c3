// Internal to HfTokenizer: the parsed form of a tokenizer.json (HfTokenizer::Impl and the
// pipeline steps it holds). Shared by hf_tokenizer_json.cc, which fills it from the JSON, and
// hf_tokenizer.cc, which encodes and decodes with it; include it nowhere else.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/pcre_regex.h"
#include "nlohmann/json_fwd.hpp"

namespace deft::engine {
namespace hf {

struct NormalizerStep {
  enum class Kind { kPrepend, kReplace } kind;
  std::string a;  // prepend text, or replace pattern
  std::string b;  // replace content
};

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kSplit, kMetaspace } kind;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = false;
  // Split (and ByteLevel with use_regex)
  std::unique_ptr<Regex> regex;
  bool removed = false;  // Split behavior "Removed" (else "Isolated")
  // Metaspace
  std::string replacement;
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = false;
};

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // Replace: pattern, content; Strip: content; Metaspace: replacement
  int start = 0, stop = 0;
  bool metaspace_strip_first = true;
};

struct AddedToken {
  TokenId id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
};

// One piece of the input after splitting on added tokens.
struct Segment {
  std::string_view text;  // when added_id < 0
  TokenId added_id = -1;
  bool first = false;  // starts at offset 0 of the input (Metaspace "first")
};

}  // namespace hf

struct HfTokenizer::Impl {
  std::string source;                               // file name, for messages
  absl::flat_hash_map<std::string, TokenId> vocab;  // model vocabulary and added tokens
  std::vector<std::string> id_to_token;
  std::vector<uint8_t> id_is_special;
  // (left id << 32 | right id) -> (rank, merged id)
  absl::flat_hash_map<uint64_t, std::pair<int32_t, TokenId>> merges;
  std::optional<TokenId> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<TokenId, 256> byte_token_ids{};  // <0xXX> ids, -1 when absent

  std::vector<hf::AddedToken> added_tokens;
  // Added tokens by first byte, longest first: leftmost-longest matching.
  std::array<std::vector<size_t>, 256> added_by_first_byte;

  std::vector<hf::NormalizerStep> normalizer;
  std::vector<hf::PreTokenizerStep> pre_tokenizer;
  std::vector<hf::DecoderStep> decoder;
  bool byte_level = false;
  bool strips_leading_space = false;

  // BPE results per pre-token (short ones only). Cleared when full.
  static constexpr size_t kCacheMaxEntries = 1 << 16;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex;
  mutable absl::flat_hash_map<std::string, std::vector<TokenId>> cache;

  // Filled from tokenizer.json (hf_tokenizer_json.cc); errors name the bad field.
  absl::Status parse(const nlohmann::json& root);
  absl::Status parse_model(const nlohmann::json& model);
  absl::Status parse_added_tokens(const nlohmann::json& tokens);
  absl::Status parse_normalizer(const nlohmann::json& node);
  absl::Status parse_pre_tokenizer(const nlohmann::json& node);
  absl::Status parse_decoder(const nlohmann::json& node);
  void guess_bos_eos(const nlohmann::json& root, std::optional<TokenId>* bos,
                     std::vector<TokenId>* eos) const;

  // Encoding and decoding (hf_tokenizer.cc).
  std::vector<hf::Segment> split_on_added_tokens(std::string_view text, bool parse_special) const;
  std::string normalize(std::string_view text) const;
  absl::StatusOr<std::vector<std::string>> pre_tokenize(std::string text, bool first) const;
  absl::Status bpe(std::string_view word, std::vector<TokenId>& out) const;
  absl::Status bpe_uncached(std::string_view word, std::vector<TokenId>& out) const;
  std::string decode_tokens(std::vector<std::string> tokens) const;
};

}  // namespace deft::engine
