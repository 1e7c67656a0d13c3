#include "engine/draft_acceptance.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deft::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A drafted tree with owned storage; tree() views it.
struct Draft {
  std::vector<TokenId> tokens;
  std::vector<int32_t> parents;
  std::vector<float> draft_probs;
  std::vector<DraftDistribution> distributions;
  DraftSampling sampling = DraftSampling::kUnspecified;
  DraftTree tree() const { return {tokens, parents, draft_probs, distributions, sampling}; }
  int32_t size() const { return static_cast<int32_t>(tokens.size()); }
};

// (entries + 1) rows of `vocab` logits, each 0 except `peak` logit 5 at the given token.
std::vector<float> peaked_rows(int32_t vocab, const std::vector<TokenId>& peaks) {
  std::vector<float> logits(peaks.size() * static_cast<size_t>(vocab), 0.0f);
  for (size_t row = 0; row < peaks.size(); ++row) logits[row * vocab + peaks[row]] = 5.0f;
  return logits;
}

std::span<const float> row_of(const std::vector<float>& logits, int32_t vocab, int32_t row) {
  return std::span<const float>(logits).subspan(static_cast<size_t>(row) * vocab, vocab);
}

double raw_logprob(std::span<const float> row, TokenId token) {
  const float max = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (float logit : row) sum += std::exp(static_cast<double>(logit) - max);
  return row[token] - max - std::log(sum);
}

SamplingParams greedy_params() {
  SamplingParams params;
  params.temperature = 0.0f;
  return params;
}

Acceptance accept_ok(const Draft& draft, const std::vector<float>& logits, int32_t vocab,
                     const SamplingParams& params, uint64_t step) {
  absl::StatusOr<Acceptance> result = accept_draft_tree(draft.tree(), logits, vocab, params, step);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *std::move(result) : Acceptance{};
}

// ---- Greedy --------------------------------------------------------------------------------

TEST(DraftAcceptanceTest, GreedyAcceptsTheFullChain) {
  constexpr int32_t kVocab = 8;
  const Draft draft{{3, 5, 1}, {-1, 0, 1}, {}};
  const std::vector<float> logits = peaked_rows(kVocab, {3, 5, 1, 7});
  const Acceptance result = accept_ok(draft, logits, kVocab, greedy_params(), 10);
  EXPECT_THAT(result.accepted_entries, ElementsAre(0, 1, 2));
  EXPECT_EQ(result.bonus_token, 7);
  EXPECT_NEAR(result.bonus_logprob, raw_logprob(row_of(logits, kVocab, 3), 7), 1e-6);
  EXPECT_THAT(result.accepted_tokens(draft.tree()), ElementsAre(3, 5, 1));
  EXPECT_THAT(result.committed_tokens(draft.tree()), ElementsAre(3, 5, 1, 7));
}

// entries: 0:(3, anchor) 1:(4, anchor) 2:(5, under 1) 3:(6, under 1) 4:(2, under 3)
const Draft kBranchy{{3, 4, 5, 6, 2}, {-1, -1, 1, 1, 3}, {}};

TEST(DraftAcceptanceTest, GreedyAcceptsAPartialPathThroughABranch) {
  constexpr int32_t kVocab = 8;
  // Row 0 picks 4 (entry 1), row 2 (after entry 1) picks 6 (entry 3), row 4 (after entry 3)
  // picks 0, which entry 4 (token 2) is not.
  const std::vector<float> logits = peaked_rows(kVocab, {4, 0, 6, 0, 0, 0});
  const Acceptance result = accept_ok(kBranchy, logits, kVocab, greedy_params(), 0);
  EXPECT_THAT(result.accepted_entries, ElementsAre(1, 3));
  EXPECT_EQ(result.bonus_token, 0);
  EXPECT_NEAR(result.bonus_logprob, raw_logprob(row_of(logits, kVocab, 4), 0), 1e-6);
  EXPECT_THAT(result.committed_tokens(kBranchy.tree()), ElementsAre(4, 6, 0));
}

TEST(DraftAcceptanceTest, GreedyRejectsEverything) {
  constexpr int32_t kVocab = 8;
  const std::vector<float> logits = peaked_rows(kVocab, {7, 3, 5, 6, 2, 1});
  const Acceptance result = accept_ok(kBranchy, logits, kVocab, greedy_params(), 0);
  EXPECT_THAT(result.accepted_entries, ElementsAre());
  EXPECT_EQ(result.bonus_token, 7);
  EXPECT_THAT(result.committed_tokens(kBranchy.tree()), ElementsAre(7));
}

TEST(DraftAcceptanceTest, GreedyTiesGoToTheLowerIdAndTheFirstChild) {
  constexpr int32_t kVocab = 8;
  // Entries 0:(6) 1:(2) 2:(2) under the anchor, 3:(1) under 2.
  const Draft draft{{6, 2, 2, 1}, {-1, -1, -1, 2}, {}};
  std::vector<float> logits(5 * kVocab, 0.0f);
  logits[0 * kVocab + 2] = 4.0f;  // row 0: 2 and 6 tie; 2 wins
  logits[0 * kVocab + 6] = 4.0f;
  // Row 2 (after entry 1): every logit ties, so token 0 is the argmax.
  const Acceptance result = accept_ok(draft, logits, kVocab, greedy_params(), 0);
  EXPECT_THAT(result.accepted_entries, ElementsAre(1));  // not entry 2: first child in order
  EXPECT_EQ(result.bonus_token, 0);
  EXPECT_NEAR(result.bonus_logprob, std::log(1.0 / kVocab), 1e-6);
}

TEST(DraftAcceptanceTest, GreedyIgnoresDraftProbsAndTopKOneIsGreedy) {
  constexpr int32_t kVocab = 8;
  Draft draft = kBranchy;
  draft.draft_probs = {0.5f, 0.5f, 1.0f, 0.25f, 1.0f};
  const std::vector<float> logits = peaked_rows(kVocab, {4, 0, 6, 0, 0, 0});
  EXPECT_THAT(accept_ok(draft, logits, kVocab, greedy_params(), 0).accepted_entries,
              ElementsAre(1, 3));
  SamplingParams top_one;
  top_one.temperature = 1.5f;
  top_one.top_k = 1;
  top_one.seed = 99;
  const Acceptance result = accept_ok(draft, logits, kVocab, top_one, 0);
  EXPECT_THAT(result.accepted_entries, ElementsAre(1, 3));
  EXPECT_EQ(result.bonus_token, 0);
}

TEST(DraftAcceptanceTest, OnlyTheWalkedRowsAreRead) {
  constexpr int32_t kVocab = 8;
  std::vector<float> logits = peaked_rows(kVocab, {7, 3, 5, 6, 2, 1});
  for (int32_t row = 1; row < 6; ++row) logits[row * kVocab] = kNan;  // never read
  EXPECT_EQ(accept_ok(kBranchy, logits, kVocab, greedy_params(), 0).bonus_token, 7);
  logits[0] = kNan;
  const absl::StatusOr<Acceptance> result =
      accept_draft_tree(kBranchy.tree(), logits, kVocab, greedy_params(), 0);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(result.status().message(), HasSubstr("target row 0"));
}

// ---- Sampling ------------------------------------------------------------------------------

std::vector<float> random_logits(std::mt19937_64& rng, size_t count) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(count);
  for (float& logit : logits) logit = normal(rng);
  return logits;
}

