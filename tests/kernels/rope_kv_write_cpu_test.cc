// CPU twins of the RoPE and KV-write kernels: the properties the GPU tests rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/kv_write_cpu.h"
#include "kernels/rope_cpu.h"

namespace deft::kernels {
namespace {

TEST(RopeCpu, PositionZeroIsIdentity) {
  RopeDims dims{.num_tokens = 1,
                .num_q_heads = 2,
                .num_kv_heads = 1,
                .head_dim = 8,
                .q_token_stride = 16,
                .k_token_stride = 8};
  std::vector<float> q(16), k(8);
  std::iota(q.begin(), q.end(), 1.0f);
  std::iota(k.begin(), k.end(), -3.0f);
  const std::vector<float> q0 = q, k0 = k;
  const int32_t position = 0;
  const std::vector<float> inv_freq = {1.0f, 0.1f, 0.01f, 0.001f};
  rope_cpu(dims, &position, inv_freq.data(), q.data(), k.data());
  EXPECT_EQ(q, q0);
  EXPECT_EQ(k, k0);
}

// rotate_half pairs element i with i + head_dim / 2: (1, 0) at angle a becomes (cos a, sin a).
TEST(RopeCpu, RotatesHalvesByPositionTimesInverseFrequency) {
  RopeDims dims{.num_tokens = 2,
                .num_q_heads = 1,
                .num_kv_heads = 0,
                .head_dim = 4,
                .q_token_stride = 4,
                .k_token_stride = 0};
  std::vector<float> q = {1, 0, 0, 2, 1, 0, 0, 2};  // per token: x1 = (1, 0), x2 = (0, 2)
  const std::vector<int32_t> positions = {3, 7};
  const std::vector<float> inv_freq = {1.0f, 0.5f};
  rope_cpu(dims, positions.data(), inv_freq.data(), q.data(), nullptr);
  for (int t = 0; t < 2; ++t) {
    const float a0 = static_cast<float>(positions[t]) * inv_freq[0];
    const float a1 = static_cast<float>(positions[t]) * inv_freq[1];
    const float* x = &q[t * 4];
    EXPECT_FLOAT_EQ(x[0], std::cos(a0));       // 1 * cos - 0 * sin
    EXPECT_FLOAT_EQ(x[2], std::sin(a0));       // 0 * cos + 1 * sin
    EXPECT_FLOAT_EQ(x[1], -2 * std::sin(a1));  // 0 * cos - 2 * sin
    EXPECT_FLOAT_EQ(x[3], 2 * std::cos(a1));   // 2 * cos + 0 * sin
  }
}

TEST(KvWriteCpu, CopiesRowsIntoSlotsAndSkipsPadding) {
  KvWriteDims dims{.num_tokens = 3, .num_kv_heads = 2, .head_dim = 2, .new_token_stride = 6};
  // Fused rows of 6: K is elements [0, 4), the rest belongs to other heads.
  std::vector<float> k_new(18), v_new(18);
  std::iota(k_new.begin(), k_new.end(), 100.0f);
  std::iota(v_new.begin(), v_new.end(), 200.0f);
  std::vector<float> k_cache(5 * 4, -1.0f), v_cache(5 * 4, -1.0f);
  const std::vector<int32_t> slots = {4, -1, 1};
  kv_write_cpu(dims, slots.data(), k_new.data(), v_new.data(), k_cache.data(), v_cache.data());
  for (int e = 0; e < 4; ++e) {
    EXPECT_EQ(k_cache[4 * 4 + e], k_new[0 * 6 + e]);
    EXPECT_EQ(v_cache[4 * 4 + e], v_new[0 * 6 + e]);
    EXPECT_EQ(k_cache[1 * 4 + e], k_new[2 * 6 + e]);
    EXPECT_EQ(v_cache[1 * 4 + e], v_new[2 * 6 + e]);
    for (int slot : {0, 2, 3}) {
      EXPECT_EQ(k_cache[slot * 4 + e], -1.0f);
      EXPECT_EQ(v_cache[slot * 4 + e], -1.0f);
    }
  }
}

}  // namespace
}  // namespace deft::kernels
