#include "models/gemm_tuner.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "spdlog/spdlog.h"

// Aborts on a failing cuBLAS / cuBLASLt call (a bug or a broken device: shapes are the model's).
#define DEFT_CUBLAS_CHECK(call)                                                                    \
  do {                                                                                             \
    const cublasStatus_t deft_cublas_status_ = (call);                                             \
    DEFT_CHECK(deft_cublas_status_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error: %s failed: %s", #call, \
               cublasGetStatusString(deft_cublas_status_));                                        \
  } while (0)

namespace deft::models {

namespace {

// Candidates asked from the heuristic, and how many of the first get split-K variants.
constexpr int kHeuristicCandidates = 24;
constexpr int kSplitVariantsOf = 4;
constexpr int32_t kSplits[] = {2, 3, 4, 6, 8};
// Wide search: algorithm ids asked for at most, configurations asked per id.
constexpr int kMaxAlgoIds = 128;
constexpr int kPerAlgoIdCandidates = 4;
// Timing: passes of launches with an event between passes; the first pass is a warm-up.
constexpr int kPasses = 6;
// A pass is ~200 µs of GEMMs (at a guessed 2.5 TB/s; at most 8 launches: tiny shapes are
// launch-bound anyway), so event overheads vanish.
constexpr double kPassTargetUs = 200.0;
constexpr int kMaxLaunchesPerPass = 8;
// Candidates timed a second time before one is chosen.
constexpr size_t kConfirmed = 3;

cudaDataType cuda_type(kernels::DType dtype) {
  return dtype == kernels::DType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
}

cudaDataType y_type(const GemmShape& shape) {
  return shape.y_fp32 ? CUDA_R_32F : cuda_type(shape.dtype);
}

// The largest power of two (up to 256) dividing the address.
uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  if (address == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(address & (~address + 1), 256));
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

std::string algo_name(const cublasLtMatmulAlgo_t& algo) {
  return absl::StrCat("algo ", algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID), " tile ",
                      algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID), " stages ",
                      algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), " splitk ",
                      algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), " reduction ",
                      algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                      " swizzle ", algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                      " option ", algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                      " cluster ",
                      algo_config<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), " inner ",
                      algo_config<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID));
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The matmul and layout descriptors of one shape. Column-major view of the row-major operands:
// y^T [out x rows] = (w [in x out])^T * x^T [in x rows].
struct MatmulDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;

  explicit MatmulDescs(const GemmShape& shape) {
    DEFT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
    DEFT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                     sizeof(transpose)));
    DEFT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
    DEFT_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&w, cuda_type(shape.dtype), shape.in, shape.out, shape.in));
    DEFT_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&x, cuda_type(shape.dtype), shape.in, shape.rows, shape.in));
    DEFT_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&y, y_type(shape), shape.out, shape.rows, shape.out));
  }
  ~MatmulDescs() {
    if (y != nullptr) cublasLtMatrixLayoutDestroy(y);
    if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
    if (w != nullptr) cublasLtMatrixLayoutDestroy(w);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
  MatmulDescs(const MatmulDescs&) = delete;
  MatmulDescs& operator=(const MatmulDescs&) = delete;
};

struct LtAlgo {
  cublasLtMatmulAlgo_t algo{};
  std::string name;
  const char* source = "";  // how it was found
};

}  // namespace

int32_t gemm_row_bucket(int32_t rows) {
  if (rows <= 1) return rows;
  if (rows <= 8 || rows > 64) {
    return static_cast<int32_t>(std::bit_ceil(static_cast<uint32_t>(rows)));
  }
  return (rows + 7) / 8 * 8;
}

std::string gemm_shape_name(const GemmShape& shape) {
  return absl::StrCat(shape.rows, "x", shape.in, "->", shape.out, " ",
                      std::string(kernels::dtype_name(shape.dtype)), shape.y_fp32 ? " y fp32" : "",
                      shape.accumulate ? " +=" : "");
}

