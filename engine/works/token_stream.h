// The generated tokens of one branch as a stream of deltas for a client: incremental
// detokenization, stop strings (the text is cut before them, and a tail that may begin one is
// held back until the next token decides), stop tokens, EOS and a length limit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/sequence_tree.h"
#include "engine/tokenizer/incremental_detokenizer.h"
#include "engine/tokenizer/tokenizer.h"

namespace deft::engine {

enum class FinishReason : uint8_t { kNone, kLength, kStop, kEos, kCancelled, kPruned };

// New tokens of one branch, as one streamed message.
struct TokenDelta {
  std::vector<TokenId> ids;
  std::string text;  // complete UTF-8; text held back for a possible stop string comes later
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // one per id when asked for
  FinishReason finish = FinishReason::kNone;
};

struct StreamLimits {
  std::vector<std::string> stop;  // stop strings
  bool ignore_eos = false;        // EOS does not end the branch
  bool top_logprobs = false;      // deltas carry the sampled top lists
};

class TokenStream {
 public:
  TokenStream(const Tokenizer& tokenizer, const StreamLimits* limits);

  // Adds a sampled token; `at_limit`: it is the last token the length limit allows. The delta
  // carries finish != kNone when the token ended the branch.
  TokenDelta add(const SampledToken& sampled, bool at_limit);
  // A delta that ends the branch early (cancelled, pruned), flushing held-back text.
  TokenDelta end(FinishReason reason);

  int32_t generated() const { return generated_; }
  const std::string& text() const { return text_; }  // decoded so far (cut at a stop string)
  bool finished() const { return finished_; }

 private:
  const Tokenizer& tokenizer_;
  const StreamLimits* limits_;
  IncrementalDetokenizer detokenizer_;
  std::string text_;
  size_t emitted_bytes_ = 0;
  int32_t generated_ = 0;
  bool finished_ = false;
};

}  // namespace deft::engine
