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
// Loading lives in hf_tokenizer_json.cc, the parsed form in hf_tokenizer_impl.h, the regex in
// pcre_regex.{h,cc} and the byte-level alphabet in byte_level.{h,cc}; this file encodes and
// decodes.
#include "engine/tokenizer/hf_tokenizer.h"

#include <algorithm>
#include <mutex>
#include <queue>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/byte_level.h"
#include "engine/tokenizer/hf_tokenizer_impl.h"
#include "engine/tokenizer/string_compat.h"
#include "engine/tokenizer/utf8.h"

namespace deft::engine {
namespace {

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

using hf::AddedToken;
using hf::byte_fallback_value;
using hf::byte_level_alphabet;
using hf::byte_level_token_to_bytes;
using hf::DecoderStep;
using hf::NormalizerStep;
using hf::PreTokenizerStep;
using hf::Segment;

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

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
