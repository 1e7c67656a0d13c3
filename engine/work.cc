#include "engine/work.h"

#include <cstdio>
#include <cstdlib>

namespace deft::engine {

absl::Status StepContext::add_run(NodeId node, std::span<const TokenId> run, Logits wanted) {
  SequenceTree& tree = forest.tree();
  const auto first = static_cast<int32_t>(tree.contains(node) ? tree.node(node).tokens.size() : 0);
  if (absl::Status status = tree.append(node, run); !status.ok()) return status;
  for (size_t i = 0; i < run.size(); ++i) {
    if (wanted == Logits::kAll || (wanted == Logits::kLast && i + 1 == run.size())) {
      logit_rows.push_back(static_cast<int32_t>(tokens.size()));
    }
    queries.push_back({node, first + static_cast<int32_t>(i)});
    tokens.push_back(run[i]);
  }
  budget -= static_cast<int64_t>(run.size());
  return absl::OkStatus();
}

std::span<const float> StepContext::next_logits() {
  const size_t vocab = static_cast<size_t>(vocab_size);
  if ((logit_cursor_ + 1) * vocab > logits.size()) {
    std::fprintf(stderr, "StepContext: a work took more logit rows than the step has\n");
    std::abort();
  }
  return logits.subspan(logit_cursor_++ * vocab, vocab);
}

void StepContext::clear() {
  budget = 0;
  generated = 0;
  queries.clear();
  tokens.clear();
  logit_rows.clear();
  logits = {};
  logit_cursor_ = 0;
}

}  // namespace deft::engine