std::string GemmTuneResult::chosen_algo() const {
  return chosen < 0 ? std::string("cublasGemmEx default") : candidates[chosen].algo;
}

struct GemmTuner::Impl {
  // One shape's state: tuned (its candidates and choice), or derived from its row bucket's.
  struct Entry {
    GemmShape shape;
    std::unique_ptr<MatmulDescs> descs;
    std::vector<LtAlgo> candidates;  // of the last tune()
    bool derived = false;
    bool use_lt = false;
    cublasLtMatmulAlgo_t algo{};
    uint32_t alignment = 256;  // what the choice assumes of every pointer
  };

  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t lt = nullptr;
  using Key = std::tuple<int32_t, int32_t, int32_t, kernels::DType, bool, bool>;
  static Key key(const GemmShape& shape) {
    return {shape.rows, shape.in, shape.out, shape.dtype, shape.y_fp32, shape.accumulate};
  }
  std::map<Key, std::unique_ptr<Entry>> entries;
  uint64_t rotation = 0;  // which weight matrix the next timed launch reads

  Entry* find(const GemmShape& shape) {
    const auto it = entries.find(key(shape));
    return it == entries.end() ? nullptr : it->second.get();
  }

  Entry& add(const GemmShape& shape, bool derived) {
    auto entry = std::make_unique<Entry>();
    entry->shape = shape;
    entry->derived = derived;
    entry->descs = std::make_unique<MatmulDescs>(shape);
    Entry& added = *entry;
    entries[key(shape)] = std::move(entry);
    return added;
  }

  // A shape not tuned whose row bucket chose a cuBLASLt algorithm: that algorithm when it
  // accepts these rows (remembered either way). nullptr when the bucket has no such choice.
  Entry* derive(const GemmShape& shape) {
    GemmShape bucket = shape;
    bucket.rows = gemm_row_bucket(shape.rows);
    const Entry* tuned = bucket.rows != shape.rows ? find(bucket) : nullptr;
    if (tuned == nullptr || !tuned->use_lt) return nullptr;
    Entry& entry = add(shape, true);
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(lt, entry.descs->op, entry.descs->w, entry.descs->x, entry.descs->y,
                                entry.descs->y, &tuned->algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= workspace_bytes) {
      entry.use_lt = true;
      entry.algo = tuned->algo;
      entry.alignment = tuned->alignment;
    }
    return &entry;
  }

