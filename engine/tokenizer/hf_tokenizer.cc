// Hugging Face tokenizer.json BPE. Supported components (anything else fails to load):
//   model:          BPE (vocab, merges as "a b" strings or [a, b] pairs, unk_token, fuse_unk,
//                   byte_fallback, ignore_merges)
//   normalizer:     null, Prepend, Replace (String pattern), Sequence of these
//   pre_tokenizer:  null, ByteLevel, Split (Regex or String; Isolated or Removed),
//                   Metaspace, Sequence of these
//   decoder:        ByteLevel, Replace (String), ByteFallback, Fuse, Strip, Metaspace, Sequence
//   added_tokens:   content, id, special, lstrip, rstrip
// The pipeline follows the `tokenizers` library: split the text on added tokens, normalize each
// remaining piece, pre-tokenize, run BPE on each pre-token.
#include "engine/tokenizer/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/string_compat.h"
#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace deft::engine {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSentencePieceSpace = "\xE2\x96\x81";  // "▁" U+2581

// Oniguruma (the regex engine of `tokenizers`) reads \s as [\t\n\v\f\r\x85] plus the Unicode
// separators Z; PCRE2 with UCP leaves out U+0085. Spell the class out so both agree.
constexpr std::string_view kOnigSpaceClassBody = "\\t\\n\\x0B\\f\\r\\x{85}\\p{Z}";

std::string onig_compatible_pattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's') {
        if (in_class) {
          out.append(kOnigSpaceClassBody);
        } else {
          absl::StrAppend(&out, "[", to_absl(kOnigSpaceClassBody), "]");
        }
      } else if (next == 'S' && !in_class) {
        absl::StrAppend(&out, "[^", to_absl(kOnigSpaceClassBody), "]");
      } else {
        out.push_back(c);
        out.push_back(next);
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' or '^]' right after '[' is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

// A compiled PCRE2 pattern (UTF + UCP, JIT when available). The compiled code is shared by all
// threads; each match gets its own match data.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> compile(const std::string& pattern,
                                                        std::string_view where) {
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
    if (code == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error_code, message.data(), message.size());
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: regex '%s' does not compile at offset %d: %s", to_absl(where), pattern,
          static_cast<int>(error_offset), reinterpret_cast<const char*>(message.data())));
    }
    // JIT is an optimisation only: without it pcre2_match interprets the pattern.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for each non-overlapping match in `text`, left to right.
  // Returns false when matching failed (a PCRE2 resource limit), not merely ended.
  template <typename OnMatch>
  bool for_each_match(std::string_view text, OnMatch&& on_match) const {
    bool ok = true;
    pcre2_match_data* match_data = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t offset = 0;
    while (offset <= text.size()) {
      // The text was checked to be valid UTF-8 before: skip PCRE2's own check.
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                                 offset, PCRE2_NO_UTF_CHECK, match_data, nullptr);
      if (rc < 0) {
        ok = rc == PCRE2_ERROR_NOMATCH;
        break;
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
      const size_t begin = ovector[0], end = ovector[1];
      if (end > begin) {
        on_match(begin, end);
        offset = end;
      } else {
        // Empty match: step over one character so the loop ends.
        if (begin >= text.size()) break;
        const int length = utf8::sequence_length(text.substr(begin));
        offset = begin + static_cast<size_t>(length > 0 ? length : 1);
      }
    }
    pcre2_match_data_free(match_data);
    return ok;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
// themselves, the others to U+0100 onwards in byte order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;
  absl::flat_hash_map<uint32_t, uint8_t> char_to_byte;

  ByteLevelAlphabet() {
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? b : next_extra++;
      utf8::append_code_point(cp, byte_to_char[b]);
      char_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// Decodes the code point at the start of a valid UTF-8 string; sets `length`.
uint32_t code_point_at(std::string_view text, int* length) {
  const auto b0 = static_cast<uint8_t>(text[0]);
  if (b0 < 0x80) {
    *length = 1;
    return b0;
  }
  *length = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  uint32_t cp = b0 & (0x7F >> *length);
  for (int i = 1; i < *length; ++i) cp = (cp << 6) | (static_cast<uint8_t>(text[i]) & 0x3F);
  return cp;
}

// Maps each character of a byte-level token back to its byte; false when a character is not in
// the byte-level alphabet (added tokens), in which case the token stands for its own UTF-8.
bool byte_level_token_to_bytes(std::string_view token, std::string& out) {
  const auto& alphabet = byte_level_alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    int length = 0;
    const uint32_t cp = code_point_at(token.substr(pos), &length);
    const auto it = alphabet.char_to_byte.find(cp);
    if (it == alphabet.char_to_byte.end()) return false;
    bytes.push_back(static_cast<char>(it->second));
    pos += static_cast<size_t>(length);
  }
  out.append(bytes);
  return true;
}

// "<0x41>" -> 0x41; -1 when the token is not a byte-fallback token.
int byte_fallback_value(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

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

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

absl::Status field_error(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(to_absl(source), ": ", to_absl(field), " ", to_absl(what)));
}

}  // namespace

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

  std::vector<AddedToken> added_tokens;
  // Added tokens by first byte, longest first: leftmost-longest matching.
  std::array<std::vector<size_t>, 256> added_by_first_byte;

  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  bool byte_level = false;
  bool strips_leading_space = false;

  // BPE results per pre-token (short ones only). Cleared when full.
  static constexpr size_t kCacheMaxEntries = 1 << 16;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex;
  mutable absl::flat_hash_map<std::string, std::vector<TokenId>> cache;

  absl::Status parse(const json& root);
  absl::Status parse_model(const json& model);
  absl::Status parse_added_tokens(const json& tokens);
  absl::Status parse_normalizer(const json& node);
  absl::Status parse_pre_tokenizer(const json& node);
  absl::Status parse_decoder(const json& node);
  void guess_bos_eos(const json& root, std::optional<TokenId>* bos,
                     std::vector<TokenId>* eos) const;

  std::vector<Segment> split_on_added_tokens(std::string_view text, bool parse_special) const;
  std::string normalize(std::string_view text) const;
  absl::StatusOr<std::vector<std::string>> pre_tokenize(std::string text, bool first) const;
  absl::Status bpe(std::string_view word, std::vector<TokenId>& out) const;
  absl::Status bpe_uncached(std::string_view word, std::vector<TokenId>& out) const;
  std::string decode_tokens(std::vector<std::string> tokens) const;
};