// A random tree of `entries` entries (parents precede children).
Draft random_draft(std::mt19937_64& rng, int32_t entries, int32_t vocab, bool with_probs) {
  Draft draft;
  for (int32_t entry = 0; entry < entries; ++entry) {
    draft.tokens.push_back(static_cast<TokenId>(rng() % vocab));
    draft.parents.push_back(entry == 0 ? -1 : static_cast<int32_t>(rng() % (entry + 1)) - 1);
    if (with_probs)
      draft.draft_probs.push_back(0.05f + 0.95f * static_cast<float>(rng() % 1000) / 1000.0f);
  }
  return draft;
}

TEST(DraftAcceptanceTest, SamplingReplaysIdentically) {
  constexpr int32_t kVocab = 6;
  const uint64_t seed = 20260;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const Draft draft =
        random_draft(rng, 1 + static_cast<int32_t>(rng() % 12), kVocab, trial % 2 == 0);
    const std::vector<float> logits = random_logits(rng, (draft.size() + 1) * kVocab);
    SamplingParams params;
    params.temperature = 0.8f;
    params.top_p = 0.9f;
    params.seed = rng();
    const uint64_t step = rng() % 1000;
    const Acceptance first = accept_ok(draft, logits, kVocab, params, step);
    const Acceptance second = accept_ok(draft, logits, kVocab, params, step);
    EXPECT_EQ(first.accepted_entries, second.accepted_entries) << "seed " << seed;
    EXPECT_EQ(first.bonus_token, second.bonus_token) << "seed " << seed;
    EXPECT_EQ(first.bonus_logprob, second.bonus_logprob) << "seed " << seed;
    // The path is a parent chain from the anchor, the bonus a vocabulary token.
    int32_t parent = -1;
    for (int32_t entry : first.accepted_entries) {
      EXPECT_EQ(draft.parents[entry], parent);
      parent = entry;
    }
    EXPECT_GE(first.bonus_token, 0);
    EXPECT_LT(first.bonus_token, kVocab);
  }
}

TEST(DraftAcceptanceTest, SeedAndStepChangeTheDraws) {
  constexpr int32_t kVocab = 6;
  const Draft draft{{0, 1, 2}, {-1, -1, -1}, {}};
  const std::vector<float> logits(4 * kVocab, 0.0f);  // uniform rows
  std::vector<int> by_seed(kVocab, 0);
  std::vector<int> by_step(kVocab, 0);
  for (uint64_t i = 0; i < 600; ++i) {
    SamplingParams params;
    params.seed = i;
    const Acceptance result = accept_ok(draft, logits, kVocab, params, 0);
    ++by_seed[result.committed_tokens(draft.tree()).front()];
    params.seed = 5;
    ++by_step[accept_ok(draft, logits, kVocab, params, i).committed_tokens(draft.tree()).front()];
  }
  for (int32_t token = 0; token < kVocab; ++token) {
    EXPECT_GT(by_seed[token], 50) << token;
    EXPECT_GT(by_step[token], 50) << token;
  }
}

// Without draft probs, accepted tokens + bonus are exactly what plain decoding with the same
// seed samples at those positions.
TEST(DraftAcceptanceTest, PlainSamplingMatchesSequentialSampler) {
  constexpr int32_t kVocab = 50;
  constexpr int32_t kChain = 6;
  constexpr uint64_t kStep = 123;
  std::mt19937_64 rng(11);
  Sampler sampler;
  for (int trial = 0; trial < 50; ++trial) {
    SamplingParams params;
    params.temperature = 0.7f + 0.1f * static_cast<float>(trial % 5);
    params.top_k = trial % 3 == 0 ? 10 : 0;
    params.top_p = trial % 2 == 0 ? 0.85f : 1.0f;
    params.seed = rng();
    const std::vector<float> logits = random_logits(rng, (kChain + 1) * kVocab);
    // Draft the chain the Sampler itself would sample.
    Draft draft;
    std::vector<SampledToken> plain;
    for (int32_t position = 0; position <= kChain; ++position) {
      absl::StatusOr<SampledToken> token =
          sampler.sample(row_of(logits, kVocab, position), params, kStep + position);
      ASSERT_TRUE(token.ok()) << token.status();
      plain.push_back(*token);
      if (position < kChain) {
        draft.tokens.push_back(token->token);
        draft.parents.push_back(position - 1);
      }
    }
    Acceptance result = accept_ok(draft, logits, kVocab, params, kStep);
    EXPECT_THAT(result.accepted_entries, ElementsAre(0, 1, 2, 3, 4, 5));
    EXPECT_EQ(result.bonus_token, plain[kChain].token);
    EXPECT_FLOAT_EQ(result.bonus_logprob, plain[kChain].logprob);

    // A wrong draft at entry 3: the bonus is the token plain decoding sampled there.
    draft.tokens[3] = (draft.tokens[3] + 1) % kVocab;
    result = accept_ok(draft, logits, kVocab, params, kStep);
    EXPECT_THAT(result.accepted_entries, ElementsAre(0, 1, 2));
    EXPECT_EQ(result.bonus_token, plain[3].token);
    EXPECT_FLOAT_EQ(result.bonus_logprob, plain[3].logprob);
  }
}

// With draft probs, the bonus after an accepted leaf is the Sampler's own draw.
TEST(DraftAcceptanceTest, DraftModeLeafBonusIsTheSamplerDraw) {
  constexpr int32_t kVocab = 10;
  std::mt19937_64 rng(3);
  Sampler sampler;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> logits = random_logits(rng, 2 * kVocab);
    logits[4] = 100.0f;  // row 0: token 4 has probability 1 (up to 1e-40)
    const Draft draft{{4}, {-1}, {0.3f}};
    SamplingParams params;
    params.seed = rng();
    const Acceptance result = accept_ok(draft, logits, kVocab, params, 40);
    ASSERT_THAT(result.accepted_entries, ElementsAre(0));
    const absl::StatusOr<SampledToken> plain =
        sampler.sample(row_of(logits, kVocab, 1), params, 41);
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ(result.bonus_token, plain->token);
    EXPECT_FLOAT_EQ(result.bonus_logprob, plain->logprob);
  }
}

// Reference target distribution: softmax(logits / T), then top-k, then top-p (the Sampler's
// rule), normalised.
std::vector<double> target_distribution(std::span<const float> row, const SamplingParams& params) {
  const auto vocab = static_cast<int32_t>(row.size());
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  const float max = row[order[0]];
  std::vector<double> weights(vocab);
  for (int32_t token = 0; token < vocab; ++token) {
    weights[token] = std::exp((static_cast<double>(row[token]) - max) / params.temperature);
  }
  int32_t kept = params.top_k > 0 ? std::min(params.top_k, vocab) : vocab;
  double candidate_mass = 0.0;
  for (int32_t i = 0; i < kept; ++i) candidate_mass += weights[order[i]];
  double cumulative = 0.0;
  for (int32_t i = 0; i < kept; ++i) {
    cumulative += weights[order[i]];
    if (cumulative >= params.top_p * candidate_mass) {
      kept = i + 1;
      break;
    }
  }
  std::vector<double> p(vocab, 0.0);
  double total = 0.0;
  for (int32_t i = 0; i < kept; ++i) total += weights[order[i]];
  for (int32_t i = 0; i < kept; ++i) p[order[i]] = weights[order[i]] / total;
  return p;
}

