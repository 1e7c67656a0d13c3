// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// sampling uniform drawn from it, callable from host and device code. The same stream as
// engine/sampler.h (kernels/ may not include engine/, so it is spelled out again here; the GPU
// sampling tests check that both give the same numbers).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DEFT_HOST_DEVICE __host__ __device__
#else
#define DEFT_HOST_DEVICE
#endif

namespace deft::kernels {

struct Philox4x32 {
  uint32_t word[4];
};

// Ten rounds over `counter` keyed by (key0, key1); Random123's constants.
DEFT_HOST_DEVICE inline Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t* c = counter.word;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += kW0;
      key1 += kW1;
    }
    const uint64_t product0 = static_cast<uint64_t>(kM0) * c[0];
    const uint64_t product1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32);
    const uint32_t lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32);
    const uint32_t lo1 = static_cast<uint32_t>(product1);
    const uint32_t next0 = hi1 ^ c[1] ^ key0;
    const uint32_t next2 = hi0 ^ c[3] ^ key1;
    c[0] = next0;
    c[1] = lo1;
    c[2] = next2;
    c[3] = lo0;
  }
  return counter;
}

// The uniform number in [0, 1) (53 bits) that draw `step` of the stream `seed` yields:
// counter (step lo, step hi, 0, 0), key (seed lo, seed hi); 27 bits of word 0, 26 of word 1.
DEFT_HOST_DEVICE inline double philox_uniform(uint64_t seed, uint64_t step) {
  const Philox4x32 bits =
      philox4x32_10({{static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u}},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t mantissa = (static_cast<uint64_t>(bits.word[0] >> 5) << 26) | (bits.word[1] >> 6);
  return static_cast<double>(mantissa) * 0x1.0p-53;
}

}  // namespace deft::kernels
