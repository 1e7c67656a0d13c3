#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deft::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> logits_of(const std::vector<double>& probabilities) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(p > 0 ? static_cast<float>(std::log(p)) : kNegInf);
  return logits;
}

// Counts of each token over `draws` steps of one seed.
std::vector<int> histogram(Sampler& sampler, const std::vector<float>& logits,
                           const SamplingParams& params, int draws) {
  std::vector<int> counts(logits.size(), 0);
  for (int step = 0; step < draws; ++step) {
    absl::StatusOr<SampledToken> token = sampler.sample(logits, params, step);
    EXPECT_TRUE(token.ok()) << token.status();
    ++counts[token->token];
  }
  return counts;
}

// Pearson's chi-square of `counts` against `expected` probabilities (zero-probability tokens
// must have zero counts).
double chi_square(const std::vector<int>& counts, const std::vector<double>& expected) {
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  double statistic = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = expected[i] * total;
    statistic += (counts[i] - e) * (counts[i] - e) / e;
  }
  return statistic;
}

std::vector<double> normalised(std::vector<double> weights) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double& w : weights) w /= total;
  return weights;
}

// Upper 0.1% points of chi-square (the draws are fixed by the seeds, so these either pass
// or fail deterministically; the bound says the sampler is right, not lucky).
constexpr double kChiSquare999[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88};

TEST(PhiloxTest, KnownAnswers) {
  // Known-answer vectors of Random123 (kat_vectors, philox4x32 with 10 rounds).
  EXPECT_THAT(philox4x32_10({0, 0, 0, 0}, {0, 0}),
              ElementsAre(0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u));
  EXPECT_THAT(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                            {0xffffffffu, 0xffffffffu}),
              ElementsAre(0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu));
  EXPECT_THAT(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                            {0xa4093822u, 0x299f31d0u}),
              ElementsAre(0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u));
}

TEST(PhiloxTest, UniformIsInUnitIntervalAndBalanced) {
  double sum = 0.0;
  int below_tenth = 0;
  constexpr int kDraws = 100000;
  for (int step = 0; step < kDraws; ++step) {
    const double u = sampling_uniform(7, step);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    below_tenth += u < 0.1;
  }
  EXPECT_NEAR(sum / kDraws, 0.5, 0.005);
  EXPECT_NEAR(below_tenth / static_cast<double>(kDraws), 0.1, 0.005);
  EXPECT_EQ(sampling_uniform(7, 123), sampling_uniform(7, 123));
  EXPECT_NE(sampling_uniform(7, 123), sampling_uniform(8, 123));
  EXPECT_NE(sampling_uniform(7, 123), sampling_uniform(7, 124));
  EXPECT_NE(sampling_uniform(7, 1ull << 32), sampling_uniform(7, 0));  // high step bits count
}

TEST(SamplerTest, GreedyTakesArgmaxLowestIdOnTies) {
  Sampler sampler;
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  SamplingParams params;
  params.temperature = 0.0f;
  for (uint64_t seed : {0ull, 1ull, 99ull}) {
    params.seed = seed;
    for (int step = 0; step < 20; ++step) EXPECT_EQ(sampler.sample(logits, params, step)->token, 1);
  }
  params.temperature = 1.0f;
  params.top_k = 1;  // top-1 is greedy at any temperature
  EXPECT_EQ(sampler.sample(logits, params, 5)->token, 1);
}

TEST(SamplerTest, TemperatureOneMatchesSoftmax) {
  Sampler sampler;
  const std::vector<double> probabilities = {0.1, 0.2, 0.3, 0.4};
  SamplingParams params;
  params.seed = 1234;
  const std::vector<int> counts = histogram(sampler, logits_of(probabilities), params, 40000);
  EXPECT_LT(chi_square(counts, probabilities), kChiSquare999[3]);
}

TEST(SamplerTest, TemperatureSharpensAndFlattens) {
  Sampler sampler;
  const std::vector<double> probabilities = {0.1, 0.2, 0.3, 0.4};
  const std::vector<float> logits = logits_of(probabilities);
  SamplingParams params;
  params.seed = 77;
  params.temperature = 0.5f;  // p^2
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 40000),
                       normalised({0.01, 0.04, 0.09, 0.16})),
            kChiSquare999[3]);
  params.temperature = 2.0f;  // sqrt(p)
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 40000),
                       normalised({std::sqrt(0.1), std::sqrt(0.2), std::sqrt(0.3), std::sqrt(0.4)})),
            kChiSquare999[3]);
}

TEST(SamplerTest, NegativeInfinityIsNeverSampled) {
  Sampler sampler;
  const std::vector<double> probabilities = {0.0, 0.5, 0.0, 0.5, 0.0};
  SamplingParams params;
  params.seed = 5;
  const std::vector<int> counts = histogram(sampler, logits_of(probabilities), params, 10000);
  EXPECT_LT(chi_square(counts, probabilities), kChiSquare999[1]);
}

