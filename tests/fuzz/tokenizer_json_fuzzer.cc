// libFuzzer harness: tokenizer.json loading and use (engine/tokenizer/hf_tokenizer.h). The input
// is a tokenizer.json document, then a NUL byte, then a text (no NUL: the whole input is the
// document and the text is empty). Half of the mutations are JSON-aware on the document
// (tests/fuzz/json_mutator.h).
// Contracts checked (engine/tokenizer/tokenizer.h):
//   - from_json refuses with INVALID_ARGUMENT naming the file, never crashes or throws;
//   - a loaded tokenizer encodes any valid UTF-8 text (with and without BOS and special-token
//     parsing) to ids inside its vocabulary, refuses invalid UTF-8, and refuses valid text only
//     for a character it has no token for (a vocabulary without unk_token, byte fallback or a
//     whole byte-level alphabet: engine/tokenizer/tokenizer.h), decodes any ids (those
//     outside the vocabulary skipped) to valid UTF-8, and answers token_bytes / token_to_piece
//     for every id;
//   - round trip, where the tokenizer guarantees it: decode(encode(text)) == text for valid
//     UTF-8 text, encoded without BOS and with special-token strings kept as text, on
//     byte-level BPE (lossless: every byte has a token) and on sentencepiece-style BPE with byte
//     fallback when the text holds no U+2581 "▁" (the normalizer turns spaces into it and the
//     decoder turns it back into spaces). Checked on the two small tokenizers of
//     tests/engine/tokenizer_test_util.h and, when scripts/fetch_tokenizers.sh has fetched them
//     ($DEFT_TOKENIZERS_DIR or <source>/.cache/tokenizers), the real Llama 3 and Llama 2 files.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/utf8.h"
#include "tests/engine/tokenizer_test_util.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/json_mutator.h"

