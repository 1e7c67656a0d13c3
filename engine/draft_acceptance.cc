#include "engine/draft_acceptance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

// The last counter word of a uniform number: what it decides (see the header).
enum class Purpose : uint32_t { kTargetDraw = 0, kAcceptanceTest = 1, kResidualDraw = 2 };

// Uniform in [0, 1) with 53 bits, the same bit recipe as sampling_uniform(); with
// entry_word 0 and kTargetDraw it equals sampling_uniform(seed, position).
double acceptance_uniform(uint64_t seed, uint64_t position, uint32_t entry_word, Purpose purpose) {
  const std::array<uint32_t, 4> bits =
      philox4x32_10({static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                     entry_word, static_cast<uint32_t>(purpose)},
                    {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  const uint64_t mantissa = (static_cast<uint64_t>(bits[0] >> 5) << 26) | (bits[1] >> 6);
  return static_cast<double>(mantissa) * 0x1.0p-53;
}

// Children of every node in entry order, as linked lists: first_child[node + 1] (node -1 is
// the anchor), next_sibling[entry]; and the depth of each entry (0 = under the anchor).
struct TreeShape {
  std::vector<int32_t> first_child;
  std::vector<int32_t> next_sibling;
  std::vector<int32_t> depth;

  explicit TreeShape(const DraftTree& tree) {
    const auto entries = static_cast<int32_t>(tree.tokens.size());
    first_child.assign(static_cast<size_t>(entries) + 1, -1);
    next_sibling.assign(static_cast<size_t>(entries), -1);
    depth.assign(static_cast<size_t>(entries), 0);
    std::vector<int32_t> last_child(static_cast<size_t>(entries) + 1, -1);
    for (int32_t entry = 0; entry < entries; ++entry) {
      const int32_t parent = tree.parents[entry];  // validated: -1 <= parent < entry
      depth[entry] = parent < 0 ? 0 : depth[parent] + 1;
      int32_t& last = last_child[parent + 1];
      if (last < 0) {
        first_child[parent + 1] = entry;
      } else {
        next_sibling[last] = entry;
      }
      last = entry;
    }
  }
};

// The first child of `node` whose token is `token`, or -1.
int32_t child_with_token(const DraftTree& tree, const TreeShape& shape, int32_t node,
                         TokenId token) {
  for (int32_t child = shape.first_child[node + 1]; child >= 0; child = shape.next_sibling[child]) {
    if (tree.tokens[child] == token) return child;
  }
  return -1;
}

absl::Status with_row(const absl::Status& status, int32_t row) {
  return absl::Status(status.code(),
                      absl::StrCat("draft acceptance: target row ", row, ": ", status.message()));
}

// One target row of the rejection rules (draft distribution, draft_probs): its raw log-softmax
// and the sampling distribution p (temperature, top-k, top-p with the Sampler's kept-set rule),
// kept unnormalised (weights and their total): a rejection then costs O(1) (O(k) for a k-token
// draft distribution), where renormalising the whole row after each one cost three passes over
// the vocabulary per rejected child (a 64-entry Medusa tree rejects several children per level,
// over 128256 tokens). Its buffers are reused across rows.
class TargetRow {
 public:
  absl::Status load(std::span<const float> logits, const SamplingParams& params) {
    logits_ = logits;
    const auto vocab_size = static_cast<int32_t>(logits.size());
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int32_t token = 0; token < vocab_size; ++token) {
      const float logit = logits[token];
      if (std::isnan(logit) || logit == std::numeric_limits<float>::infinity()) {
        return absl::InternalError(absl::StrCat("logit of token ", token, " is ", logit));
      }
      max_logit = std::max(max_logit, logit);
    }
    if (max_logit == -std::numeric_limits<float>::infinity()) {
      return absl::InternalError("every logit of the row is -inf");
    }
    // Weights as the Sampler computes them (float, divided by T); at T = 1 they are also the
    // raw normaliser's terms.
    weights_.resize(logits.size());
    double raw_sum = 0.0;
    if (params.temperature == 1.0f) {
      for (int32_t token = 0; token < vocab_size; ++token) {
        weights_[token] = std::exp(logits[token] - max_logit);
        raw_sum += weights_[token];
      }
    } else {
      for (int32_t token = 0; token < vocab_size; ++token) {
        raw_sum += std::exp(logits[token] - max_logit);
        weights_[token] = std::exp((logits[token] - max_logit) / params.temperature);
      }
    }
    log_normaliser_ = static_cast<double>(max_logit) + std::log(raw_sum);

    int32_t boundary = -1;  // least likely kept token in (logit desc, id asc) order; -1: all
    if (params.top_k > 0 || params.top_p < 1.0f) {
      const bool top_k_filters = params.top_k > 0 && params.top_k < vocab_size;
      const size_t candidates = top_k_filters ? static_cast<size_t>(params.top_k) : logits.size();
      order_.resize(logits.size());
      for (int32_t token = 0; token < vocab_size; ++token) order_[token] = token;
      std::partial_sort(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(candidates),
                        order_.end(), [this](int32_t a, int32_t b) { return more_likely(a, b); });
      boundary = order_[candidates - 1];
      if (params.top_p < 1.0f) {
        double candidate_mass = 0.0;
        for (size_t i = 0; i < candidates; ++i) candidate_mass += weights_[order_[i]];
        const double mass_needed = params.top_p * candidate_mass;
        double cumulative = 0.0;
        for (size_t i = 0; i < candidates; ++i) {
          cumulative += weights_[order_[i]];
          if (cumulative >= mass_needed) {
            boundary = order_[i];
            break;
          }
        }
      }
    }
    mass_.resize(logits.size());
    total_ = 0.0;
    for (int32_t token = 0; token < vocab_size; ++token) {
      const bool kept = boundary < 0 || !more_likely(boundary, token);
      mass_[token] = kept ? weights_[token] : 0.0;
      total_ += mass_[token];
    }
    return absl::OkStatus();
  }

  double probability(TokenId token) const { return mass_[token] / total_; }
  float raw_logprob(TokenId token) const {
    return static_cast<float>(static_cast<double>(logits_[token]) - log_normaliser_);
  }

  // After rejecting a drafted token with draft probability q: p(t) = max(0, p(t) - q),
  // renormalised (here: its mass loses q times the total, and the total what it lost).
  void remove_draft_mass(TokenId token, double draft_prob) {
    const double before = mass_[token];
    mass_[token] = std::max(0.0, before - draft_prob * total_);
    total_ -= before - mass_[token];
    // A rejection needs p(t) < q <= 1, so mass remains elsewhere.
    DEFT_CHECK(total_ > 0.0, "draft acceptance: target distribution lost all its mass");
  }

  // After rejecting a child drawn from the draft distribution q (weights over `tokens`, summing
  // to q_total): p = max(0, p - q), renormalised. A rejection of x needs p(x) < q(x), so the
  // residual keeps mass 1 - sum(min(p, q)) >= q(x) - p(x) > 0; when rounding leaves it
  // (nearly) none, p and q agree to rounding, so p is kept unchanged instead (an event of
  // probability below the threshold, 1e-9).
  void remove_distribution(std::span<const TokenId> tokens, std::span<const double> weights,
                           double q_total) {
    const double scale = total_ / q_total;  // q(t) * total_ = weight * scale
    double removed = 0.0;
    saved_.clear();
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (weights[i] == 0.0) continue;
      const TokenId token = tokens[i];
      const double before = mass_[token];
      const double after = std::max(0.0, before - weights[i] * scale);
      if (after == before) continue;
      saved_.emplace_back(token, before);
      mass_[token] = after;
      removed += before - after;
    }
    if (total_ - removed <= total_ * 1e-9) {
      for (const auto& [token, before] : saved_) mass_[token] = before;
      return;
    }
    total_ -= removed;
  }

  // Inverse CDF in id order (as the Sampler); zero-probability tokens are never drawn.
  TokenId draw(double uniform) const {
    const double target = uniform * total_;
    double cumulative = 0.0;
    TokenId chosen = -1;
    for (size_t token = 0; token < mass_.size(); ++token) {
      if (mass_[token] == 0.0) continue;
      chosen = static_cast<TokenId>(token);  // the last one absorbs rounding at the top end
      cumulative += mass_[token];
      if (cumulative > target) break;
    }
    return chosen;
  }

 private:
  bool more_likely(int32_t a, int32_t b) const {
    return logits_[a] != logits_[b] ? logits_[a] > logits_[b] : a < b;
  }

  std::span<const float> logits_;
  double log_normaliser_ = 0.0;
  std::vector<float> weights_;
  std::vector<int32_t> order_;
  std::vector<double> mass_;  // p times total_: the kept weights, less the rejected drafts' mass
  double total_ = 0.0;        // sum of mass_
  std::vector<std::pair<TokenId, double>> saved_;  // remove_distribution's undo list
};

