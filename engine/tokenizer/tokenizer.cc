#include "engine/tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/sentencepiece_tokenizer.h"
#include "engine/tokenizer/string_compat.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace deft::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Reads an optional JSON file: nullopt when absent, an error when present but unreadable.
absl::StatusOr<std::optional<json>> read_optional_json(const fs::path& path) {
  std::error_code error;
  if (!fs::exists(path, error)) return std::optional<json>();
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::stringstream buffer;
  buffer << file.rdbuf();
  json root = json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  }
  return std::optional<json>(std::move(root));
}

// tokenizer_config.json names tokens as a string or as {"content": "..."} (AddedToken).
absl::StatusOr<std::optional<TokenId>> config_token(const Tokenizer& tokenizer, const json& config,
                                                    const std::string& field,
                                                    const fs::path& path) {
  if (!config.contains(field) || config[field].is_null()) return std::optional<TokenId>();
  const json& node = config[field];
  std::string content;
  if (node.is_string()) {
    content = node.get<std::string>();
  } else if (node.is_object() && node.contains("content") && node["content"].is_string()) {
    content = node["content"].get<std::string>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": field '", field, "' is neither a string nor {content}"));
  }
  const std::optional<TokenId> id = tokenizer.token_id(content);
  if (!id.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": field '", field, "' is '",
                                                   content, "', which is not in the vocabulary"));
  }
  return id;
}

absl::StatusOr<TokenId> config_id(const Tokenizer& tokenizer, const json& node,
                                  const std::string& field, const fs::path& path) {
  if (!node.is_number_integer() || node.get<int64_t>() < 0 ||
      node.get<int64_t>() >= tokenizer.vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": field '", field, "' is ",
                                                   node.dump(), ", not a token id below ",
                                                   tokenizer.vocab_size()));
  }
  return static_cast<TokenId>(node.get<int64_t>());
}

std::string_view trim_ascii_space(std::string_view text) {
  constexpr std::string_view kSpace = " \t\n\r\v\f";
  const size_t begin = text.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  const size_t end = text.find_last_not_of(kSpace);
  return text.substr(begin, end - begin + 1);
}

}  // namespace

bool Tokenizer::is_eos(TokenId id) const {
  return std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& model_dir) {
  const fs::path dir(model_dir);
  std::unique_ptr<Tokenizer> tokenizer;
  std::error_code error;
  if (fs::exists(dir / "tokenizer.json", error)) {
    auto loaded = HfTokenizer::load((dir / "tokenizer.json").string());
    if (!loaded.ok()) return loaded.status();
    tokenizer = std::move(*loaded);
  } else if (fs::exists(dir / "tokenizer.model", error)) {
    auto loaded = SentencePieceTokenizer::load((dir / "tokenizer.model").string());
    if (!loaded.ok()) return loaded.status();
    tokenizer = std::move(*loaded);
  } else {
    return absl::NotFoundError(
        absl::StrCat(model_dir, ": has neither tokenizer.json nor tokenizer.model"));
  }

  const fs::path config_path = dir / "tokenizer_config.json";
  auto config = read_optional_json(config_path);
  if (!config.ok()) return config.status();
  if (config->has_value()) {
    auto bos = config_token(*tokenizer, **config, "bos_token", config_path);
    if (!bos.ok()) return bos.status();
    if (bos->has_value()) tokenizer->set_bos_id(*bos);
    auto eos = config_token(*tokenizer, **config, "eos_token", config_path);
    if (!eos.ok()) return eos.status();
    if (eos->has_value()) tokenizer->set_eos_ids({**eos});
  }

  const fs::path generation_path = dir / "generation_config.json";
  auto generation = read_optional_json(generation_path);
  if (!generation.ok()) return generation.status();
  if (generation->has_value()) {
    const json& root = **generation;
    if (root.contains("bos_token_id") && !root["bos_token_id"].is_null()) {
      auto bos = config_id(*tokenizer, root["bos_token_id"], "bos_token_id", generation_path);
      if (!bos.ok()) return bos.status();
      tokenizer->set_bos_id(*bos);
    }
    if (root.contains("eos_token_id") && !root["eos_token_id"].is_null()) {
      const json& node = root["eos_token_id"];
      std::vector<TokenId> eos_ids;
      if (node.is_array()) {
        for (size_t i = 0; i < node.size(); ++i) {
          auto id = config_id(*tokenizer, node[i], absl::StrCat("eos_token_id[", i, "]"),
                              generation_path);
          if (!id.ok()) return id.status();
          eos_ids.push_back(*id);
        }
      } else {
        auto id = config_id(*tokenizer, node, "eos_token_id", generation_path);
        if (!id.ok()) return id.status();
        eos_ids.push_back(*id);
      }
      tokenizer->set_eos_ids(std::move(eos_ids));
    }
  }
  spdlog::info("tokenizer: {} ({} tokens, bos {}, {} eos ids)", model_dir, tokenizer->vocab_size(),
               tokenizer->bos_id().value_or(-1), tokenizer->eos_ids().size());
  return tokenizer;
}

absl::StatusOr<std::vector<TokenId>> encode_llama3_chat(const Tokenizer& tokenizer,
                                                        std::span<const ChatMessage> messages,
                                                        bool add_generation_prompt) {
  const auto begin_of_text = tokenizer.token_id("<|begin_of_text|>");
  const auto start_header = tokenizer.token_id("<|start_header_id|>");
  const auto end_header = tokenizer.token_id("<|end_header_id|>");
  const auto eot = tokenizer.token_id("<|eot_id|>");
  if (!begin_of_text || !start_header || !end_header || !eot) {
    return absl::FailedPreconditionError(
        "tokenizer lacks the Llama 3 chat tokens <|begin_of_text|>, <|start_header_id|>, "
        "<|end_header_id|>, <|eot_id|>");
  }
  std::vector<TokenId> ids = {*begin_of_text};
  // The template renders one string that is then encoded with special tokens parsed; encoding
  // each text piece between special tokens gives the same ids, since the special tokens split
  // the text anyway, and keeps special tokens written by a user inert.
  auto append_text = [&](std::string_view text) -> absl::Status {
    auto piece = tokenizer.encode(text, /*add_bos=*/false, /*parse_special=*/false);
    if (!piece.ok()) return piece.status();
    ids.insert(ids.end(), piece->begin(), piece->end());
    return absl::OkStatus();
  };
  auto append_header = [&](std::string_view role) -> absl::Status {
    ids.push_back(*start_header);
    if (absl::Status status = append_text(role); !status.ok()) return status;
    ids.push_back(*end_header);
    return absl::OkStatus();
  };
  for (const ChatMessage& message : messages) {
    if (absl::Status status = append_header(message.role); !status.ok()) return status;
    // Jinja's `| trim`.
    if (absl::Status status =
            append_text(absl::StrCat("\n\n", to_absl(trim_ascii_space(message.content))));
        !status.ok()) {
      return status;
    }
    ids.push_back(*eot);
  }
  if (add_generation_prompt) {
    if (absl::Status status = append_header("assistant"); !status.ok()) return status;
    if (absl::Status status = append_text("\n\n"); !status.ok()) return status;
  }
  return ids;
}

}  // namespace deft::engine
