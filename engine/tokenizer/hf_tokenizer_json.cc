// HfTokenizer loading: reads tokenizer.json into HfTokenizer::Impl. Accepts the components
// listed at the top of hf_tokenizer.cc; anything else fails with a message naming the field.
#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/hf_tokenizer_impl.h"
#include "engine/tokenizer/pcre_regex.h"
#include "engine/tokenizer/string_compat.h"
#include "nlohmann/json.hpp"

namespace deft::engine {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSentencePieceSpace = "\xE2\x96\x81";  // "▁" U+2581

absl::Status field_error(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(to_absl(source), ": ", to_absl(field), " ", to_absl(what)));
}

}  // namespace

using hf::AddedToken;
using hf::DecoderStep;
using hf::NormalizerStep;
using hf::onig_compatible_pattern;
using hf::PreTokenizerStep;
using hf::Regex;

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

}  // namespace deft::engine