TEST(SamplerTest, TopKKeepsExactlyTheKMostLikely) {
  Sampler sampler;
  // Tokens shuffled so the top-k are not simply the first ids.
  const std::vector<double> weights = {3, 9, 1, 7, 2, 8, 4, 6, 5, 0.5};
  const std::vector<float> logits = logits_of(normalised(weights));
  SamplingParams params;
  params.seed = 2024;
  params.top_k = 3;  // tokens 1 (9), 5 (8), 3 (7)
  const std::vector<int> counts = histogram(sampler, logits, params, 30000);
  EXPECT_LT(chi_square(counts, normalised({0, 9, 0, 7, 0, 8, 0, 0, 0, 0})), kChiSquare999[2]);

  params.top_k = 100;  // more than the vocabulary: no filtering
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 30000), normalised(weights)),
            kChiSquare999[9]);
}

TEST(SamplerTest, TopKTiesGoToLowerIds) {
  Sampler sampler;
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  SamplingParams params;
  params.seed = 9;
  params.top_k = 2;
  const std::vector<int> counts = histogram(sampler, logits, params, 10000);
  EXPECT_LT(chi_square(counts, {0, 0.5, 0.5, 0, 0}), kChiSquare999[1]);
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  Sampler sampler;
  const std::vector<double> probabilities = {0.1, 0.5, 0.15, 0.25};  // order: 1, 3, 2, 0
  const std::vector<float> logits = logits_of(probabilities);
  SamplingParams params;
  params.seed = 31;
  params.top_p = 0.4f;  // {1}
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 5000), {0, 1, 0, 0}), 1e-9);
  params.top_p = 0.7f;  // {1, 3}
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 30000), normalised({0, 0.5, 0, 0.25})),
            kChiSquare999[1]);
  params.top_p = 0.8f;  // {1, 3, 2}
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 30000),
                       normalised({0, 0.5, 0.15, 0.25})),
            kChiSquare999[2]);
  params.top_p = 1.0f;
  EXPECT_LT(chi_square(histogram(sampler, logits, params, 30000), probabilities),
            kChiSquare999[3]);
}

TEST(SamplerTest, TopPAppliesToTheTopKSet) {
  Sampler sampler;
  const std::vector<double> probabilities = {0.4, 0.3, 0.2, 0.1};
  SamplingParams params;
  params.seed = 8;
  params.top_k = 3;    // {0, 1, 2} renormalised: 4/9, 3/9, 2/9
  params.top_p = 0.7f;  // 4/9 = 0.44 < 0.7 <= 7/9: {0, 1}
  const std::vector<int> counts = histogram(sampler, logits_of(probabilities), params, 30000);
  EXPECT_LT(chi_square(counts, normalised({0.4, 0.3, 0, 0})), kChiSquare999[1]);
}

// A large shuffled vocabulary whose top-p set is hundreds of tokens: exercises the prefix
// growth, and the boundary is checked against a brute-force full sort.
TEST(SamplerTest, TopPOnLargeVocabularyMatchesFullSort) {
  constexpr int kVocab = 32000;
  std::mt19937_64 rng(42);
  std::vector<float> logits(kVocab);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& logit : logits) logit = normal(rng) * 0.3f;
  // Reference kept set.
  std::vector<int32_t> order(kVocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  const float max_logit = logits[order[0]];
  double total = 0.0;
  for (float logit : logits) total += std::exp(static_cast<double>(logit - max_logit));
  const double top_p = 0.02;
  double cumulative = 0.0;
  size_t kept = 0;
  while (cumulative < top_p * total) cumulative += std::exp(static_cast<double>(logits[order[kept++]] - max_logit));
  ASSERT_GT(kept, 256u);  // beyond the first two prefixes the sampler sorts (64, 256)
  const std::set<int32_t> kept_set(order.begin(), order.begin() + static_cast<ptrdiff_t>(kept));

  Sampler sampler;
  SamplingParams params;
  params.seed = 4;
  params.top_p = static_cast<float>(top_p);
  std::set<int32_t> seen;
  for (int step = 0; step < 20000; ++step) {
    const int32_t token = sampler.sample(logits, params, step)->token;
    ASSERT_TRUE(kept_set.contains(token)) << "token " << token << " outside the top-p set";
    seen.insert(token);
  }
  // Nearly every kept token shows up, including the last one kept.
  EXPECT_GT(seen.size(), kept * 9 / 10);
  EXPECT_TRUE(seen.contains(order[kept - 1]));
}

