// ||ours - ref||_2 / ||ref||_2 over two equally long vectors, in double; infinite when `ours`
// holds a NaN or an infinity (so a NaN can never pass a tolerance).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace deft::bench {

inline double relative_l2_error(const std::vector<float>& ours, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    if (!std::isfinite(ours[i])) return INFINITY;
    diff += double(ours[i] - ref[i]) * (ours[i] - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace deft::bench