// Pearson's chi-square of `counts` against `expected` probabilities; a zero-probability token
// must never be seen.
double chi_square(const std::vector<int>& counts, const std::vector<double>& expected) {
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  double statistic = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has target probability 0";
      continue;
    }
    const double e = expected[i] * total;
    statistic += (counts[i] - e) * (counts[i] - e) / e;
  }
  return statistic;
}

// The exactness claim: with a deterministic draft (q = 1) the first emitted token (the accepted
// child's, or the bonus) is distributed as the target distribution, and so is the next one
// after an accepted child (from that child's row), whatever the drafted children are.
TEST(DraftAcceptanceTest, DeterministicDraftEmitsTheTargetDistribution) {
  constexpr int32_t kVocab = 5;
  constexpr int kRuns = 20000;
  // Under the anchor: 1, 3, 3 (a duplicate), 0; under entry 0: 2, 1.
  const Draft draft{{1, 3, 3, 0, 2, 1}, {-1, -1, -1, -1, 0, 0}, {1, 1, 1, 1, 1, 1}};
  std::vector<float> logits(7 * kVocab, 0.0f);
  const std::vector<double> anchor_probs = {0.1, 0.35, 0.05, 0.3, 0.2};
  const std::vector<double> child_probs = {0.25, 0.05, 0.4, 0.1, 0.2};
  for (int32_t token = 0; token < kVocab; ++token) {
    logits[token] = static_cast<float>(std::log(anchor_probs[token]));
    logits[kVocab + token] = static_cast<float>(std::log(child_probs[token]));  // after entry 0
  }
  struct Case {
    float temperature;
    int32_t top_k;
    float top_p;
  };
  for (const Case& c : {Case{1.0f, 0, 1.0f}, Case{0.6f, 0, 1.0f}, Case{1.3f, 3, 1.0f},
                        Case{1.0f, 0, 0.7f}, Case{0.8f, 4, 0.8f}}) {
    SCOPED_TRACE(::testing::Message() << "temperature " << c.temperature << " top_k " << c.top_k
                                      << " top_p " << c.top_p);
    SamplingParams params;
    params.temperature = c.temperature;
    params.top_k = c.top_k;
    params.top_p = c.top_p;
    std::vector<int> first(kVocab, 0);
    std::vector<int> after_entry0(kVocab, 0);
    for (int run = 0; run < kRuns; ++run) {
      params.seed = branch_seed(2026, static_cast<uint64_t>(run));
      const Acceptance result = accept_ok(draft, logits, kVocab, params, 17);
      const std::vector<TokenId> committed = result.committed_tokens(draft.tree());
      ++first[committed[0]];
      if (!result.accepted_entries.empty() && result.accepted_entries[0] == 0) {
        ++after_entry0[committed[1]];
      }
    }
    const std::vector<double> p_first = target_distribution(row_of(logits, kVocab, 0), params);
    const std::vector<double> p_next = target_distribution(row_of(logits, kVocab, 1), params);
    // At most 4 degrees of freedom: P(chi2 > 25) < 1e-4.
    EXPECT_LT(chi_square(first, p_first), 25.0);
    EXPECT_GT(std::accumulate(after_entry0.begin(), after_entry0.end(), 0), 500);
    EXPECT_LT(chi_square(after_entry0, p_next), 25.0);
  }
}

// A single child is accepted with probability min(1, p / q).
TEST(DraftAcceptanceTest, AcceptanceRateIsMinOfOneAndPOverQ) {
  constexpr int32_t kVocab = 4;
  constexpr int kRuns = 20000;
  const std::vector<double> probs = {0.2, 0.4, 0.3, 0.1};
  std::vector<float> logits(2 * kVocab, 0.0f);
  for (int32_t token = 0; token < kVocab; ++token) {
    logits[token] = static_cast<float>(std::log(probs[token]));
  }
  for (const float q : {0.5f, 0.8f, 0.15f, 1.0f}) {
    const Draft draft{{0}, {-1}, {q}};
    int accepted = 0;
    std::vector<int> bonus(kVocab, 0);
    for (int run = 0; run < kRuns; ++run) {
      SamplingParams params;
      params.seed = static_cast<uint64_t>(run);
      const Acceptance result = accept_ok(draft, logits, kVocab, params, 0);
      if (result.accepted_entries.empty()) {
        ++bonus[result.bonus_token];
      } else {
        ++accepted;
      }
    }
    const double rate = std::min(1.0, probs[0] / q);
    const double sigma = std::sqrt(rate * (1 - rate) / kRuns);
    EXPECT_NEAR(accepted / static_cast<double>(kRuns), rate, 5 * sigma + 1e-9) << "q " << q;
    // The residual: p(0) - q clipped at 0, renormalised.
    std::vector<double> residual = probs;
    residual[0] = std::max(0.0, probs[0] - q);
    const double total = std::accumulate(residual.begin(), residual.end(), 0.0);
    for (double& p : residual) p /= total;
    if (kRuns - accepted > 1000) {
      EXPECT_LT(chi_square(bonus, residual), 25.0) << "q " << q;
    }
  }
}

// ---- Draft distributions: exactness --------------------------------------------------------
// Multi-draft speculative sampling with the distribution the children were drawn from: the
// committed tokens are distributed as the target's, checked by chi-square goodness of fit over
// the first token and the first two tokens of a depth-2 tree across thousands of seeds. Every
// random number comes from fixed seeds through std::mt19937_64's raw bits (its sequence is
// standardised; std:: distributions are not), so each test is deterministic.

// Uniform in [0, 1) with 53 bits.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

std::vector<float> fixed_logits(std::mt19937_64& rng, size_t count) {
  std::vector<float> logits(count);
  for (float& logit : logits) logit = static_cast<float>(6.0 * uniform01(rng) - 3.0);
  return logits;
}

// A draft model's top-k distribution at a node: softmax(logits) over its `keep` most likely
// tokens, renormalised, listed most likely first.
DraftDistribution top_k_distribution(int32_t entry, std::span<const float> logits, int32_t keep) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  order.resize(static_cast<size_t>(keep));
  double total = 0.0;
  for (int32_t token : order) total += std::exp(static_cast<double>(logits[token]));
  DraftDistribution distribution{.entry = entry};
  for (int32_t token : order) {
    distribution.tokens.push_back(token);
    distribution.probs.push_back(
        static_cast<float>(std::exp(static_cast<double>(logits[token])) / total));
  }
  return distribution;
}

// `count` draws from q (normalised over its listed tokens), independent (with replacement) or
// each from q less the tokens drawn before (without).
std::vector<TokenId> draw_from(const DraftDistribution& q, int32_t count, DraftSampling sampling,
                               std::mt19937_64& rng) {
  std::vector<double> weights(q.probs.begin(), q.probs.end());
  std::vector<TokenId> drawn;
  for (int32_t i = 0; i < count; ++i) {
    const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
    const double target = uniform01(rng) * total;
    double cumulative = 0.0;
    size_t chosen = 0;
    for (size_t slot = 0; slot < weights.size(); ++slot) {
      if (weights[slot] == 0.0) continue;
      chosen = slot;
      cumulative += weights[slot];
      if (cumulative > target) break;
    }
    drawn.push_back(q.tokens[chosen]);
    if (sampling == DraftSampling::kWithoutReplacement) weights[chosen] = 0.0;
  }
  return drawn;
}