TEST(SamplerTest, SameSeedAndStepGiveSameTokenRegardlessOfBatch) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  constexpr int kRows = 16;
  constexpr int kVocab = 500;
  std::vector<std::vector<float>> rows(kRows, std::vector<float>(kVocab));
  for (auto& row : rows) {
    for (float& logit : row) logit = uniform(rng);
  }
  std::vector<SamplingParams> params(kRows);
  for (int r = 0; r < kRows; ++r) {
    params[r].seed = branch_seed(1000, r);
    params[r].temperature = 0.7f + 0.1f * (r % 4);
    params[r].top_k = (r % 3) * 50;
    params[r].top_p = r % 2 == 0 ? 1.0f : 0.9f;
  }
  // Batch A: all rows in order, steps 0..9.
  Sampler sampler_a;
  std::vector<std::vector<int32_t>> tokens_a(kRows);
  for (int step = 0; step < 10; ++step) {
    for (int r = 0; r < kRows; ++r) {
      tokens_a[r].push_back(sampler_a.sample(rows[r], params[r], step)->token);
    }
  }
  // Batch B: reversed order, with unrelated rows interleaved, and a fresh sampler.
  Sampler sampler_b;
  SamplingParams other;
  other.seed = 555;
  for (int step = 0; step < 10; ++step) {
    for (int r = kRows - 1; r >= 0; --r) {
      (void)sampler_b.sample(rows[(r + 5) % kRows], other, step * 7 + 3);
      EXPECT_EQ(sampler_b.sample(rows[r], params[r], step)->token, tokens_a[r][step])
          << "row " << r << " step " << step;
    }
  }
  // Different branch seeds give different streams.
  EXPECT_NE(tokens_a[0], tokens_a[2]);
}

TEST(SamplerTest, BranchSeedsAreDistinctAndStable) {
  std::set<uint64_t> seeds;
  for (uint64_t parent : {0ull, 1ull, 42ull}) {
    for (uint64_t branch = 0; branch < 1000; ++branch) seeds.insert(branch_seed(parent, branch));
  }
  EXPECT_EQ(seeds.size(), 3000u);
  EXPECT_EQ(branch_seed(42, 7), branch_seed(42, 7));
}

TEST(SamplerTest, LogprobsAreRawLogSoftmax) {
  Sampler sampler;
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, 4.0f, 3.0f, kNegInf};
  double total = 0.0;
  for (float logit : logits) total += std::exp(static_cast<double>(logit));
  SamplingParams params;
  params.temperature = 0.3f;  // does not change the reported logprobs
  params.top_k = 2;
  params.top_logprobs = 3;
  params.seed = 11;
  absl::StatusOr<SampledToken> token = sampler.sample(logits, params, 0);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_NEAR(token->logprob, logits[token->token] - std::log(total), 1e-6);
  ASSERT_EQ(token->top_logprobs.size(), 3u);
  EXPECT_EQ(token->top_logprobs[0].token, 3);
  EXPECT_EQ(token->top_logprobs[1].token, 4);
  EXPECT_EQ(token->top_logprobs[2].token, 1);
  for (const TokenLogprob& entry : token->top_logprobs) {
    EXPECT_NEAR(entry.logprob, logits[entry.token] - std::log(total), 1e-6);
  }
  params.top_logprobs = 20;  // more than the vocabulary: all of it
  EXPECT_EQ(sampler.sample(logits, params, 0)->top_logprobs.size(), logits.size());
  EXPECT_EQ(sampler.sample(logits, params, 0)->top_logprobs.back().logprob, kNegInf);
}

TEST(SamplerTest, StopTokensAreFlagged) {
  Sampler sampler;
  const std::vector<float> logits = {0.0f, 5.0f, 1.0f};
  SamplingParams params;
  params.temperature = 0.0f;
  params.stop_token_ids = {2, 1};
  EXPECT_TRUE(sampler.sample(logits, params, 0)->stop);
  params.stop_token_ids = {2};
  EXPECT_FALSE(sampler.sample(logits, params, 0)->stop);
}

TEST(SamplerTest, InvalidParamsAndRowsAreErrors) {
  Sampler sampler;
  const std::vector<float> logits = {0.0f, 1.0f};
  auto error = [&](SamplingParams params, std::span<const float> row) {
    absl::StatusOr<SampledToken> token = sampler.sample(row, params, 0);
    EXPECT_FALSE(token.ok());
    return std::string(token.status().message());
  };
  SamplingParams params;
  params.temperature = -1.0f;
  EXPECT_THAT(error(params, logits), HasSubstr("temperature"));
  params.temperature = std::nanf("");
  EXPECT_THAT(error(params, logits), HasSubstr("temperature"));
  params = {};
  params.top_p = 0.0f;
  EXPECT_THAT(error(params, logits), HasSubstr("top_p"));
  params.top_p = 1.5f;
  EXPECT_THAT(error(params, logits), HasSubstr("top_p must be in (0, 1], got 1.5"));
  params = {};
  params.top_k = -2;
  EXPECT_THAT(error(params, logits), HasSubstr("top_k"));
  params = {};
  params.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_THAT(error(params, logits), HasSubstr("top_logprobs"));
  params = {};
  params.stop_token_ids = {2};
  EXPECT_THAT(error(params, logits), HasSubstr("stop token id 2"));
  params = {};
  EXPECT_THAT(error(params, {}), HasSubstr("empty"));
  const std::vector<float> with_nan = {0.0f, std::nanf("")};
  EXPECT_THAT(error(params, with_nan), HasSubstr("token 1"));
  const std::vector<float> with_inf = {std::numeric_limits<float>::infinity(), 0.0f};
  EXPECT_THAT(error(params, with_inf), HasSubstr("token 0"));
  const std::vector<float> all_masked = {kNegInf, kNegInf};
  EXPECT_THAT(error(params, all_masked), HasSubstr("-inf"));
}

}  // namespace
}  // namespace deft::engine
