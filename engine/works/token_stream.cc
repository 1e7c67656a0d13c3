#include "engine/works/token_stream.h"

#include <algorithm>

#include "engine/works/stop_strings.h"

namespace deft::engine {

TokenStream::TokenStream(const Tokenizer& tokenizer, const StreamLimits* limits)
    : tokenizer_(tokenizer),
      limits_(limits),
      detokenizer_(tokenizer, /*starts_text=*/false, /*skip_special=*/true) {}

TokenDelta TokenStream::add(const SampledToken& sampled, bool at_limit) {
  TokenDelta delta;
  delta.ids.push_back(sampled.token);
  delta.logprobs.push_back(sampled.logprob);
  if (limits_->top_logprobs) delta.top_logprobs.push_back(sampled.top_logprobs);
  ++generated_;

  const std::string piece = detokenizer_.feed(sampled.token);
  text_ += piece;
  const std::vector<std::string>& stop = limits_->stop;
  FinishReason finish = FinishReason::kNone;
  if (!limits_->ignore_eos && tokenizer_.is_eos(sampled.token)) {
    finish = FinishReason::kEos;
  } else if (sampled.stop) {
    finish = FinishReason::kStop;
  } else if (const StopStringMatch match = find_stop_string(text_, piece.size(), stop);
             match.found()) {
    text_.resize(match.position);  // the text ends before the stop string
    finish = FinishReason::kStop;
  } else if (at_limit) {
    finish = FinishReason::kLength;
  }
  // Stream what is settled: while the branch runs, hold back a tail that may be the start of
  // a stop string; at its end, flush the detokenizer (unless a stop string cut the text).
  size_t settled = text_.size();
  if (finish == FinishReason::kNone) {
    settled -= stop_string_holdback(text_, stop);
  } else if (finish != FinishReason::kStop || sampled.stop) {
    text_ += detokenizer_.finish();
    settled = text_.size();
  }
  settled = std::max(settled, emitted_bytes_);
  delta.text = text_.substr(emitted_bytes_, settled - emitted_bytes_);
  emitted_bytes_ = settled;
  delta.finish = finish;
  finished_ = finish != FinishReason::kNone;
  return delta;
}

TokenDelta TokenStream::end(FinishReason reason) {
  TokenDelta delta;
  delta.finish = reason;
  if (!finished_) {
    text_ += detokenizer_.finish();
    delta.text = text_.substr(std::min(emitted_bytes_, text_.size()));
    emitted_bytes_ = text_.size();
    finished_ = true;
  }
  return delta;
}

}  // namespace deft::engine