  void gemm_default(const GemmShape& shape, const void* x, const void* w, void* y) const {
    const float alpha = 1.0f;
    const float beta = shape.accumulate ? 1.0f : 0.0f;
    DEFT_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, shape.out, shape.rows,
                                   shape.in, &alpha, w, cuda_type(shape.dtype), shape.in, x,
                                   cuda_type(shape.dtype), shape.in, &beta, y, y_type(shape),
                                   shape.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  cublasStatus_t gemm_lt(const Entry& entry, const cublasLtMatmulAlgo_t& algo, const void* x,
                         const void* w, void* y) const {
    const float alpha = 1.0f;
    const float beta = entry.shape.accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(lt, entry.descs->op, &alpha, w, entry.descs->w, x, entry.descs->x, &beta,
                          y, entry.descs->y, y, entry.descs->y, &algo, workspace, workspace_bytes,
                          stream);
  }

  // Up to `count` configurations from the heuristic (for `algo_id` only, when >= 0).
  std::vector<cublasLtMatmulAlgo_t> heuristic(const Entry& entry, uint32_t alignment, int count,
                                              int algo_id) {
    const GemmShape& shape = entry.shape;
    cublasLtMatmulPreference_t preference = nullptr;
    DEFT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t max_workspace = workspace_bytes;
    DEFT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference,
                                                           CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &max_workspace, sizeof(max_workspace)));
    // Split-K partials summed in a 16-bit y would round every partial sum: only fp32 partials
    // (in the workspace) for 16-bit outputs.
    const uint32_t reductions =
        shape.y_fp32 ? CUBLASLT_REDUCTION_SCHEME_MASK
                     : CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    DEFT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));
    for (const cublasLtMatmulPreferenceAttributes_t attribute :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      DEFT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &alignment,
                                                             sizeof(alignment)));
    }
    std::vector<cublasLtMatmulHeuristicResult_t> results(count);
    std::vector<cublasLtMatmulAlgo_t> algos;
    bool ready = true;
    if (algo_id >= 0) {
      const uint32_t mode = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
      DEFT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode)));
      for (cublasLtMatmulHeuristicResult_t& result : results) {
        ready = ready &&
                cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, cuda_type(shape.dtype),
                                       cuda_type(shape.dtype), y_type(shape), y_type(shape),
                                       algo_id, &result.algo) == CUBLAS_STATUS_SUCCESS;
      }
    }
    int found = 0;
    if (ready && cublasLtMatmulAlgoGetHeuristic(lt, entry.descs->op, entry.descs->w, entry.descs->x,
                                                entry.descs->y, entry.descs->y, preference, count,
                                                results.data(), &found) == CUBLAS_STATUS_SUCCESS) {
      for (int i = 0; i < found; ++i) {
        if (results[i].state == CUBLAS_STATUS_SUCCESS &&
            results[i].workspaceSize <= workspace_bytes) {
          algos.push_back(results[i].algo);
        }
      }
    }
    cublasLtMatmulPreferenceDestroy(preference);
    return algos;
  }

  // `base` with each of kSplits (when it supports split-K and a reduction fit for the output)
  // that cublasLtMatmulAlgoCheck accepts.
  std::vector<cublasLtMatmulAlgo_t> split_variants(const Entry& entry,
                                                   const cublasLtMatmulAlgo_t& base) {
    std::vector<cublasLtMatmulAlgo_t> variants;
    int32_t split_support = 0;
    uint32_t scheme_mask = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &split_support,
                                          sizeof(split_support),
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        split_support == 0 ||
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
                                          &scheme_mask, sizeof(scheme_mask),
                                          &written) != CUBLAS_STATUS_SUCCESS) {
      return variants;
    }
    // In place (in y) only for fp32 y; fp32 partials in the workspace otherwise.
    const uint32_t scheme = entry.shape.y_fp32 && (scheme_mask & CUBLASLT_REDUCTION_SCHEME_INPLACE)
                                ? CUBLASLT_REDUCTION_SCHEME_INPLACE
                                : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if ((scheme_mask & scheme) == 0) return variants;
    for (const int32_t split : kSplits) {
      cublasLtMatmulAlgo_t variant = base;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                               sizeof(split)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                               &scheme, sizeof(scheme)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoCheck(lt, entry.descs->op, entry.descs->w, entry.descs->x,
                                  entry.descs->y, entry.descs->y, &variant,
                                  &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= workspace_bytes) {
        variants.push_back(variant);
      }
    }
    return variants;
  }

  // The heuristic's candidates and split-K variants of the first few; with `wide`, also the
  // heuristic's best few of every other algorithm id cuBLASLt has for the types (and split-K
  // variants of each id's first). Deduplicated.
  std::vector<LtAlgo> candidates(const Entry& entry, uint32_t alignment, bool wide) {
    std::vector<LtAlgo> algos;
    const auto add_unique = [&](const cublasLtMatmulAlgo_t& algo, const char* source) {
      std::string name = algo_name(algo);
      for (const LtAlgo& known : algos) {
        if (known.name == name) return;
      }
      algos.push_back({algo, std::move(name), source});
    };
    const std::vector<cublasLtMatmulAlgo_t> best =
        heuristic(entry, alignment, kHeuristicCandidates, -1);
    std::vector<int32_t> best_ids;
    for (const cublasLtMatmulAlgo_t& algo : best) {
      add_unique(algo, "heuristic");
      best_ids.push_back(algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID));
    }
    for (size_t i = 0; i < std::min<size_t>(best.size(), kSplitVariantsOf); ++i) {
      for (const cublasLtMatmulAlgo_t& variant : split_variants(entry, best[i])) {
        add_unique(variant, "split-K variant");
      }
    }
    if (!wide) return algos;
    const GemmShape& shape = entry.shape;
    std::vector<int> ids(kMaxAlgoIds);
    int num_ids = 0;
    if (cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, cuda_type(shape.dtype),
                                 cuda_type(shape.dtype), y_type(shape), y_type(shape), kMaxAlgoIds,
                                 ids.data(), &num_ids) != CUBLAS_STATUS_SUCCESS) {
      return algos;
    }
    for (int i = 0; i < num_ids; ++i) {
      if (std::find(best_ids.begin(), best_ids.end(), ids[i]) != best_ids.end()) continue;
      const std::vector<cublasLtMatmulAlgo_t> of_id =
          heuristic(entry, alignment, kPerAlgoIdCandidates, ids[i]);
      for (const cublasLtMatmulAlgo_t& algo : of_id) add_unique(algo, "algo-id search");
      if (!of_id.empty()) {
        for (const cublasLtMatmulAlgo_t& variant : split_variants(entry, of_id.front())) {
          add_unique(variant, "algo-id search split-K");
        }
      }
    }
    return algos;
  }

  // Median µs per GEMM of `launch(weight)` over passes of launches (see kPasses); a negative
  // value when a launch failed.
  template <typename Launch>
  double time_launches(const GemmShape& shape, std::span<const void* const> weights,
                       Launch&& launch) {
    const double guess_us = 2.0 * shape.in * shape.out / 2.5e12 * 1e6;
    const int launches =
        std::clamp(static_cast<int>(std::ceil(kPassTargetUs / std::max(guess_us, 1.0))), 1,
                   kMaxLaunchesPerPass);
    std::vector<cudaEvent_t> events(kPasses + 1);
    for (cudaEvent_t& event : events) DEFT_CUDA_CHECK(cudaEventCreate(&event));
    bool ok = true;
    DEFT_CUDA_CHECK(cudaEventRecord(events[0], stream));
    for (int pass = 0; pass < kPasses && ok; ++pass) {
      for (int i = 0; i < launches && ok; ++i) {
        ok = launch(weights[rotation++ % weights.size()]);
      }
      DEFT_CUDA_CHECK(cudaEventRecord(events[pass + 1], stream));
    }
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> pass_us;
    if (ok) {
      for (int pass = 1; pass < kPasses; ++pass) {
        float ms = 0;
        DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events[pass], events[pass + 1]));
        pass_us.push_back(ms * 1e3 / launches);
      }
    }
    for (cudaEvent_t event : events) DEFT_CUDA_CHECK(cudaEventDestroy(event));
    return ok ? median(pass_us) : -1.0;
  }
};