// One node's draft distribution q during its children's tests: weights (the client's probs,
// then 0 for each sibling drawn without replacement and rejected) and their total.
class DraftRow {
 public:
  void load(const DraftDistribution& distribution) {
    tokens_ = distribution.tokens;
    weights_.assign(distribution.probs.begin(), distribution.probs.end());
    total_ = 0.0;
    for (double weight : weights_) total_ += weight;
  }
  double probability(int32_t slot) const { return weights_[slot] / total_; }
  std::span<const TokenId> tokens() const { return tokens_; }
  std::span<const double> weights() const { return weights_; }
  double total() const { return total_; }
  // Drawn without replacement: the next sibling came from q without this one's token.
  void remove(int32_t slot) {
    total_ -= weights_[slot];
    weights_[slot] = 0.0;
  }

 private:
  std::span<const TokenId> tokens_;
  std::vector<double> weights_;
  double total_ = 0.0;
};

// Where the distributions sit in the tree: built by validation, read by the acceptance.
struct DistributionIndex {
  std::vector<int32_t> of_node;  // [node + 1]: index into tree.distributions, -1: none
  std::vector<int32_t> slot;     // [entry]: its token's index in its parent's, -1: none
};

// The distribution checks of validate_draft_tree (the tree's other fields already valid).
absl::Status check_distributions(const DraftTree& tree, int32_t vocab_size,
                                 int64_t max_distribution_tokens, DistributionIndex* index) {
  const auto entries = static_cast<int32_t>(tree.tokens.size());
  index->of_node.assign(static_cast<size_t>(entries) + 1, -1);
  index->slot.assign(static_cast<size_t>(entries), -1);
  const std::span<const DraftDistribution> distributions = tree.distributions;
  if (distributions.empty()) return absl::OkStatus();
  // Bounds first, so the work below is bounded by the limits.
  if (!tree.draft_probs.empty()) {
    return absl::InvalidArgumentError(
        "draft tree: give draft_probs or draft_distributions, not both (with distributions the "
        "drafted tokens' probabilities are in them)");
  }
  if (tree.draft_sampling != DraftSampling::kWithReplacement &&
      tree.draft_sampling != DraftSampling::kWithoutReplacement) {
    return absl::InvalidArgumentError(
        "draft tree: draft_distributions need draft_sampling (with or without replacement: how "
        "the children were drawn from them)");
  }
  if (distributions.size() > static_cast<size_t>(entries) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft tree: ", distributions.size(), " draft_distributions, more than the ",
                     entries + 1, " nodes (the anchor and ", entries, " entries)"));
  }
  int64_t total_tokens = 0;
  for (const DraftDistribution& distribution : distributions) {
    total_tokens += static_cast<int64_t>(distribution.tokens.size());
  }
  if (total_tokens > max_distribution_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft tree: draft_distributions list ", total_tokens,
                     " tokens in all, more than the limit of ", max_distribution_tokens));
  }

  // Each distribution's (token, slot) pairs sorted by token, one run per distribution, for
  // duplicate checks and the children's lookups.
  std::vector<std::pair<TokenId, int32_t>> sorted;
  sorted.reserve(static_cast<size_t>(total_tokens));
  std::vector<size_t> begin_of(distributions.size() + 1, 0);
  for (size_t d = 0; d < distributions.size(); ++d) {
    const DraftDistribution& distribution = distributions[d];
    const auto where = [&] {
      return absl::StrCat("draft tree: draft_distributions[", d, "] (entry ", distribution.entry,
                          "): ");
    };
    if (distribution.entry < -1 || distribution.entry >= entries) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "entry must be -1 (the anchor) or ",
                                                     "an entry in [0, ", entries, ")"));
    }
    int32_t& of_node = index->of_node[static_cast<size_t>(distribution.entry) + 1];
    if (of_node >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "draft_distributions[", of_node,
                                                     "] describes the same node (one per node)"));
    }
    of_node = static_cast<int32_t>(d);
    if (distribution.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "no tokens"));
    }
    if (distribution.probs.size() != distribution.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), distribution.tokens.size(),
                                                     " tokens but ", distribution.probs.size(),
                                                     " probs"));
    }
    double sum = 0.0;
    begin_of[d] = sorted.size();
    for (size_t i = 0; i < distribution.tokens.size(); ++i) {
      const TokenId token = distribution.tokens[i];
      if (token < 0 || token >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(), "tokens[", i, "] = ", token, " outside the vocabulary [0, ", vocab_size, ")"));
      }
      const float prob = distribution.probs[i];
      if (!std::isfinite(prob) || !(prob > 0.0f && prob <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "probs[", i, "] = ", prob, " must be in (0, 1]"));
      }
      sum += prob;
      sorted.emplace_back(token, static_cast<int32_t>(i));
    }
    if (sum > 1.0 + kDraftProbSumTolerance) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "probs sum to ", sum, ", more than 1"));
    }
    const auto run = std::span(sorted).subspan(begin_of[d]);
    std::sort(run.begin(), run.end());
    for (size_t i = 1; i < run.size(); ++i) {
      if (run[i].first == run[i - 1].first) {
        return absl::InvalidArgumentError(absl::StrCat(where(), "token ", run[i].first,
                                                       " listed twice (tokens[", run[i - 1].second,
                                                       "] and tokens[", run[i].second, "])"));
      }
    }
  }
  begin_of[distributions.size()] = sorted.size();

  std::vector<int32_t> has_children(static_cast<size_t>(entries) + 1, 0);
  std::vector<int32_t> drawn_by(sorted.size(), -1);  // without replacement: the child of a slot
  for (int32_t entry = 0; entry < entries; ++entry) {
    const int32_t parent = tree.parents[entry];
    has_children[static_cast<size_t>(parent) + 1] = 1;
    const int32_t d = index->of_node[static_cast<size_t>(parent) + 1];
    if (d < 0) continue;
    const TokenId token = tree.tokens[entry];
    const auto run =
        std::span(sorted).subspan(begin_of[d], begin_of[static_cast<size_t>(d) + 1] - begin_of[d]);
    const auto found =
        std::lower_bound(run.begin(), run.end(), std::pair<TokenId, int32_t>(token, -1));
    if (found == run.end() || found->first != token) {
      return absl::InvalidArgumentError(absl::StrCat(
          "draft tree: entry ", entry, ": token ", token, " is not in draft_distributions[", d,
          "], the distribution of its parent (entry ", parent, ") it was drawn from"));
    }
    index->slot[entry] = found->second;
    if (tree.draft_sampling == DraftSampling::kWithoutReplacement) {
      int32_t& drawn = drawn_by[begin_of[d] + static_cast<size_t>(found - run.begin())];
      if (drawn >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "draft tree: entry ", entry, ": token ", token, " repeats its sibling entry ", drawn,
            "; children drawn without replacement have distinct tokens"));
      }
      drawn = entry;
    }
  }
  for (size_t d = 0; d < distributions.size(); ++d) {
    const int32_t entry = distributions[d].entry;
    if (has_children[static_cast<size_t>(entry) + 1] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "draft tree: draft_distributions[", d, "] (entry ", entry,
          "): the node has no drafted children (a distribution is the one its children were "
          "drawn from)"));
    }
  }
  return absl::OkStatus();
}