double draft_prob_of(const DraftDistribution& q, TokenId token) {
  for (size_t i = 0; i < q.tokens.size(); ++i) {
    if (q.tokens[i] == token) return q.probs[i];
  }
  return 0.0;
}

// Pearson's chi-square with the cells expected fewer than 5 times pooled into one (the
// chi-square approximation needs about 5 per cell); a zero-probability cell must stay empty.
struct ChiSquare {
  double statistic = 0.0;
  int degrees_of_freedom = 0;
  // The critical value at a tail probability of about 3e-5 (z = 4, Wilson-Hilferty): a correct
  // sampler passes a fixed-seed test with near certainty, a biased one of these sizes fails.
  double limit() const {
    const double k = degrees_of_freedom;
    const double a = 2.0 / (9.0 * k);
    return k * std::pow(1.0 - a + 4.0 * std::sqrt(a), 3.0);
  }
};

ChiSquare pooled_chi_square(const std::vector<int>& counts, const std::vector<double>& expected) {
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  ChiSquare result;
  double pooled_count = 0.0;
  double pooled_expected = 0.0;
  int cells = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "cell " << i << " has target probability 0";
      continue;
    }
    const double e = expected[i] * total;
    if (e < 5.0) {
      pooled_count += counts[i];
      pooled_expected += e;
      continue;
    }
    result.statistic += (counts[i] - e) * (counts[i] - e) / e;
    ++cells;
  }
  if (pooled_expected > 0.0) {
    result.statistic +=
        (pooled_count - pooled_expected) * (pooled_count - pooled_expected) / pooled_expected;
    ++cells;
  }
  result.degrees_of_freedom = std::max(1, cells - 1);
  return result;
}

// A target model over a small vocabulary: logits at the anchor, after each first token, and
// (the same row) after any deeper entry.
struct TargetModel {
  static constexpr int32_t kVocab = 12;
  std::vector<float> anchor;
  std::vector<std::vector<float>> after_first;  // [first token]
  std::vector<float> deeper;

  explicit TargetModel(uint64_t seed) {
    std::mt19937_64 rng(seed);
    anchor = fixed_logits(rng, kVocab);
    for (int32_t token = 0; token < kVocab; ++token) {
      after_first.push_back(fixed_logits(rng, kVocab));
    }
    deeper = fixed_logits(rng, kVocab);
  }

  // The target rows a verify of `draft` reads: row 0 the anchor's, then one per entry.
  std::vector<float> rows(const Draft& draft) const {
    std::vector<float> logits = anchor;
    for (int32_t entry = 0; entry < draft.size(); ++entry) {
      const std::vector<float>& row =
          draft.parents[entry] < 0 ? after_first[draft.tokens[entry]] : deeper;
      logits.insert(logits.end(), row.begin(), row.end());
    }
    return logits;
  }
};

// What many seeded verifies of freshly drafted trees commit: the first token, and the first
// two (the second, when the verify committed one token, is the Sampler's draw that plain
// decoding would make next, from the target row after the first).
struct CommittedCounts {
  std::vector<int> first = std::vector<int>(TargetModel::kVocab, 0);
  std::vector<int> first_two = std::vector<int>(TargetModel::kVocab * TargetModel::kVocab, 0);
  int drafted_first_accepted = 0;  // runs whose first token is a drafted child's
  int all_first_rejected = 0;      // runs whose first token is the residual bonus

  // The target's distribution of the first token and of the first two.
  static std::pair<std::vector<double>, std::vector<double>> expected(
      const TargetModel& target, const SamplingParams& params) {
    const std::vector<double> first = target_distribution(target.anchor, params);
    std::vector<double> first_two;
    for (int32_t a = 0; a < TargetModel::kVocab; ++a) {
      const std::vector<double> next = target_distribution(target.after_first[a], params);
      for (double p : next) first_two.push_back(first[a] * p);
    }
    return {first, first_two};
  }
};

CommittedCounts count_committed(const TargetModel& target, SamplingParams params, int runs,
                                uint64_t draft_seed,
                                const std::function<Draft(std::mt19937_64&)>& make_draft) {
  constexpr uint64_t kStep = 40;
  constexpr int32_t kVocab = TargetModel::kVocab;
  std::mt19937_64 rng(draft_seed);
  Sampler sampler;
  CommittedCounts counts;
  for (int run = 0; run < runs; ++run) {
    const Draft draft = make_draft(rng);
    params.seed = branch_seed(draft_seed, static_cast<uint64_t>(run));
    const Acceptance result = accept_ok(draft, target.rows(draft), kVocab, params, kStep);
    const std::vector<TokenId> committed = result.committed_tokens(draft.tree());
    TokenId second = -1;
    if (committed.size() >= 2) {
      second = committed[1];
    } else {
      const absl::StatusOr<SampledToken> next =
          sampler.sample(target.after_first[committed[0]], params, kStep + 1);
      EXPECT_TRUE(next.ok()) << next.status();
      second = next.ok() ? next->token : 0;
    }
    ++counts.first[committed[0]];
    ++counts.first_two[committed[0] * kVocab + second];
    if (result.accepted_entries.empty()) {
      ++counts.all_first_rejected;
    } else {
      ++counts.drafted_first_accepted;
    }
  }
  return counts;
}

struct SamplingCase {
  float temperature;
  int32_t top_k;
  float top_p;
};
const SamplingCase kSamplingCases[] = {{1.0f, 0, 1.0f}, {0.7f, 6, 1.0f}, {1.2f, 0, 0.8f}};

SamplingParams params_of(const SamplingCase& c) {
  SamplingParams params;
  params.temperature = c.temperature;
  params.top_k = c.top_k;
  params.top_p = c.top_p;
  return params;
}

// A draft model unlike the target (its own random logits), drafting top-8 at the anchor and
// top-6 after each first token.
struct DraftModel {
  DraftDistribution anchor;
  std::vector<DraftDistribution> after_first;  // [first token], entry field unset

  explicit DraftModel(uint64_t seed) {
    std::mt19937_64 rng(seed);
    anchor = top_k_distribution(-1, fixed_logits(rng, TargetModel::kVocab), 8);
    for (int32_t token = 0; token < TargetModel::kVocab; ++token) {
      after_first.push_back(top_k_distribution(0, fixed_logits(rng, TargetModel::kVocab), 6));
    }
  }

  // Three children of the anchor drawn from its distribution, two under each drawn from theirs;
  // with the distributions (the new rule), or with each drafted token's probability only
  // (draft_probs: the older rule).
  Draft draft(std::mt19937_64& rng, DraftSampling sampling, bool as_draft_probs) const {
    Draft tree;
    tree.sampling = sampling;
    const std::vector<TokenId> firsts = draw_from(anchor, 3, sampling, rng);
    tree.distributions.push_back(anchor);
    for (TokenId token : firsts) {
      tree.tokens.push_back(token);
      tree.parents.push_back(-1);
      tree.draft_probs.push_back(static_cast<float>(draft_prob_of(anchor, token)));
    }
    for (int32_t i = 0; i < 3; ++i) {
      DraftDistribution q = after_first[firsts[i]];
      q.entry = i;
      for (TokenId token : draw_from(q, 2, sampling, rng)) {
        tree.tokens.push_back(token);
        tree.parents.push_back(i);
        tree.draft_probs.push_back(static_cast<float>(draft_prob_of(q, token)));
      }
      tree.distributions.push_back(std::move(q));
    }
    if (as_draft_probs) {
      tree.distributions.clear();
      tree.sampling = DraftSampling::kUnspecified;
    } else {
      tree.draft_probs.clear();
    }
    return tree;
  }
};