namespace {

using deft::engine::HfTokenizer;
using deft::engine::TokenId;

constexpr std::string_view kSourceName = "fuzz/tokenizer.json";
constexpr std::string_view kMetaspace = "\xE2\x96\x81";

struct ReferenceTokenizer {
  std::string name;
  std::unique_ptr<HfTokenizer> tokenizer;
};

std::vector<ReferenceTokenizer>& reference_tokenizers() {
  static std::vector<ReferenceTokenizer> tokenizers = [] {
    namespace testing = deft::engine::testing;
    std::vector<ReferenceTokenizer> loaded;
    const auto add = [&](std::string name, absl::StatusOr<std::unique_ptr<HfTokenizer>> made) {
      FUZZ_CHECK(made.ok(), absl::StrCat(name, ": ", made.status().ToString()));
      loaded.push_back({std::move(name), std::move(*made)});
    };
    add("tiny byte-level", HfTokenizer::from_json(testing::tiny_byte_level_json().dump(), "tiny"));
    add("tiny sentencepiece-style",
        HfTokenizer::from_json(testing::tiny_sentencepiece_json().dump(), "tiny"));
    for (const char* real : {"llama3", "llama2"}) {
      const std::filesystem::path dir = testing::real_tokenizer_dir(real);
      if (!dir.empty()) add(real, HfTokenizer::load((dir / "tokenizer.json").string()));
    }
    return loaded;
  }();
  return tokenizers;
}

std::string escaped(std::string_view bytes) {
  bytes = bytes.substr(0, 200);
  return absl::CHexEscape(absl::string_view(bytes.data(), bytes.size()));
}

// Every contract of a loaded tokenizer on `text`.
void check_tokenizer(const HfTokenizer& tokenizer, std::string_view text) {
  const int32_t vocab_size = tokenizer.vocab_size();
  FUZZ_CHECK(vocab_size >= 0, absl::StrCat("vocab_size ", vocab_size));
  const bool valid_text = deft::engine::utf8::is_valid(text);
  for (const bool add_bos : {false, true}) {
    for (const bool parse_special : {false, true}) {
      const absl::StatusOr<std::vector<TokenId>> ids =
          tokenizer.encode(text, add_bos, parse_special);
      FUZZ_CHECK(valid_text || !ids.ok(),
                 absl::StrCat("encode accepted invalid UTF-8 \"", escaped(text), "\""));
      if (!ids.ok()) {
        FUZZ_CHECK(ids.status().code() == absl::StatusCode::kInvalidArgument &&
                       (!valid_text || deft::fuzz::mentions(ids.status(), "has no token")),
                   absl::StrCat("encode of \"", escaped(text), "\": ", ids.status().ToString()));
        continue;
      }
      for (TokenId id : *ids) {
        FUZZ_CHECK(id >= 0 && id < vocab_size,
                   absl::StrCat("encode gave id ", id, " outside [0, ", vocab_size, ")"));
        tokenizer.token_bytes(id);
        tokenizer.token_to_piece(id);
      }
      for (const bool skip_special : {false, true}) {
        const std::string decoded = tokenizer.decode(*ids, skip_special);
        FUZZ_CHECK(deft::engine::utf8::is_valid(decoded),
                   absl::StrCat("decode gave invalid UTF-8 \"", escaped(decoded), "\""));
      }
    }
  }
  // Arbitrary ids, many outside the vocabulary: skipped, never read.
  std::vector<TokenId> raw_ids;
  for (size_t i = 0; i + 4 <= text.size() && raw_ids.size() < 64; i += 4) {
    TokenId id = 0;
    std::memcpy(&id, text.data() + i, sizeof(id));
    raw_ids.push_back(i % 8 == 0 && vocab_size > 0
                          ? static_cast<TokenId>(static_cast<uint32_t>(id) % vocab_size)
                          : id);
  }
  const std::string decoded = tokenizer.decode(raw_ids);
  FUZZ_CHECK(deft::engine::utf8::is_valid(decoded), "decode of raw ids gave invalid UTF-8");
  for (TokenId id : raw_ids) {
    tokenizer.token_bytes(id, /*skip_special=*/true);
    tokenizer.token_to_piece(id);
    tokenizer.is_special(id);
  }
}

void check_round_trip(const ReferenceTokenizer& reference, std::string_view text) {
  const HfTokenizer& tokenizer = *reference.tokenizer;
  if (!tokenizer.is_byte_level() && text.find(kMetaspace) != std::string_view::npos) return;
  const absl::StatusOr<std::vector<TokenId>> ids =
      tokenizer.encode(text, /*add_bos=*/false, /*parse_special=*/false);
  FUZZ_CHECK(ids.ok(), absl::StrCat(reference.name, ": ", ids.status().ToString()));
  const std::string decoded = tokenizer.decode(*ids);
  FUZZ_CHECK(decoded == text, absl::StrCat(reference.name, ": decode(encode(\"", escaped(text),
                                           "\")) = \"", escaped(decoded), "\""));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  reference_tokenizers();  // loads the real files once, before the clock of the first input
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t separator = input.find('\0');
  const std::string_view document = input.substr(0, separator);
  const std::string_view text =
      separator == std::string_view::npos ? std::string_view() : input.substr(separator + 1);

  const absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer =
      HfTokenizer::from_json(document, kSourceName);
  if (tokenizer.ok()) {
    check_tokenizer(**tokenizer, text);
  } else {
    FUZZ_CHECK(tokenizer.status().code() == absl::StatusCode::kInvalidArgument,
               tokenizer.status().ToString());
    FUZZ_CHECK(deft::fuzz::mentions(tokenizer.status(), kSourceName),
               tokenizer.status().ToString());
  }
  if (deft::engine::utf8::is_valid(text)) {
    for (const ReferenceTokenizer& reference : reference_tokenizers()) {
      check_round_trip(reference, text);
    }
  }
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return deft::fuzz::mutate_json(data, size, max_size, seed, /*prefix_bytes=*/0,
                                 /*ends_at_nul=*/true);
}
