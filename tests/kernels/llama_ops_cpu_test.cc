// The CPU twins of the forward-pass kernels (kernels/llama_ops_cpu.h) against independent
// compositions: the fused QKV + RoPE + KV write equals bias add, rope_cpu and kv_write_cpu;
// RMSNorm's bias folding equals adding first; the seeded uniform stream is in range, centred
// and reproducible.
#include "kernels/llama_ops_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/kv_write_cpu.h"
#include "kernels/rope_cpu.h"

namespace deft::kernels {
namespace {

std::vector<float> random_values(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

TEST(LlamaOpsCpu, QkvRopeWriteEqualsBiasRopeAndKvWrite) {
  std::mt19937 rng(11);
  const QkvRopeDims dims{.num_tokens = 5, .num_q_heads = 6, .num_kv_heads = 2, .head_dim = 16};
  const int32_t width = dims.qkv_width();
  const int32_t q_size = 6 * 16, kv_size = 2 * 16, slots_total = 12;
  const std::vector<float> qkv = random_values(size_t{5} * width, rng);
  const std::vector<float> bias = random_values(width, rng);
  const std::vector<int32_t> positions = {0, 3, 9, 200, 31};
  const std::vector<int32_t> slots = {4, -1, 0, 11, 7};
  std::vector<float> inv_freq(8);
  for (int i = 0; i < 8; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / 16.0f);

  std::vector<float> q(size_t{5} * q_size), k_cache(size_t{slots_total} * kv_size, 0.0f);
  std::vector<float> v_cache = k_cache;
  qkv_rope_write_cpu(dims, positions.data(), slots.data(), inv_freq.data(), qkv.data(), bias.data(),
                     q.data(), k_cache.data(), v_cache.data());

  std::vector<float> biased = qkv;
  for (int32_t t = 0; t < 5; ++t) {
    for (int32_t c = 0; c < width; ++c) biased[t * width + c] += bias[c];
  }
  rope_cpu({.num_tokens = 5,
            .num_q_heads = 6,
            .num_kv_heads = 2,
            .head_dim = 16,
            .q_token_stride = width,
            .k_token_stride = width},
           positions.data(), inv_freq.data(), biased.data(), biased.data() + q_size);
  std::vector<float> k_expected(k_cache.size(), 0.0f), v_expected = k_expected;
  kv_write_cpu({.num_tokens = 5, .num_kv_heads = 2, .head_dim = 16, .new_token_stride = width},
               slots.data(), biased.data() + q_size, biased.data() + q_size + kv_size,
               k_expected.data(), v_expected.data());
  for (int32_t t = 0; t < 5; ++t) {
    for (int32_t c = 0; c < q_size; ++c) {
      EXPECT_FLOAT_EQ(q[t * q_size + c], biased[t * width + c]) << "token " << t << " col " << c;
    }
  }
  EXPECT_EQ(k_cache, k_expected);
  EXPECT_EQ(v_cache, v_expected);
}

TEST(LlamaOpsCpu, RmsNormFoldsBiasIntoResidualAndGathers) {
  std::mt19937 rng(5);
  const int32_t rows = 3, width = 40;
  std::vector<float> x = random_values(size_t{rows} * width, rng);
  const std::vector<float> bias = random_values(width, rng);
  const std::vector<float> weight = random_values(width, rng);
  std::vector<float> added = x;
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t c = 0; c < width; ++c) added[r * width + c] += bias[c];
  }
  std::vector<float> out(x.size()), expected(x.size());
  rms_norm_cpu({.num_rows = rows, .width = width, .eps = 1e-5f}, nullptr, x.data(), bias.data(),
               weight.data(), out.data());
  EXPECT_EQ(x, added);
  rms_norm_cpu({.num_rows = rows, .width = width, .eps = 1e-5f}, nullptr, added.data(), nullptr,
               weight.data(), expected.data());
  EXPECT_EQ(out, expected);
  const std::vector<int32_t> gather = {2, 2, 0};
  std::vector<float> gathered(size_t{3} * width);
  rms_norm_cpu({.num_rows = 3, .width = width, .eps = 1e-5f}, gather.data(), x.data(), nullptr,
               weight.data(), gathered.data());
  for (int32_t i = 0; i < 3; ++i) {
    for (int32_t c = 0; c < width; ++c) {
      EXPECT_EQ(gathered[i * width + c], expected[gather[i] * width + c]);
    }
  }
}

TEST(LlamaOpsCpu, RandomUniformInRangeCentredAndReproducible) {
  const int64_t count = 200000;
  std::vector<float> a(count), b(count), c(count);
  random_uniform_cpu(count, 7, 0.5f, 1.0f, a.data());
  random_uniform_cpu(count, 7, 0.5f, 1.0f, b.data());
  random_uniform_cpu(count, 8, 0.5f, 1.0f, c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  double sum = 0.0, sum_squares = 0.0;
  for (float value : a) {
    ASSERT_GE(value, 0.5f);
    ASSERT_LT(value, 1.5f);
    sum += value - 1.0;
    sum_squares += (value - 1.0) * (value - 1.0);
  }
  EXPECT_NEAR(sum / count, 0.0, 0.005);
  EXPECT_NEAR(sum_squares / count, 0.25 / 3.0, 0.002);  // uniform of half-width 0.5
}

}  // namespace
}  // namespace deft::kernels