GemmTuner::GemmTuner(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : impl_(std::make_unique<Impl>()) {
  impl_->stream = stream;
  impl_->workspace = workspace;
  impl_->workspace_bytes = workspace_bytes;
  DEFT_CUBLAS_CHECK(cublasCreate(&impl_->cublas));
  DEFT_CUBLAS_CHECK(cublasSetStream(impl_->cublas, stream));
  // A fixed workspace: captured GEMMs must not allocate.
  DEFT_CUBLAS_CHECK(cublasSetWorkspace(impl_->cublas, workspace, workspace_bytes));
  DEFT_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
}

GemmTuner::~GemmTuner() {
  impl_->entries.clear();
  if (impl_->lt != nullptr) cublasLtDestroy(impl_->lt);
  if (impl_->cublas != nullptr) cublasDestroy(impl_->cublas);
}

GemmTuneResult GemmTuner::tune(const GemmShape& shape, std::span<const void* const> weights,
                               const void* x, void* y) {
  const auto start = std::chrono::steady_clock::now();
  Impl& s = *impl_;
  DEFT_CHECK(!weights.empty() && shape.rows > 0, "gemm_tuner: tune(%s) without weights or rows",
             gemm_shape_name(shape).c_str());
  // Shapes derived from an earlier choice of this bucket follow the new one.
  std::erase_if(s.entries, [&](const auto& item) {
    GemmShape bucket = item.second->shape;
    bucket.rows = gemm_row_bucket(bucket.rows);
    return item.second->derived && bucket == shape;
  });
  Impl::Entry* entry = s.find(shape);
  if (entry == nullptr) entry = &s.add(shape, false);
  entry->derived = false;
  entry->use_lt = false;
  uint32_t alignment = std::min(alignment_of(x), alignment_of(y));
  for (const void* w : weights) alignment = std::min(alignment, alignment_of(w));
  entry->alignment = alignment;
  entry->candidates = s.candidates(*entry, alignment, wide_search_);

  GemmTuneResult result;
  result.shape = shape;
  const auto run_default = [&](const void* w) {
    s.gemm_default(shape, x, w, y);
    return true;
  };
  // Warm-up (clocks, kernel loading), then the default before and after the candidates: the
  // faster of the two, so drift cannot favour a candidate.
  s.time_launches(shape, weights, run_default);
  const double default_before = s.time_launches(shape, weights, run_default);
  for (const LtAlgo& candidate : entry->candidates) {
    const double us = s.time_launches(shape, weights, [&](const void* w) {
      return s.gemm_lt(*entry, candidate.algo, x, w, y) == CUBLAS_STATUS_SUCCESS;
    });
    result.candidates.push_back({candidate.name, candidate.source, us});
  }
  result.default_us = std::min(default_before, s.time_launches(shape, weights, run_default));
  // The fastest few are timed again and only that second, unbiased time counts (the minimum of
  // ~30 noisy medians is biased low).
  std::vector<int32_t> order;
  for (size_t i = 0; i < result.candidates.size(); ++i) {
    if (result.candidates[i].median_us > 0) order.push_back(static_cast<int32_t>(i));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return result.candidates[a].median_us < result.candidates[b].median_us;
  });
  order.resize(std::min<size_t>(order.size(), kConfirmed));
  double best_us = result.default_us * (1.0 - kMinGain);
  for (const int32_t i : order) {
    if (result.candidates[i].median_us >= best_us) break;
    const double us = s.time_launches(shape, weights, [&](const void* w) {
      return s.gemm_lt(*entry, entry->candidates[i].algo, x, w, y) == CUBLAS_STATUS_SUCCESS;
    });
    result.candidates[i].median_us = us;
    if (us > 0 && us < best_us) {
      best_us = us;
      result.chosen = i;
    }
  }
  if (result.chosen >= 0) {
    entry->use_lt = true;
    entry->algo = entry->candidates[result.chosen].algo;
  }
  result.tuning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::debug(
      "gemm_tuner: {}: {} candidates in {:.0f} ms, default {:.2f} µs, chosen {} {:.2f} µs",
      gemm_shape_name(shape), result.candidates.size(), result.tuning_ms, result.default_us,
      result.chosen_algo(), result.chosen_us());
  return result;
}

void GemmTuner::gemm(const GemmShape& shape, const void* x, const void* w, void* y) {
  Impl& s = *impl_;
  if (!enabled_) {
    s.gemm_default(shape, x, w, y);
    return;
  }
  Impl::Entry* entry = s.find(shape);
  if (entry == nullptr) entry = s.derive(shape);
  const uint32_t alignment = std::min({alignment_of(x), alignment_of(w), alignment_of(y)});
  if (entry == nullptr || !entry->use_lt || alignment < entry->alignment) {
    s.gemm_default(shape, x, w, y);
    return;
  }
  DEFT_CUBLAS_CHECK(s.gemm_lt(*entry, entry->algo, x, w, y));
}

void GemmTuner::force_choice(const GemmShape& shape, int32_t index) {
  Impl::Entry* entry = impl_->find(shape);
  DEFT_CHECK(
      entry != nullptr && !entry->derived && index < static_cast<int32_t>(entry->candidates.size()),
      "gemm_tuner: force_choice(%s, %d) without such a tuned candidate",
      gemm_shape_name(shape).c_str(), index);
  entry->use_lt = index >= 0;
  if (index >= 0) entry->algo = entry->candidates[index].algo;
}

}  // namespace deft::models
