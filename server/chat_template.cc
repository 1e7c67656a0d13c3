#include "server/chat_template.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace deft::server {
namespace {

bool has_llama3_tokens(const engine::Tokenizer& tokenizer) {
  return tokenizer.token_id("<|start_header_id|>") && tokenizer.token_id("<|end_header_id|>") &&
         tokenizer.token_id("<|eot_id|>") && tokenizer.token_id("<|begin_of_text|>");
}

absl::StatusOr<std::vector<engine::TokenId>> apply_llama2(
    const engine::Tokenizer& tokenizer, std::span<const engine::ChatMessage> messages) {
  // Meta's llama/generation.py: B_INST, E_INST = "[INST]", "[/INST]";
  // B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n".
  std::vector<engine::ChatMessage> turns(messages.begin(), messages.end());
  size_t offset = 0;  // index in `messages` of turns[0], for error messages
  if (!turns.empty() && turns[0].role == "system") {
    if (turns.size() < 2 || turns[1].role != "user") {
      return absl::InvalidArgumentError(
          "messages[1] must be a user message after the system message (llama2 template)");
    }
    turns[1].content =
        absl::StrCat("<<SYS>>\n", turns[0].content, "\n<</SYS>>\n\n", turns[1].content);
    turns.erase(turns.begin());
    offset = 1;
  }
  for (size_t i = 0; i < turns.size(); ++i) {
    const char* expected = i % 2 == 0 ? "user" : "assistant";
    if (turns[i].role != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i + offset, "].role is \"", turns[i].role,
                       "\"; the llama2 template needs ", expected,
                       " here (an optional system message, then user and assistant alternating, "
                       "ending with user)"));
    }
  }
  if (turns.size() % 2 == 0) {
    return absl::InvalidArgumentError("the last message must be a user message (llama2 template)");
  }
  const std::optional<engine::TokenId> bos = tokenizer.bos_id();
  const std::vector<engine::TokenId>& eos = tokenizer.eos_ids();
  std::vector<engine::TokenId> ids;
  auto append = [&](const std::string& text) -> absl::Status {
    auto piece = tokenizer.encode(text, /*add_bos=*/false, /*parse_special=*/false);
    if (!piece.ok()) return piece.status();
    ids.insert(ids.end(), piece->begin(), piece->end());
    return absl::OkStatus();
  };
  for (size_t i = 0; i < turns.size(); i += 2) {
    if (bos) ids.push_back(*bos);
    const std::string user(absl::StripAsciiWhitespace(turns[i].content));
    if (i + 1 < turns.size()) {
      const std::string assistant(absl::StripAsciiWhitespace(turns[i + 1].content));
      if (absl::Status status = append(absl::StrCat("[INST] ", user, " [/INST] ", assistant, " "));
          !status.ok()) {
        return status;
      }
      if (!eos.empty()) ids.push_back(eos.front());
    } else if (absl::Status status = append(absl::StrCat("[INST] ", user, " [/INST]"));
               !status.ok()) {
      return status;
    }
  }
  return ids;
}

}  // namespace

const char* chat_template_name(ChatTemplate chat_template) {
  return chat_template == ChatTemplate::kLlama3 ? "llama3" : "llama2";
}

absl::StatusOr<ChatTemplate> choose_chat_template(const std::string& name,
                                                  const engine::Tokenizer& tokenizer) {
  if (name == "auto") {
    return has_llama3_tokens(tokenizer) ? ChatTemplate::kLlama3 : ChatTemplate::kLlama2;
  }
  if (name == "llama2") return ChatTemplate::kLlama2;
  if (name == "llama3") {
    if (!has_llama3_tokens(tokenizer)) {
      return absl::FailedPreconditionError(
          "chat_template llama3: the tokenizer lacks <|begin_of_text|>, <|start_header_id|>, "
          "<|end_header_id|> or <|eot_id|>");
    }
    return ChatTemplate::kLlama3;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("chat_template \"", name, "\" is not auto, llama3 or llama2"));
}

absl::StatusOr<std::vector<engine::TokenId>> apply_chat_template(
    ChatTemplate chat_template, const engine::Tokenizer& tokenizer,
    std::span<const engine::ChatMessage> messages) {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty");
  if (chat_template == ChatTemplate::kLlama2) return apply_llama2(tokenizer, messages);
  absl::StatusOr<std::vector<engine::TokenId>> ids =
      engine::encode_llama3_chat(tokenizer, messages, /*add_generation_prompt=*/true);
  if (!ids.ok()) return absl::InvalidArgumentError(ids.status().message());
  return ids;
}

std::vector<engine::TokenId> chat_stop_token_ids(ChatTemplate chat_template,
                                                 const engine::Tokenizer& tokenizer) {
  if (chat_template != ChatTemplate::kLlama3) return {};
  const std::optional<engine::TokenId> eot = tokenizer.token_id("<|eot_id|>");
  if (!eot || tokenizer.is_eos(*eot)) return {};
  return {*eot};
}

}  // namespace deft::server
