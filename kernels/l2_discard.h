// Dead activations a small kernel drops from L2 (kernels/l2_discard.cuh issues it): buffers whose
// last reader is a kernel before it in the stream and whose next writer rewrites them whole.
// Left dirty in L2, each would be written back to DRAM in the middle of a later GEMM's weight
// stream. Only whole 128-byte lines inside a range are dropped.
#pragma once

#include <cstdint>

#include "kernels/check.h"

namespace deft::kernels {

struct L2Discard {
  static constexpr int kMaxRanges = 3;
  const void* base[kMaxRanges] = {};  // null: an unused range
  int64_t bytes[kMaxRanges] = {};

  // Adds [range_base, range_base + range_bytes); aborts past kMaxRanges (a caller bug).
  L2Discard& add(const void* range_base, int64_t range_bytes) {
    for (int i = 0; i < kMaxRanges; ++i) {
      if (base[i] == nullptr) {
        base[i] = range_base;
        bytes[i] = range_bytes;
        return *this;
      }
    }
    DEFT_FAIL("L2Discard: more than %d ranges", kMaxRanges);
  }
};

}  // namespace deft::kernels
