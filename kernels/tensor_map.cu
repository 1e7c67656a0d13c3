#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <tuple>
#include <unordered_map>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/tensor_map.h"

namespace deft::kernels {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    DEFT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000,
                                                     cudaEnableDefault, &found));
    DEFT_CHECK(found == cudaDriverEntryPointSuccess && entry != nullptr,
               "tensor_map: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }();
  return function;
}

struct Key {
  const void* base;
  int64_t rows, cols;
  DType dtype;
  int32_t box_rows;
  bool operator==(const Key& o) const {
    return std::tie(base, rows, cols, dtype, box_rows) ==
           std::tie(o.base, o.rows, o.cols, o.dtype, o.box_rows);
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<const void*>()(k.base);
    for (int64_t v : {k.rows, k.cols, int64_t{k.box_rows}, int64_t(k.dtype)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

// A map encodes only an address and a shape, so an entry stays right for any buffer later
// allocated at the same address with the same shape. Bounded: cleared when it grows past this.
constexpr size_t kMaxCached = 4096;

}  // namespace

CUtensorMap swizzled_tile_map(const void* base, int64_t rows, int64_t cols, DType dtype,
                              int32_t box_rows) {
  static std::mutex mutex;
  static std::unordered_map<Key, CUtensorMap, KeyHash> cache;
  const Key key{base, rows, cols, dtype, box_rows};
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};  // bytes between rows
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode_function()(
      &map,
      dtype == DType::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DEFT_CHECK(result == CUDA_SUCCESS,
             "tensor_map: cuTensorMapEncodeTiled failed (%d) for [%lld][%lld] at %p, box %d",
             static_cast<int>(result), static_cast<long long>(rows), static_cast<long long>(cols),
             base, box_rows);
  if (cache.size() >= kMaxCached) cache.clear();
  cache.emplace(key, map);
  return map;
}

}  // namespace deft::kernels
