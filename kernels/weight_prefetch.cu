#include "kernels/check.h"
#include "kernels/device_info.h"
#include "kernels/weight_prefetch.h"

namespace deft::kernels {

PrefetchGrid with_prefetch_ctas(const char* what, WeightPrefetch prefetch, int32_t own_blocks,
                                int32_t grid_y) {
  prefetch.first_block = own_blocks;
  if (prefetch.base == nullptr) return {prefetch, own_blocks};
  DEFT_CHECK(
      prefetch.rows >= 0 && prefetch.row_bytes > 0 && prefetch.bytes_per_row > 0 && grid_y >= 1,
      "%s: bad weight prefetch (rows %lld, row bytes %lld, %d bytes a row, grid y %d)", what,
      static_cast<long long>(prefetch.rows), static_cast<long long>(prefetch.row_bytes),
      prefetch.bytes_per_row, grid_y);
  const int32_t sms = current_device_sm_count();
  return {prefetch, own_blocks + (sms + grid_y - 1) / grid_y};
}

}  // namespace deft::kernels