TEST(DraftAcceptanceTest, SampledDraftsWithDistributionsEmitTheTargetDistribution) {
  constexpr int kRuns = 30000;
  const TargetModel target(101);
  const DraftModel draft_model(202);
  for (const DraftSampling sampling :
       {DraftSampling::kWithReplacement, DraftSampling::kWithoutReplacement}) {
    for (const SamplingCase& c : kSamplingCases) {
      SCOPED_TRACE(::testing::Message()
                   << (sampling == DraftSampling::kWithReplacement ? "with" : "without")
                   << " replacement, temperature " << c.temperature << " top_k " << c.top_k
                   << " top_p " << c.top_p);
      const SamplingParams params = params_of(c);
      const CommittedCounts counts =
          count_committed(target, params, kRuns, 303, [&](std::mt19937_64& rng) {
            return draft_model.draft(rng, sampling, /*as_draft_probs=*/false);
          });
      // Both ways of emitting the first token occur often.
      EXPECT_GT(counts.drafted_first_accepted, kRuns / 10);
      EXPECT_GT(counts.all_first_rejected, kRuns / 20);
      const auto [p_first, p_first_two] = CommittedCounts::expected(target, params);
      const ChiSquare first = pooled_chi_square(counts.first, p_first);
      EXPECT_LT(first.statistic, first.limit()) << "first token, df " << first.degrees_of_freedom;
      const ChiSquare first_two = pooled_chi_square(counts.first_two, p_first_two);
      EXPECT_LT(first_two.statistic, first_two.limit())
          << "first two tokens, df " << first_two.degrees_of_freedom;
    }
  }
}

// The older rule (draft_probs: each drafted token's own probability only) is exact only for
// deterministic drafts: on the same sampled drafts its first token is visibly biased. This is
// the documented limit that the distributions remove, not a defect to fix.
TEST(DraftAcceptanceTest, DraftProbsAloneAreNotExactForSampledDrafts) {
  constexpr int kRuns = 30000;
  const TargetModel target(101);
  const DraftModel draft_model(202);
  const SamplingParams params = params_of(kSamplingCases[0]);
  const CommittedCounts counts =
      count_committed(target, params, kRuns, 303, [&](std::mt19937_64& rng) {
        return draft_model.draft(rng, DraftSampling::kWithReplacement, /*as_draft_probs=*/true);
      });
  const ChiSquare first =
      pooled_chi_square(counts.first, CommittedCounts::expected(target, params).first);
  EXPECT_GT(first.statistic, 10 * first.limit())
      << "expected a biased first token, df " << first.degrees_of_freedom;
}

// Deterministic drafts (the draft's argmax, q = 1) stay exact under both rules: as a
// distribution of one token, and as draft_probs of 1 (also for several children).
TEST(DraftAcceptanceTest, DeterministicDraftsStayExact) {
  constexpr int kRuns = 20000;
  const TargetModel target(101);
  const DraftModel draft_model(202);
  const auto greedy_chain = [&](bool as_draft_probs) {
    return [&, as_draft_probs](std::mt19937_64&) {
      Draft tree;
      const TokenId first = draft_model.anchor.tokens[0];  // listed most likely first
      const TokenId second = draft_model.after_first[first].tokens[0];
      tree.tokens = {first, second};
      tree.parents = {-1, 0};
      if (as_draft_probs) {
        tree.draft_probs = {1.0f, 1.0f};
      } else {
        tree.sampling = DraftSampling::kWithoutReplacement;
        tree.distributions = {{.entry = -1, .tokens = {first}, .probs = {1.0f}},
                              {.entry = 0, .tokens = {second}, .probs = {1.0f}}};
      }
      return tree;
    };
  };
  // The two most likely tokens of the draft as deterministic siblings, each with q = 1.
  const auto top_two = [&](std::mt19937_64&) {
    Draft tree;
    tree.tokens = {draft_model.anchor.tokens[0], draft_model.anchor.tokens[1]};
    tree.parents = {-1, -1};
    tree.draft_probs = {1.0f, 1.0f};
    return tree;
  };
  for (const SamplingCase& c : kSamplingCases) {
    const SamplingParams params = params_of(c);
    const auto [p_first, p_first_two] = CommittedCounts::expected(target, params);
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(::testing::Message()
                   << "variant " << variant << ", temperature " << c.temperature << " top_k "
                   << c.top_k << " top_p " << c.top_p);
      const std::function<Draft(std::mt19937_64&)> make_draft =
          variant == 2 ? std::function<Draft(std::mt19937_64&)>(top_two)
                       : greedy_chain(/*as_draft_probs=*/variant == 1);
      const CommittedCounts counts = count_committed(target, params, kRuns, 404, make_draft);
      const ChiSquare first = pooled_chi_square(counts.first, p_first);
      EXPECT_LT(first.statistic, first.limit());
      const ChiSquare first_two = pooled_chi_square(counts.first_two, p_first_two);
      EXPECT_LT(first_two.statistic, first_two.limit());
    }
  }
}

// A draft distribution equal to the target's: the first child is always accepted (p / q = 1).
TEST(DraftAcceptanceTest, DraftEqualToTheTargetIsAlwaysAccepted) {
  const TargetModel target(7);
  SamplingParams params;
  params.temperature = 0.9f;
  const std::vector<double> p = target_distribution(target.anchor, params);
  DraftDistribution q{.entry = -1};
  for (int32_t token = 0; token < TargetModel::kVocab; ++token) {
    q.tokens.push_back(token);
    q.probs.push_back(static_cast<float>(p[token]));
  }
  std::mt19937_64 rng(8);
  for (int run = 0; run < 2000; ++run) {
    const DraftSampling sampling =
        run % 2 == 0 ? DraftSampling::kWithReplacement : DraftSampling::kWithoutReplacement;
    Draft draft;
    draft.sampling = sampling;
    draft.distributions = {q};
    draft.tokens = draw_from(q, 2, sampling, rng);
    draft.parents = {-1, -1};
    params.seed = static_cast<uint64_t>(run);
    const Acceptance result = accept_ok(draft, target.rows(draft), TargetModel::kVocab, params, 3);
    ASSERT_THAT(result.accepted_entries, ElementsAre(0)) << "run " << run;
  }
}