// validate_draft_tree, filling `index` for the acceptance.
absl::Status check_draft_tree(const DraftTree& tree, int32_t vocab_size, int32_t max_entries,
                              int64_t max_distribution_tokens, DistributionIndex* index) {
  const size_t entries = tree.tokens.size();
  if (entries == 0) return absl::InvalidArgumentError("draft tree: no entries");
  if (entries > static_cast<size_t>(std::max(0, max_entries))) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft tree: ", entries, " entries, more than the limit of ", max_entries));
  }
  if (tree.parents.size() != entries) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft tree: ", entries, " tokens but ", tree.parents.size(), " parents"));
  }
  if (!tree.draft_probs.empty() && tree.draft_probs.size() != entries) {
    return absl::InvalidArgumentError(absl::StrCat("draft tree: ", entries, " tokens but ",
                                                   tree.draft_probs.size(),
                                                   " draft probs (give none or one per entry)"));
  }
  for (size_t entry = 0; entry < entries; ++entry) {
    const TokenId token = tree.tokens[entry];
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("draft tree: entry ", entry, ": token ", token,
                                                     " outside the vocabulary [0, ", vocab_size,
                                                     ")"));
    }
    const int32_t parent = tree.parents[entry];
    if (parent < -1 || static_cast<int64_t>(parent) >= static_cast<int64_t>(entry)) {
      return absl::InvalidArgumentError(absl::StrCat("draft tree: entry ", entry, ": parent ",
                                                     parent,
                                                     " must be -1 (the anchor) or an "
                                                     "earlier entry in [0, ",
                                                     entry, ")"));
    }
    if (!tree.draft_probs.empty()) {
      const float prob = tree.draft_probs[entry];
      if (!std::isfinite(prob) || !(prob > 0.0f && prob <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("draft tree: entry ", entry, ": draft prob ", prob, " must be in (0, 1]"));
      }
    }
  }
  return check_distributions(tree, vocab_size, max_distribution_tokens, index);
}

}  // namespace

