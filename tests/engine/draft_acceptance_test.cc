#include "engine/draft_acceptance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
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
  DraftTree tree() const { return {tokens, parents, draft_probs}; }
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