// One child drawn from q is accepted with probability sum(min(p, q)), and the residual bonus
// after its rejection is max(0, p - q) normalised.
TEST(DraftAcceptanceTest, DistributionAcceptanceRateAndResidual) {
  constexpr int32_t kVocab = 4;
  constexpr int kRuns = 40000;
  const std::vector<double> p = {0.2, 0.4, 0.3, 0.1};
  std::vector<float> logits(2 * kVocab, 0.0f);
  for (int32_t token = 0; token < kVocab; ++token) {
    logits[token] = static_cast<float>(std::log(p[token]));
  }
  // Listed as raw probabilities summing to 0.8: the server normalises them (0.625, 0.125, 0.25).
  const DraftDistribution q{.entry = -1, .tokens = {0, 1, 3}, .probs = {0.5f, 0.1f, 0.2f}};
  const std::vector<double> q_normalised = {0.625, 0.125, 0.0, 0.25};
  std::mt19937_64 rng(5);
  int accepted = 0;
  std::vector<int> bonus(kVocab, 0);
  for (int run = 0; run < kRuns; ++run) {
    Draft draft;
    draft.sampling = DraftSampling::kWithReplacement;
    draft.distributions = {q};
    draft.tokens = draw_from(q, 1, draft.sampling, rng);
    draft.parents = {-1};
    SamplingParams params;
    params.seed = static_cast<uint64_t>(run);
    const Acceptance result = accept_ok(draft, logits, kVocab, params, 0);
    if (result.accepted_entries.empty()) {
      ++bonus[result.bonus_token];
    } else {
      ++accepted;
    }
  }
  double rate = 0.0;
  std::vector<double> residual(kVocab);
  for (int32_t token = 0; token < kVocab; ++token) {
    rate += std::min(p[token], q_normalised[token]);
    residual[token] = std::max(0.0, p[token] - q_normalised[token]);
  }
  const double residual_total = std::accumulate(residual.begin(), residual.end(), 0.0);
  for (double& r : residual) r /= residual_total;
  const double sigma = std::sqrt(rate * (1 - rate) / kRuns);
  EXPECT_NEAR(accepted / static_cast<double>(kRuns), rate, 5 * sigma);
  const ChiSquare residual_fit = pooled_chi_square(bonus, residual);
  EXPECT_LT(residual_fit.statistic, residual_fit.limit());
}

// A tree may give distributions for some nodes only: the others use the target-draw rule (exact
// for any draft), and greedy ignores the distributions.
TEST(DraftAcceptanceTest, NodesWithoutADistributionUseTheTargetDraw) {
  constexpr int32_t kVocab = 50;
  constexpr int32_t kChain = 4;
  std::mt19937_64 rng(12);
  Sampler sampler;
  for (int trial = 0; trial < 30; ++trial) {
    SamplingParams params;
    params.temperature = 0.8f;
    params.seed = rng();
    const std::vector<float> logits = random_logits(rng, (kChain + 1) * kVocab);
    // The chain plain decoding samples, with a distribution at the leaf's parent only: a
    // one-token distribution of the last drafted token (accepted with probability p(x)).
    Draft draft;
    std::vector<SampledToken> plain;
    for (int32_t position = 0; position <= kChain; ++position) {
      absl::StatusOr<SampledToken> token =
          sampler.sample(row_of(logits, kVocab, position), params, 9 + position);
      ASSERT_TRUE(token.ok());
      plain.push_back(*token);
    }
    for (int32_t i = 0; i < kChain; ++i) {
      draft.tokens.push_back(plain[i].token);
      draft.parents.push_back(i - 1);
    }
    draft.sampling = DraftSampling::kWithReplacement;
    draft.distributions = {
        {.entry = kChain - 2, .tokens = {plain[kChain - 1].token}, .probs = {1.0f}}};
    const Acceptance result = accept_ok(draft, logits, kVocab, params, 9);
    // Up to the distribution's node every level is the Sampler's draw; it accepts the last
    // drafted token only when the target's p(x) / 1 test passes; either way the path so far is
    // plain decoding's.
    ASSERT_GE(result.accepted_entries.size(), static_cast<size_t>(kChain - 1));
    EXPECT_THAT(std::vector<int32_t>(result.accepted_entries.begin(),
                                     result.accepted_entries.begin() + (kChain - 1)),
                ElementsAre(0, 1, 2));
    if (result.accepted_entries.size() == kChain) {
      EXPECT_EQ(result.bonus_token, plain[kChain].token);  // the leaf's bonus: the Sampler's
    }
    const Acceptance greedy = accept_ok(draft, logits, kVocab, greedy_params(), 9);
    Draft without = draft;
    without.distributions.clear();
    const Acceptance greedy_without = accept_ok(without, logits, kVocab, greedy_params(), 9);
    EXPECT_EQ(greedy.accepted_entries, greedy_without.accepted_entries);
    EXPECT_EQ(greedy.bonus_token, greedy_without.bonus_token);
  }
}

// Replays are identical, whatever the seed.
TEST(DraftAcceptanceTest, DistributionRuleReplaysIdentically) {
  const TargetModel target(31);
  const DraftModel draft_model(32);
  std::mt19937_64 rng(33);
  for (int trial = 0; trial < 300; ++trial) {
    const DraftSampling sampling =
        trial % 2 == 0 ? DraftSampling::kWithReplacement : DraftSampling::kWithoutReplacement;
    const Draft draft = draft_model.draft(rng, sampling, /*as_draft_probs=*/false);
    SamplingParams params = params_of(kSamplingCases[trial % 3]);
    params.seed = rng();
    const std::vector<float> logits = target.rows(draft);
    const Acceptance first = accept_ok(draft, logits, TargetModel::kVocab, params, trial);
    const Acceptance second = accept_ok(draft, logits, TargetModel::kVocab, params, trial);
    EXPECT_EQ(first.accepted_entries, second.accepted_entries);
    EXPECT_EQ(first.bonus_token, second.bonus_token);
    EXPECT_EQ(first.bonus_logprob, second.bonus_logprob);
  }
}

// ---- Validation ----------------------------------------------------------------------------

std::string invalid_tree_message(const Draft& draft, int32_t vocab = 10, int32_t max_entries = 8) {
  const absl::Status status = validate_draft_tree(draft.tree(), vocab, max_entries);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  return std::string(status.message());
}

TEST(DraftAcceptanceTest, ValidationNamesTheEntry) {
  EXPECT_TRUE(validate_draft_tree(kBranchy.tree(), 10, 8).ok());
  EXPECT_THAT(invalid_tree_message(Draft{}), HasSubstr("no entries"));
  EXPECT_THAT(invalid_tree_message(kBranchy, 10, 4),
              HasSubstr("5 entries, more than the limit of 4"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1}, {}}), HasSubstr("2 tokens but 1 parents"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {0.5f}}),
              HasSubstr("2 tokens but 1 draft probs"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 10}, {-1, 0}, {}}),
              HasSubstr("entry 1: token 10 outside the vocabulary [0, 10)"));
  EXPECT_THAT(invalid_tree_message(Draft{{-1}, {-1}, {}}), HasSubstr("entry 0: token -1"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2, 3}, {-1, 0, 2}, {}}),
              HasSubstr("entry 2: parent 2 must be -1 (the anchor) or an earlier entry in [0, 2)"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 5}, {}}), HasSubstr("entry 1: parent 5"));
  EXPECT_THAT(invalid_tree_message(Draft{{1}, {0}, {}}), HasSubstr("entry 0: parent 0"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, -2}, {}}), HasSubstr("entry 1: parent -2"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {0.5f, 0.0f}}),
              HasSubstr("entry 1: draft prob 0 must be in (0, 1]"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {1.5f, 0.5f}}),
              HasSubstr("entry 0: draft prob 1.5"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {0.5f, kNan}}),
              HasSubstr("entry 1: draft prob nan"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {kInf, 0.5f}}),
              HasSubstr("entry 0: draft prob inf"));
  EXPECT_THAT(invalid_tree_message(Draft{{1, 2}, {-1, 0}, {-0.5f, 0.5f}}),
              HasSubstr("entry 0: draft prob -0.5"));
}