absl::Status validate_draft_tree(const DraftTree& tree, int32_t vocab_size, int32_t max_entries,
                                 int64_t max_distribution_tokens) {
  DistributionIndex index;
  return check_draft_tree(tree, vocab_size, max_entries, max_distribution_tokens, &index);
}

std::vector<TokenId> Acceptance::accepted_tokens(const DraftTree& tree) const {
  std::vector<TokenId> tokens;
  tokens.reserve(accepted_entries.size());
  for (int32_t entry : accepted_entries) tokens.push_back(tree.tokens[entry]);
  return tokens;
}

std::vector<TokenId> Acceptance::committed_tokens(const DraftTree& tree) const {
  std::vector<TokenId> tokens = accepted_tokens(tree);
  tokens.push_back(bonus_token);
  return tokens;
}

absl::StatusOr<Acceptance> accept_draft_tree(const DraftTree& tree, std::span<const float> logits,
                                             int32_t vocab_size, const SamplingParams& params,
                                             uint64_t step) {
  if (vocab_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft acceptance: vocab_size must be >= 1, got ", vocab_size));
  }
  // A bad tree is named before a logits size that does not fit it.
  if (absl::Status status =
          validate_draft_tree(tree, vocab_size, std::numeric_limits<int32_t>::max());
      !status.ok()) {
    return status;
  }
  const size_t entries = tree.tokens.size();
  const size_t row_size = static_cast<size_t>(vocab_size);
  if (logits.size() / row_size != entries + 1 || logits.size() % row_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("draft acceptance: logits hold ", logits.size(),
                                                   " floats, want (", entries,
                                                   " entries + 1) rows of ", vocab_size));
  }
  std::vector<std::span<const float>> rows(entries + 1);
  for (size_t row = 0; row < rows.size(); ++row) rows[row] = logits.subspan(row * row_size, row_size);
  return accept_draft_tree(tree, rows, vocab_size, params, step);
}

