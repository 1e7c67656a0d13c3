// Chat templates of /v1/chat/completions: a conversation ({role, content} messages) as the
// prompt token ids the model was tuned on. Two are built in, chosen by the tokenizer (or by
// --chat-template): Jinja templates of tokenizer_config.json are not interpreted.
//
//   llama3  <|begin_of_text|> then <|start_header_id|>{role}<|end_header_id|>\n\n{content}
//           <|eot_id|> per message, then the assistant's header (engine::encode_llama3_chat).
//           Any role names; generation also stops at <|eot_id|>.
//   llama2  Meta's reference (llama/generation.py, chat_completion): an optional system
//           message folded into the first user message as "<<SYS>>\n{system}\n<</SYS>>\n\n";
//           then user/assistant turns alternating, each finished pair encoded as
//           BOS "[INST] {user} [/INST] {assistant} " EOS, and the last user turn as
//           BOS "[INST] {user} [/INST]". Contents are trimmed, as Meta's code does.
//
// Special-token text inside a message ("<|eot_id|>", "</s>") stays text: messages are
// untrusted, so a user cannot close the turn and forge the assistant's part.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace deft::server {

enum class ChatTemplate { kLlama3, kLlama2 };

const char* chat_template_name(ChatTemplate chat_template);

// `name` "auto": llama3 when the tokenizer has the Llama 3 header and end-of-turn tokens, else
// llama2; "llama3" / "llama2" force one (llama3 fails without its tokens). INVALID_ARGUMENT
// names an unknown name; FAILED_PRECONDITION a tokenizer without the forced template's tokens.
absl::StatusOr<ChatTemplate> choose_chat_template(const std::string& name,
                                                  const engine::Tokenizer& tokenizer);

// The prompt of `messages` under `chat_template`, ending where the assistant's reply begins.
// INVALID_ARGUMENT (naming messages[i]) for a conversation the template cannot render: no
// messages, llama2 roles out of order (system only first; then user, assistant, user, ...,
// ending with user), a role other than system/user/assistant for llama2.
absl::StatusOr<std::vector<engine::TokenId>> apply_chat_template(
    ChatTemplate chat_template, const engine::Tokenizer& tokenizer,
    std::span<const engine::ChatMessage> messages);

// Token ids that end an assistant turn besides the tokenizer's EOS (llama3: <|eot_id|>).
std::vector<engine::TokenId> chat_stop_token_ids(ChatTemplate chat_template,
                                                 const engine::Tokenizer& tokenizer);

}  // namespace deft::server