// A valid tree with distributions: 0:(3) 1:(4) under the anchor, 2:(5) 3:(6) under entry 1.
Draft distribution_draft() {
  Draft draft;
  draft.tokens = {3, 4, 5, 6};
  draft.parents = {-1, -1, 1, 1};
  draft.sampling = DraftSampling::kWithoutReplacement;
  draft.distributions = {{.entry = -1, .tokens = {3, 4, 7}, .probs = {0.5f, 0.25f, 0.25f}},
                         {.entry = 1, .tokens = {6, 5}, .probs = {0.5f, 0.4f}}};
  return draft;
}

TEST(DraftAcceptanceTest, DistributionValidationNamesTheField) {
  EXPECT_TRUE(validate_draft_tree(distribution_draft().tree(), 10, 8).ok());
  const auto message = [](const std::function<void(Draft&)>& change, int64_t max_tokens = 100) {
    Draft draft = distribution_draft();
    change(draft);
    const absl::Status status = validate_draft_tree(draft.tree(), 10, 8, max_tokens);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    return std::string(status.message());
  };
  EXPECT_THAT(message([](Draft& d) {
                d.draft_probs = {1, 1, 1, 1};
              }),
              HasSubstr("give draft_probs or draft_distributions, not both"));
  EXPECT_THAT(message([](Draft& d) { d.sampling = DraftSampling::kUnspecified; }),
              HasSubstr("draft_distributions need draft_sampling"));
  EXPECT_THAT(message([](Draft& d) {
                for (int i = 0; i < 4; ++i) d.distributions.push_back(d.distributions[1]);
              }),
              HasSubstr("6 draft_distributions, more than the 5 nodes"));
  EXPECT_THAT(message([](Draft&) {}, 4),
              HasSubstr("list 5 tokens in all, more than the limit of 4"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[1].entry = 4; }),
              HasSubstr("draft_distributions[1] (entry 4): entry must be -1 (the anchor) or an "
                        "entry in [0, 4)"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[1].entry = -2; }),
              HasSubstr("draft_distributions[1] (entry -2)"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[1].entry = -1; }),
              HasSubstr("draft_distributions[1] (entry -1): draft_distributions[0] describes the "
                        "same node"));
  EXPECT_THAT(message([](Draft& d) {
                d.distributions[1].tokens.clear();
                d.distributions[1].probs.clear();
              }),
              HasSubstr("draft_distributions[1] (entry 1): no tokens"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[0].probs.pop_back(); }),
              HasSubstr("draft_distributions[0] (entry -1): 3 tokens but 2 probs"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[0].tokens[2] = 10; }),
              HasSubstr("draft_distributions[0] (entry -1): tokens[2] = 10 outside the "
                        "vocabulary [0, 10)"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[0].tokens[2] = -1; }),
              HasSubstr("tokens[2] = -1 outside"));
  for (const float bad : {0.0f, -0.5f, 1.5f, kNan, kInf}) {
    EXPECT_THAT(message([bad](Draft& d) { d.distributions[1].probs[1] = bad; }),
                HasSubstr("draft_distributions[1] (entry 1): probs[1] = "))
        << bad;
  }
  EXPECT_THAT(message([](Draft& d) {
                d.distributions[1].probs = {0.7f, 0.4f};
              }),
              HasSubstr("draft_distributions[1] (entry 1): probs sum to 1.1"));
  EXPECT_THAT(message([](Draft& d) { d.distributions[0].tokens[2] = 3; }),
              HasSubstr("draft_distributions[0] (entry -1): token 3 listed twice (tokens[0] and "
                        "tokens[2])"));
  EXPECT_THAT(message([](Draft& d) { d.tokens[3] = 7; }),
              HasSubstr("entry 3: token 7 is not in draft_distributions[1], the distribution of "
                        "its parent (entry 1)"));
  EXPECT_THAT(message([](Draft& d) { d.tokens[1] = 3; }),
              HasSubstr("entry 1: token 3 repeats its sibling entry 0; children drawn without "
                        "replacement have distinct tokens"));
  EXPECT_THAT(message([](Draft& d) {
                d.distributions.push_back({.entry = 2, .tokens = {1}, .probs = {1.0f}});
              }),
              HasSubstr("draft_distributions[2] (entry 2): the node has no drafted children"));
  // Allowed: repeated siblings drawn with replacement, probs summing to under 1 or to 1 within
  // rounding, a node without a distribution, draft_sampling without distributions.
  Draft ok = distribution_draft();
  ok.sampling = DraftSampling::kWithReplacement;
  ok.tokens[1] = 3;
  ok.parents = {-1, -1, 0, 0};
  ok.distributions[1].entry = 0;
  EXPECT_TRUE(validate_draft_tree(ok.tree(), 10, 8).ok());
  ok.distributions[0].probs = {0.5f, 0.25f, 0.2505f};
  ok.distributions.pop_back();
  EXPECT_TRUE(validate_draft_tree(ok.tree(), 10, 8).ok());
  ok.distributions.clear();
  EXPECT_TRUE(validate_draft_tree(ok.tree(), 10, 8).ok());
}

// Random trees with valid distributions pass and go through the acceptance; one random damage
// (of a kind validation must catch) makes them fail with INVALID_ARGUMENT. Fixed seed.
TEST(DraftAcceptanceTest, FuzzDistributions) {
  constexpr int32_t kVocab = 9;
  std::mt19937_64 rng(424242);
  for (int trial = 0; trial < 5000; ++trial) {
    Draft draft;
    draft.sampling =
        rng() % 2 == 0 ? DraftSampling::kWithReplacement : DraftSampling::kWithoutReplacement;
    // Children of each node drawn from its own random distribution (three nodes in four have
    // one), without replacement when so declared.
    const auto attempts = static_cast<int32_t>(1 + rng() % 10);
    std::vector<std::optional<DraftDistribution>> of_node(static_cast<size_t>(attempts) + 1);
    std::vector<std::vector<TokenId>> taken(static_cast<size_t>(attempts) + 1);
    for (int32_t attempt = 0; attempt < attempts; ++attempt) {
      const int32_t entry = draft.size();
      const int32_t parent = static_cast<int32_t>(rng() % (entry + 1)) - 1;
      std::optional<DraftDistribution>& q = of_node[static_cast<size_t>(parent) + 1];
      if (!q && taken[static_cast<size_t>(parent) + 1].empty() && rng() % 4 != 0) {
        q = top_k_distribution(parent, random_logits(rng, kVocab),
                               2 + static_cast<int32_t>(rng() % 7));
      }
      auto token = static_cast<TokenId>(rng() % kVocab);
      if (q) {
        std::vector<TokenId>& used = taken[static_cast<size_t>(parent) + 1];
        DraftDistribution from = *q;
        if (draft.sampling == DraftSampling::kWithoutReplacement) {
          for (size_t i = 0; i < from.tokens.size(); ++i) {
            if (std::find(used.begin(), used.end(), from.tokens[i]) != used.end()) {
              from.probs[i] = 0.0f;
            }
          }
          if (std::all_of(from.probs.begin(), from.probs.end(),
                          [](float prob) { return prob == 0.0f; })) {
            continue;  // the node's support is used up
          }
        }
        token = draw_from(from, 1, DraftSampling::kWithReplacement, rng)[0];
      }
      taken[static_cast<size_t>(parent) + 1].push_back(token);
      draft.tokens.push_back(token);
      draft.parents.push_back(parent);
    }
    const int32_t entries = draft.size();
    for (size_t node = 0; node < of_node.size(); ++node) {
      if (!of_node[node] || taken[node].empty()) continue;
      draft.distributions.push_back(*of_node[node]);
    }
    absl::Status status = validate_draft_tree(draft.tree(), kVocab, 16, 1000);
    ASSERT_TRUE(status.ok()) << "trial " << trial << ": " << status;
    SamplingParams params;
    params.temperature = 0.5f + static_cast<float>(rng() % 3) * 0.5f;
    params.top_k = static_cast<int32_t>(rng() % 4);
    params.seed = rng();
    const Acceptance result =
        accept_ok(draft, random_logits(rng, (draft.size() + 1) * kVocab), kVocab, params, trial);
    int32_t parent = -1;
    for (int32_t entry : result.accepted_entries) {
      ASSERT_EQ(draft.parents[entry], parent) << "trial " << trial;
      parent = entry;
    }
    ASSERT_GE(result.bonus_token, 0);
    ASSERT_LT(result.bonus_token, kVocab);
    if (draft.distributions.empty()) continue;

    // One damage that validation must refuse.
    Draft bad = draft;
    DraftDistribution& victim = bad.distributions[rng() % bad.distributions.size()];
    switch (rng() % 7) {
      case 0:
        victim.tokens[rng() % victim.tokens.size()] = kVocab + static_cast<TokenId>(rng() % 5);
        break;
      case 1:
        victim.probs[rng() % victim.probs.size()] = -victim.probs[0];
        break;
      case 2:
        victim.probs.push_back(0.1f);
        break;
      case 3:
        victim.entry = entries + static_cast<int32_t>(rng() % 3);
        break;
      case 4:
        bad.distributions.push_back(victim);
        break;
      case 5:
        bad.draft_probs.assign(draft.tokens.size(), 0.5f);
        break;
      case 6:
        bad.sampling = DraftSampling::kUnspecified;
        break;
    }
    status = validate_draft_tree(bad.tree(), kVocab, 16, 1000);
    ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "trial " << trial;
    EXPECT_FALSE(accept_draft_tree(bad.tree(), random_logits(rng, (bad.size() + 1) * kVocab),
                                   kVocab, params, 0)
                     .ok());
  }
}