// --- loading -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::load(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open tokenizer file ", path));
  std::stringstream buffer;
  buffer << file.rdbuf();
  return from_json(buffer.str(), path);
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::from_json(std::string_view json_text,
                                                                    std::string_view source) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(to_absl(source), ": not a JSON object"));
  }
  auto impl = std::make_unique<Impl>();
  impl->source = std::string(source);
  std::optional<TokenId> bos;
  std::vector<TokenId> eos;
  try {
    if (absl::Status status = impl->parse(root); !status.ok()) return status;
    impl->guess_bos_eos(root, &bos, &eos);
  } catch (const json::exception& error) {
    // A field of an unexpected type (json::value() with a default throws on one): the backstop
    // that keeps such a file an error rather than a crash (found by hf_tokenizer_fuzz_test).
    return absl::InvalidArgumentError(absl::StrCat(to_absl(source), ": ", error.what()));
  }
  auto tokenizer = std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
  tokenizer->set_bos_id(bos);
  tokenizer->set_eos_ids(std::move(eos));
  return tokenizer;
}

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

absl::Status HfTokenizer::Impl::parse(const json& root) {
  if (!root.contains("model") || !root["model"].is_object()) {
    return field_error(source, "'model'", "is missing");
  }
  if (absl::Status s = parse_model(root["model"]); !s.ok()) return s;
  if (root.contains("added_tokens")) {
    if (absl::Status s = parse_added_tokens(root["added_tokens"]); !s.ok()) return s;
  }
  if (root.contains("normalizer")) {
    if (absl::Status s = parse_normalizer(root["normalizer"]); !s.ok()) return s;
  }
  if (root.contains("pre_tokenizer")) {
    if (absl::Status s = parse_pre_tokenizer(root["pre_tokenizer"]); !s.ok()) return s;
  }
  if (root.contains("decoder")) {
    if (absl::Status s = parse_decoder(root["decoder"]); !s.ok()) return s;
  }
  for (const DecoderStep& step : decoder) {
    if (step.kind == DecoderStep::Kind::kByteLevel) byte_level = true;
    if (step.kind == DecoderStep::Kind::kStrip && step.a == " " && step.start > 0) {
      strips_leading_space = true;
    }
    if (step.kind == DecoderStep::Kind::kMetaspace && step.metaspace_strip_first) {
      strips_leading_space = true;
    }
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::Impl::parse_model(const json& model) {
  const std::string type = model.value("type", "BPE");
  if (type != "BPE") {
    return field_error(source, "model.type",
                       absl::StrCat("is '", type, "'; only BPE is supported"));
  }
  for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(unsupported) && !model[unsupported].is_null() &&
        !(model[unsupported].is_string() && model[unsupported].get<std::string>().empty())) {
      return field_error(source, absl::StrCat("model.", unsupported), "is set; not supported");
    }
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return field_error(source, "model.vocab", "is missing or not an object");
  }
  TokenId max_id = -1;
  for (const auto& [piece, id_node] : model["vocab"].items()) {
    if (!id_node.is_number_integer() || id_node.get<int64_t>() < 0 ||
        id_node.get<int64_t>() > INT32_MAX) {
      return field_error(source, absl::StrCat("model.vocab[\"", piece, "\"]"),
                         "is not a valid token id");
    }
    const auto id = static_cast<TokenId>(id_node.get<int64_t>());
    vocab[piece] = id;
    max_id = std::max(max_id, id);
  }
  id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [piece, id] : vocab) id_to_token[static_cast<size_t>(id)] = piece;

  byte_fallback = model.value("byte_fallback", false);
  fuse_unk = model.value("fuse_unk", false);
  ignore_merges = model.value("ignore_merges", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const std::string unk = model["unk_token"].get<std::string>();
    const auto it = vocab.find(unk);
    if (it == vocab.end()) {
      return field_error(source, "model.unk_token",
                         absl::StrCat("'", unk, "' is not in model.vocab"));
    }
    unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab.find(absl::StrFormat("<0x%02X>", b));
    byte_token_ids[static_cast<size_t>(b)] = it == vocab.end() ? -1 : it->second;
  }

  if (!model.contains("merges") || !model["merges"].is_array()) {
    return field_error(source, "model.merges", "is missing or not an array");
  }
  const json& merge_list = model["merges"];
  merges.reserve(merge_list.size());
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const json& entry = merge_list[rank];
    std::string left, right;
    if (entry.is_string()) {
      const std::string text = entry.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        return field_error(source, absl::StrCat("model.merges[", rank, "]"),
                           absl::StrCat("'", text, "' is not two tokens separated by a space"));
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else {
      return field_error(source, absl::StrCat("model.merges[", rank, "]"),
                         "is neither \"a b\" nor [\"a\", \"b\"]");
    }
    const auto left_it = vocab.find(left);
    const auto right_it = vocab.find(right);
    const auto merged_it = vocab.find(left + right);
    if (left_it == vocab.end() || right_it == vocab.end() || merged_it == vocab.end()) {
      return field_error(source, absl::StrCat("model.merges[", rank, "]"),
                         absl::StrCat("'", left, " ", right, "' uses a token not in model.vocab"));
    }
    const uint64_t key =
        (static_cast<uint64_t>(left_it->second) << 32) | static_cast<uint32_t>(right_it->second);
    // The first (lowest-rank) occurrence of a pair wins.
    merges.try_emplace(key, static_cast<int32_t>(rank), merged_it->second);
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::Impl::parse_added_tokens(const json& tokens) {
  if (!tokens.is_array()) return field_error(source, "added_tokens", "is not an array");
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& entry = tokens[i];
    if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer() ||
        !entry.contains("content") || !entry["content"].is_string()) {
      return field_error(source, absl::StrCat("added_tokens[", i, "]"),
                         "needs an integer 'id' and a string 'content'");
    }
    AddedToken token;
    token.id = entry["id"].get<TokenId>();
    token.content = entry["content"].get<std::string>();
    token.special = entry.value("special", false);
    token.lstrip = entry.value("lstrip", false);
    token.rstrip = entry.value("rstrip", false);
    if (token.id < 0 || token.content.empty()) {
      return field_error(source, absl::StrCat("added_tokens[", i, "]"),
                         "has a negative id or empty content");
    }
    if (static_cast<size_t>(token.id) >= id_to_token.size()) {
      id_to_token.resize(static_cast<size_t>(token.id) + 1);
    }
    id_to_token[static_cast<size_t>(token.id)] = token.content;
    vocab[token.content] = token.id;
    added_tokens.push_back(std::move(token));
  }
  id_is_special.assign(id_to_token.size(), 0);
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const AddedToken& token = added_tokens[i];
    if (token.special) id_is_special[static_cast<size_t>(token.id)] = 1;
    added_by_first_byte[static_cast<uint8_t>(token.content[0])].push_back(i);
  }
  for (auto& candidates : added_by_first_byte) {
    std::stable_sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
      return added_tokens[a].content.size() > added_tokens[b].content.size();
    });
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::Impl::parse_normalizer(const json& node) {
  if (node.is_null()) return absl::OkStatus();
  const std::string type = node.value("type", "");
  if (type == "Sequence") {
    for (const json& child : node.value("normalizers", json::array())) {
      if (absl::Status s = parse_normalizer(child); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (type == "Prepend") {
    normalizer.push_back({NormalizerStep::Kind::kPrepend, node.value("prepend", ""), ""});
    return absl::OkStatus();
  }
  if (type == "Replace") {
    const json& pattern = node.value("pattern", json::object());
    if (!pattern.contains("String")) {
      return field_error(source, "normalizer.Replace.pattern",
                         "is not a String pattern; unsupported");
    }
    normalizer.push_back({NormalizerStep::Kind::kReplace, pattern["String"].get<std::string>(),
                          node.value("content", "")});
    return absl::OkStatus();
  }
  return field_error(source, "normalizer.type", absl::StrCat("'", type, "' is not supported"));
}

absl::Status HfTokenizer::Impl::parse_pre_tokenizer(const json& node) {
  if (node.is_null()) return absl::OkStatus();
  const std::string type = node.value("type", "");
  if (type == "Sequence") {
    for (const json& child : node.value("pretokenizers", json::array())) {
      if (absl::Status s = parse_pre_tokenizer(child); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  PreTokenizerStep step;
  if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = node.value("add_prefix_space", false);
    step.use_regex = node.value("use_regex", true);
    if (step.use_regex) {
      // GPT-2's pre-tokenizer pattern, which ByteLevel applies when use_regex is set.
      auto regex = Regex::compile(
          onig_compatible_pattern(
              R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"),
          absl::StrCat(source, ": pre_tokenizer ByteLevel"));
      if (!regex.ok()) return regex.status();
      step.regex = std::move(*regex);
    }
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    if (node.value("invert", false)) {
      return field_error(source, "pre_tokenizer.Split.invert", "is true; not supported");
    }
    const std::string behavior = node.value("behavior", "Isolated");
    if (behavior != "Isolated" && behavior != "Removed") {
      return field_error(source, "pre_tokenizer.Split.behavior",
                         absl::StrCat("'", behavior, "' is not supported (Isolated, Removed)"));
    }
    step.removed = behavior == "Removed";
    const json& pattern = node.value("pattern", json::object());
    std::string regex_text;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      regex_text = onig_compatible_pattern(pattern["Regex"].get<std::string>());
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      // A literal: quote it for PCRE2.
      regex_text = absl::StrCat("\\Q", pattern["String"].get<std::string>(), "\\E");
    } else {
      return field_error(source, "pre_tokenizer.Split.pattern", "has neither Regex nor String");
    }
    auto regex = Regex::compile(regex_text, absl::StrCat(source, ": pre_tokenizer.Split.pattern"));
    if (!regex.ok()) return regex.status();
    step.regex = std::move(*regex);
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    step.replacement = node.value("replacement", std::string(kSentencePieceSpace));
    const std::string scheme =
        node.value("prepend_scheme", node.value("add_prefix_space", true) ? "always" : "never");
    step.prepend = scheme == "first"   ? PreTokenizerStep::Prepend::kFirst
                   : scheme == "never" ? PreTokenizerStep::Prepend::kNever
                                       : PreTokenizerStep::Prepend::kAlways;
    step.split = node.value("split", true);
  } else {
    return field_error(source, "pre_tokenizer.type", absl::StrCat("'", type, "' is not supported"));
  }
  pre_tokenizer.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status HfTokenizer::Impl::parse_decoder(const json& node) {
  if (node.is_null()) return absl::OkStatus();
  const std::string type = node.value("type", "");
  if (type == "Sequence") {
    for (const json& child : node.value("decoders", json::array())) {
      if (absl::Status s = parse_decoder(child); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  DecoderStep step;
  if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    const json& pattern = node.value("pattern", json::object());
    if (!pattern.contains("String")) {
      return field_error(source, "decoder.Replace.pattern", "is not a String pattern; unsupported");
    }
    step.a = pattern["String"].get<std::string>();
    step.b = node.value("content", "");
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    step.a = node.value("content", " ");
    step.start = node.value("start", 0);
    step.stop = node.value("stop", 0);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    step.a = node.value("replacement", std::string(kSentencePieceSpace));
    const std::string scheme =
        node.value("prepend_scheme", node.value("add_prefix_space", true) ? "always" : "never");
    step.metaspace_strip_first = scheme != "never";
  } else {
    return field_error(source, "decoder.type", absl::StrCat("'", type, "' is not supported"));
  }
  decoder.push_back(std::move(step));
  return absl::OkStatus();
}

void HfTokenizer::Impl::guess_bos_eos(const json& root, std::optional<TokenId>* bos,
                                      std::vector<TokenId>* eos) const {
  auto find = [&](std::string_view piece) -> std::optional<TokenId> {
    const auto it = vocab.find(to_absl(piece));
    if (it == vocab.end()) return std::nullopt;
    return it->second;
  };
  // A TemplateProcessing post-processor names the BOS it adds ("<s>" $A).
  const json& post = root.value("post_processor", json());
  if (post.is_object() && post.value("type", "") == "TemplateProcessing" &&
      post.contains("single") && post["single"].is_array() && !post["single"].empty()) {
    const json& first = post["single"][0];
    if (first.contains("SpecialToken")) {
      *bos = find(first["SpecialToken"].value("id", ""));
    }
  }
  for (std::string_view candidate : {"<|begin_of_text|>", "<s>", "<bos>"}) {
    if (!bos->has_value()) *bos = find(candidate);
  }
  for (std::string_view candidate : {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"}) {
    if (const auto id = find(candidate)) {
      eos->push_back(*id);
      break;
    }
  }
}

// --- encoding ----------------------------------------------------------------------------

std::vector<Segment> HfTokenizer::Impl::split_on_added_tokens(std::string_view text,
                                                              bool parse_special) const {
  std::vector<Segment> segments;
  size_t text_start = 0;  // start of the pending plain-text run
  size_t pos = 0;
  auto push_text = [&](size_t begin, size_t end) {
    if (end > begin) segments.push_back({text.substr(begin, end - begin), -1, begin == 0});
  };
  while (pos < text.size()) {
    const auto& candidates = added_by_first_byte[static_cast<uint8_t>(text[pos])];
    const AddedToken* match = nullptr;
    for (size_t index : candidates) {
      const AddedToken& token = added_tokens[index];
      if (token.special && !parse_special) continue;
      if (text.compare(pos, token.content.size(), token.content) == 0) {
        match = &token;  // candidates are sorted longest first
        break;
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    size_t text_end = pos;
    if (match->lstrip) {
      while (text_end > text_start && is_ascii_space(text[text_end - 1])) --text_end;
    }
    push_text(text_start, text_end);
    segments.push_back({std::string_view(), match->id, false});
    pos += match->content.size();
    if (match->rstrip) {
      while (pos < text.size() && is_ascii_space(text[pos])) ++pos;
    }
    text_start = pos;
  }
  push_text(text_start, text.size());
  return segments;
}

std::string HfTokenizer::Impl::normalize(std::string_view text) const {
  std::string normalized(text);
  for (const NormalizerStep& step : normalizer) {
    switch (step.kind) {
      case NormalizerStep::Kind::kPrepend:
        if (!normalized.empty()) normalized.insert(0, step.a);
        break;
      case NormalizerStep::Kind::kReplace:
        if (!step.a.empty()) normalized = replace_all(normalized, step.a, step.b);
        break;
    }
  }
  return normalized;
}

absl::StatusOr<std::vector<std::string>> HfTokenizer::Impl::pre_tokenize(std::string text,
                                                                         bool first) const {
  std::vector<std::string> pieces;
  bool regex_ok = true;
  pieces.push_back(std::move(text));
  for (const PreTokenizerStep& step : pre_tokenizer) {
    std::vector<std::string> next;
    next.reserve(pieces.size());
    for (std::string& piece : pieces) {
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit: {
          size_t gap_start = 0;
          regex_ok &= step.regex->for_each_match(piece, [&](size_t begin, size_t end) {
            if (begin > gap_start) next.push_back(piece.substr(gap_start, begin - gap_start));
            if (!step.removed) next.push_back(piece.substr(begin, end - begin));
            gap_start = end;
          });
          if (gap_start < piece.size()) next.push_back(piece.substr(gap_start));
          break;
        }
        case PreTokenizerStep::Kind::kByteLevel: {
          if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece.insert(0, " ");
          std::vector<std::string> words;
          if (step.use_regex) {
            size_t gap_start = 0;
            regex_ok &= step.regex->for_each_match(piece, [&](size_t begin, size_t end) {
              if (begin > gap_start) words.push_back(piece.substr(gap_start, begin - gap_start));
              words.push_back(piece.substr(begin, end - begin));
              gap_start = end;
            });
            if (gap_start < piece.size()) words.push_back(piece.substr(gap_start));
          } else {
            words.push_back(std::move(piece));
          }
          const auto& alphabet = byte_level_alphabet();
          for (const std::string& word : words) {
            std::string mapped;
            mapped.reserve(word.size() * 2);
            for (char c : word) mapped.append(alphabet.byte_to_char[static_cast<uint8_t>(c)]);
            next.push_back(std::move(mapped));
          }
          break;
        }
        case PreTokenizerStep::Kind::kMetaspace: {
          std::string replaced = replace_all(piece, " ", step.replacement);
          const bool prepend = step.prepend == PreTokenizerStep::Prepend::kAlways ||
                               (step.prepend == PreTokenizerStep::Prepend::kFirst && first);
          if (prepend && !replaced.starts_with(step.replacement)) {
            replaced.insert(0, step.replacement);
          }
          if (!step.split) {
            next.push_back(std::move(replaced));
            break;
          }
          // Split before each replacement character (MergedWithNext).
          size_t start = 0;
          size_t found = replaced.find(step.replacement, 1);
          while (found != std::string::npos) {
            next.push_back(replaced.substr(start, found - start));
            start = found;
            found = replaced.find(step.replacement, found + step.replacement.size());
          }
          next.push_back(replaced.substr(start));
          break;
        }
      }
    }
    pieces = std::move(next);
  }
  if (!regex_ok) {
    return absl::ResourceExhaustedError(
        absl::StrCat(source, ": the pre-tokenizer regex hit a PCRE2 matching limit"));
  }
  std::erase_if(pieces, [](const std::string& piece) { return piece.empty(); });
  return pieces;
}

absl::Status HfTokenizer::Impl::bpe(std::string_view word, std::vector<TokenId>& out) const {
  if (ignore_merges) {
    const auto it = vocab.find(to_absl(word));
    if (it != vocab.end()) {
      out.push_back(it->second);
      return absl::OkStatus();
    }
  }
  if (word.size() > kCacheMaxWordBytes) return bpe_uncached(word, out);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(to_absl(word));
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return absl::OkStatus();
    }
  }
  std::vector<TokenId> ids;
  if (absl::Status status = bpe_uncached(word, ids); !status.ok()) return status;
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheMaxEntries) cache.clear();
  cache.emplace(std::string(word), std::move(ids));
  return absl::OkStatus();
}

absl::Status HfTokenizer::Impl::bpe_uncached(std::string_view word,
                                             std::vector<TokenId>& out) const {
  // Symbols: one per character (or per byte for byte fallback), as a linked list.
  struct Symbol {
    TokenId id;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto push_symbol = [&](TokenId id) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  };
  bool last_was_unk = false;
  size_t pos = 0;
  while (pos < word.size()) {
    const int length = std::max(1, utf8::sequence_length(word.substr(pos)));
    const std::string_view character = word.substr(pos, static_cast<size_t>(length));
    pos += static_cast<size_t>(length);
    const auto it = vocab.find(to_absl(character));
    if (it != vocab.end()) {
      push_symbol(it->second);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback) {
      bool all_bytes = true;
      for (char c : character) all_bytes &= byte_token_ids[static_cast<uint8_t>(c)] >= 0;
      if (all_bytes) {
        for (char c : character) push_symbol(byte_token_ids[static_cast<uint8_t>(c)]);
        last_was_unk = false;
        continue;
      }
    }
    if (!unk_id.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": character '", to_absl(character),
                       "' has no token and the model has no unk_token"));
    }
    if (fuse_unk && last_was_unk) continue;
    push_symbol(*unk_id);
    last_was_unk = true;
  }
  if (symbols.empty()) return absl::OkStatus();
  symbols.back().next = -1;

  // Merge the lowest-rank adjacent pair first; among equal ranks the leftmost (as `tokenizers`).
  struct Candidate {
    int32_t rank;
    int32_t left;  // index of the left symbol
    TokenId left_id;
    TokenId right_id;
    TokenId merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : left > other.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const TokenId left_id = symbols[static_cast<size_t>(left)].id;
    const TokenId right_id = symbols[static_cast<size_t>(right)].id;
    const uint64_t key = (static_cast<uint64_t>(left_id) << 32) | static_cast<uint32_t>(right_id);
    const auto it = merges.find(key);
    if (it != merges.end())
      queue.push({it->second.first, left, left_id, right_id, it->second.second});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  std::vector<uint8_t> dead(symbols.size(), 0);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<size_t>(top.left)];
    if (dead[static_cast<size_t>(top.left)] || left.id != top.left_id || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    if (right.id != top.right_id) continue;  // stale: the right neighbour changed
    left.id = top.merged_id;
    dead[static_cast<size_t>(left.next)] = 1;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.left;
    consider(left.prev);
    consider(top.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
    out.push_back(symbols[static_cast<size_t>(i)].id);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TokenId>> HfTokenizer::encode(std::string_view text, bool add_bos,
                                                         bool parse_special) const {
  if (!utf8::is_valid(text)) {
    return absl::InvalidArgumentError("text to encode is not valid UTF-8");
  }
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 2);
  if (add_bos && bos_id_.has_value()) ids.push_back(*bos_id_);
  for (const Segment& segment : impl_->split_on_added_tokens(text, parse_special)) {
    if (segment.added_id >= 0) {
      ids.push_back(segment.added_id);
      continue;
    }
    auto words = impl_->pre_tokenize(impl_->normalize(segment.text), segment.first);
    if (!words.ok()) return words.status();
    for (const std::string& word : *words) {
      if (absl::Status status = impl_->bpe(word, ids); !status.ok()) return status;
    }
  }
  return ids;
}

// --- decoding ----------------------------------------------------------------------------

std::string HfTokenizer::Impl::decode_tokens(std::vector<std::string> tokens) const {
  for (const DecoderStep& step : decoder) {
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        for (std::string& token : tokens) token = replace_all(token, step.a, step.b);
        break;
      case DecoderStep::Kind::kByteFallback: {
        // Runs of <0xXX> tokens become their bytes when those are valid UTF-8, else one U+FFFD
        // per byte (as `tokenizers` does).
        std::vector<std::string> next;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (utf8::is_valid(run)) {
            next.push_back(run);
          } else {
            for (size_t i = 0; i < run_tokens; ++i) next.emplace_back(utf8::kReplacementChar);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& token : tokens) {
          const int value = byte_fallback_value(token);
          if (value >= 0) {
            run.push_back(static_cast<char>(value));
            ++run_tokens;
          } else {
            flush();
            next.push_back(std::move(token));
          }
        }
        flush();
        tokens = std::move(next);
        break;
      }
      case DecoderStep::Kind::kFuse: {
        std::string fused;
        for (const std::string& token : tokens) fused += token;
        tokens.assign(1, std::move(fused));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (std::string& token : tokens) {
          for (int i = 0; i < step.start && token.starts_with(step.a); ++i)
            token.erase(0, step.a.size());
          for (int i = 0; i < step.stop && token.ends_with(step.a); ++i) {
            token.erase(token.size() - step.a.size());
          }
        }
        break;
      case DecoderStep::Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& token : tokens) {
          if (!byte_level_token_to_bytes(token, bytes)) bytes += token;
        }
        std::string text;
        utf8::append_lossy(bytes, text);
        tokens.assign(1, std::move(text));
        break;
      }
      case DecoderStep::Kind::kMetaspace:
        // As `tokenizers` does: every "▁" of the first token is dropped (not only a leading
        // one) unless the prepend scheme is "never"; elsewhere "▁" becomes a space.
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && step.metaspace_strip_first;
          tokens[i] = replace_all(tokens[i], step.a, drop ? "" : " ");
        }
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

std::string HfTokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (TokenId id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special && is_special(id)) continue;
    tokens.push_back(impl_->id_to_token[static_cast<size_t>(id)]);
  }
  return impl_->decode_tokens(std::move(tokens));
}

std::string HfTokenizer::token_bytes(TokenId id, bool skip_special) const {
  if (id < 0 || id >= vocab_size()) return {};
  if (skip_special && is_special(id)) return {};
  std::string token = impl_->id_to_token[static_cast<size_t>(id)];
  // The decoder chain on one token, raw: bytes are not made valid UTF-8 and the leading-space
  // strip is left to the caller (decode_strips_leading_space()).
  for (const DecoderStep& step : impl_->decoder) {
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        token = replace_all(token, step.a, step.b);
        break;
      case DecoderStep::Kind::kByteFallback:
        if (const int value = byte_fallback_value(token); value >= 0) {
          token.assign(1, static_cast<char>(value));
        }
        break;
      case DecoderStep::Kind::kByteLevel: {
        std::string bytes;
        if (byte_level_token_to_bytes(token, bytes)) token = std::move(bytes);
        break;
      }
      case DecoderStep::Kind::kMetaspace:
        token = replace_all(token, step.a, " ");
        break;
      case DecoderStep::Kind::kFuse:
      case DecoderStep::Kind::kStrip:
        break;
    }
  }
  return token;
}

std::string HfTokenizer::token_to_piece(TokenId id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return impl_->id_to_token[static_cast<size_t>(id)];
}

bool HfTokenizer::decode_strips_leading_space() const { return impl_->strips_leading_space; }

int32_t HfTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }

std::optional<TokenId> HfTokenizer::token_id(std::string_view piece) const {
  const auto it = impl_->vocab.find(to_absl(piece));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

bool HfTokenizer::is_special(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_is_special.size() &&
         impl_->id_is_special[static_cast<size_t>(id)] != 0;
}

bool HfTokenizer::is_byte_level() const { return impl_->byte_level; }

}  // namespace deft::engine