absl::StatusOr<Acceptance> accept_draft_tree(const DraftTree& tree,
                                             std::span<const std::span<const float>> rows,
                                             int32_t vocab_size, const SamplingParams& params,
                                             uint64_t step) {
  if (vocab_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft acceptance: vocab_size must be >= 1, got ", vocab_size));
  }
  DistributionIndex index;
  if (absl::Status status = check_draft_tree(tree, vocab_size, std::numeric_limits<int32_t>::max(),
                                             std::numeric_limits<int64_t>::max(), &index);
      !status.ok()) {
    return status;
  }
  if (absl::Status status = validate_sampling_params(params, vocab_size); !status.ok()) {
    return status;
  }
  const size_t entries = tree.tokens.size();
  if (rows.size() != entries + 1) {
    return absl::InvalidArgumentError(absl::StrCat("draft acceptance: ", rows.size(),
                                                   " logits rows, want ", entries, " entries + 1"));
  }
  for (size_t row = 0; row < rows.size(); ++row) {
    if (rows[row].size() != static_cast<size_t>(vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("draft acceptance: logits row ", row, " holds ",
                                                     rows[row].size(), " floats, want ",
                                                     vocab_size));
    }
  }
  const TreeShape shape(tree);
  const auto row_of = [&](int32_t node) {  // node -1: the anchor's row 0
    return rows[static_cast<size_t>(node + 1)];
  };
  // Position of the token that follows `node` (a child's token, or the bonus).
  const auto next_position = [&](int32_t node) {
    return node < 0 ? step : step + static_cast<uint64_t>(shape.depth[node]) + 1;
  };

  // The Sampler is the target draw of the greedy and plain modes and of the bonus after an
  // accepted leaf; only its token and raw logprob are wanted.
  SamplingParams draw_params = params;
  draw_params.top_logprobs = 0;
  draw_params.stop_token_ids.clear();
  Sampler sampler;

  Acceptance result;
  int32_t node = -1;
  const bool greedy = params.temperature == 0.0f || params.top_k == 1;
  TargetRow target;
  DraftRow draft;
  while (true) {
    const uint64_t position = next_position(node);
    const int32_t distribution = greedy ? -1 : index.of_node[node + 1];
    const bool has_children = shape.first_child[node + 1] >= 0;
    if (greedy || !has_children || (distribution < 0 && tree.draft_probs.empty())) {
      // The target's own draw: the greedy rule, the rule without draft information, and the
      // bonus after an accepted leaf (the token plain decoding would sample there).
      absl::StatusOr<SampledToken> drawn = sampler.sample(row_of(node), draw_params, position);
      if (!drawn.ok()) return with_row(drawn.status(), node + 1);
      const int32_t child = child_with_token(tree, shape, node, drawn->token);
      if (child < 0) {
        result.bonus_token = drawn->token;
        result.bonus_logprob = drawn->logprob;
        return result;
      }
      result.accepted_entries.push_back(child);
      node = child;
      continue;
    }

    // Rejection sampling over the children, in entry order: the draft distribution's rule, or
    // the draft_probs rule.
    if (absl::Status status = target.load(row_of(node), params); !status.ok()) {
      return with_row(status, node + 1);
    }
    if (distribution >= 0) draft.load(tree.distributions[static_cast<size_t>(distribution)]);
    int32_t accepted = -1;
    for (int32_t child = shape.first_child[node + 1]; child >= 0;
         child = shape.next_sibling[child]) {
      const TokenId token = tree.tokens[child];
      const int32_t slot = index.slot[child];
      const double draft_prob = distribution >= 0 ? draft.probability(slot)
                                                  : static_cast<double>(tree.draft_probs[child]);
      const double uniform = acceptance_uniform(
          params.seed, position, static_cast<uint32_t>(child) + 1, Purpose::kAcceptanceTest);
      // Accept with probability min(1, p / q): uniform < p / q, without dividing.
      if (uniform * draft_prob < target.probability(token)) {
        accepted = child;
        break;
      }
      if (distribution < 0) {
        target.remove_draft_mass(token, draft_prob);
        continue;
      }
      target.remove_distribution(draft.tokens(), draft.weights(), draft.total());
      if (tree.draft_sampling == DraftSampling::kWithoutReplacement) draft.remove(slot);
    }
    if (accepted < 0) {
      result.bonus_token =
          target.draw(acceptance_uniform(params.seed, position, 0, Purpose::kResidualDraw));
      result.bonus_logprob = target.raw_logprob(result.bonus_token);
      return result;
    }
    result.accepted_entries.push_back(accepted);
    node = accepted;
  }
}

}  // namespace deft::engine