TEST(DraftAcceptanceTest, AcceptRejectsBadInputs) {
  constexpr int32_t kVocab = 8;
  const std::vector<float> logits = peaked_rows(kVocab, {4, 0, 6, 0, 0, 0});
  auto code_and_message = [&](const Draft& draft, std::span<const float> rows, int32_t vocab,
                              const SamplingParams& params) {
    const absl::StatusOr<Acceptance> result =
        accept_draft_tree(draft.tree(), rows, vocab, params, 0);
    EXPECT_FALSE(result.ok());
    return result.status();
  };
  absl::Status status =
      code_and_message(kBranchy, std::span(logits).first(5 * kVocab), kVocab, greedy_params());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("logits hold 40 floats, want (5 entries + 1) rows of 8"));
  status = code_and_message(kBranchy, logits, 0, greedy_params());
  EXPECT_THAT(status.message(), HasSubstr("vocab_size must be >= 1, got 0"));
  status = code_and_message(kBranchy, logits, 5, greedy_params());  // token 5 outside [0, 5)
  EXPECT_THAT(status.message(), HasSubstr("entry 2: token 5 outside"));
  SamplingParams bad = greedy_params();
  bad.top_p = 0.0f;
  status = code_and_message(kBranchy, logits, kVocab, bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("top_p"));
  // Draft mode: a bad row on the walk is INTERNAL, naming the row.
  std::vector<float> nan_logits = logits;
  nan_logits[2 * kVocab + 1] = kNan;  // row 2: after entry 1, which row 0 accepts
  Draft with_probs = kBranchy;
  with_probs.draft_probs = {1, 1, 1, 1, 1};
  SamplingParams sampling;
  sampling.temperature = 0.01f;
  status = code_and_message(with_probs, nan_logits, kVocab, sampling);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("target row 2: logit of token 1 is nan"));
}

// Random parent arrays, tokens and probs: validate_draft_tree never crashes and accepts exactly
// the trees the rules allow; every accepted tree goes through accept_draft_tree.
TEST(DraftAcceptanceTest, FuzzValidateDraftTree) {
  constexpr int32_t kVocab = 7;
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const std::vector<float> prob_values = {0.0f, -0.25f, 0.3f,  1.0f,   1.0001f, 2.0f,
                                          kNan, kInf,   -kInf, 1e-30f, 0.999f};
  int valid_count = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const auto entries = static_cast<int32_t>(rng() % 10);
    const int32_t max_entries = rng() % 4 == 0 ? static_cast<int32_t>(rng() % 10) : 16;
    Draft draft;
    bool valid = entries > 0 && entries <= max_entries;
    for (int32_t entry = 0; entry < entries; ++entry) {
      // Mostly plausible values, sometimes anything nearby: out of the vocabulary, a parent
      // below -1, the entry itself, a later entry.
      const TokenId token = rng() % 20 == 0 ? static_cast<TokenId>(rng() % 20) - 10
                                            : static_cast<TokenId>(rng() % kVocab);
      const int32_t parent = rng() % 10 == 0 ? static_cast<int32_t>(rng() % (entries + 4)) - 3
                                             : static_cast<int32_t>(rng() % (entry + 1)) - 1;
      draft.tokens.push_back(token);
      draft.parents.push_back(parent);
      valid = valid && token >= 0 && token < kVocab && parent >= -1 && parent < entry;
    }
    const int probs_mode = static_cast<int>(rng() % 4);  // none, good, random, bad size
    if (probs_mode == 1) {
      for (int32_t entry = 0; entry < entries; ++entry) draft.draft_probs.push_back(0.5f);
    } else if (probs_mode == 2) {
      for (int32_t entry = 0; entry < entries; ++entry) {
        const float prob = prob_values[rng() % prob_values.size()];
        draft.draft_probs.push_back(prob);
        valid = valid && prob > 0.0f && prob <= 1.0f;
      }
    } else if (probs_mode == 3) {
      draft.draft_probs.assign(static_cast<size_t>(entries) + 1 + rng() % 2, 0.5f);
      valid = false;
    }
    if (rng() % 20 == 0 && entries > 0) {  // parents size mismatch
      draft.parents.pop_back();
      valid = false;
    }
    const absl::Status status = validate_draft_tree(draft.tree(), kVocab, max_entries);
    ASSERT_EQ(status.ok(), valid) << "seed " << seed << " trial " << trial << ": " << status;
    if (!status.ok()) {
      ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    ++valid_count;
    const std::vector<float> logits = random_logits(rng, (draft.size() + 1) * kVocab);
    SamplingParams params;
    params.temperature = static_cast<float>(rng() % 3) * 0.5f;
    params.seed = rng();
    const Acceptance result = accept_ok(draft, logits, kVocab, params, rng() % 100);
    int32_t parent = -1;
    for (int32_t entry : result.accepted_entries) {
      ASSERT_EQ(draft.parents[entry], parent) << "seed " << seed << " trial " << trial;
      parent = entry;
    }
    ASSERT_GE(result.bonus_token, 0);
    ASSERT_LT(result.bonus_token, kVocab);
  }
  EXPECT_GT(valid_count, 1000) << "seed " << seed;
}

}  // namespace
}  // namespace deft::engine
