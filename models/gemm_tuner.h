// The CUDA runner's weight GEMM, y[rows][out] (= or +=) x[rows][in] * w[out][in]^T (bf16/fp16
// in, fp32 accumulation, y 16-bit or fp32), on the cuBLASLt algorithm measured fastest for its
// shape instead of cublasGemmEx's CUBLAS_GEMM_DEFAULT pick.
//
// tune() asks cublasLtMatmulAlgoGetHeuristic for candidates (plus split-K variants of the first
// few), times each and cublasGemmEx's default on the caller's weights (several matrices, e.g.
// the layers', so the stream does not hit L2) with CUDA events, times the fastest three again,
// and keeps the fastest of those second timings when it beats the default by more than
// kMinGain; gemm() then runs it. Tuning launches and synchronises: never call it while the
// stream is being captured. gemm() only launches (no allocation, a fixed workspace), so it is
// safe inside a CUDA graph capture. Rows not tuned whose row bucket (gemm_row_bucket) was run
// the bucket's algorithm when cublasLtMatmulAlgoCheck accepts it for them; every other untuned
// shape runs cublasGemmEx's default.
// On the H100 the Llama-3-8B decode GEMMs gain 0-8 % per shape (LM head 4-7 %, down up to 18 %
// at 128 rows), ~1-2 % of a decode step; the wide search found nothing the heuristic's list
// missed (bench/results/gemm_tune-h100-notes.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace deft::models {

struct GemmShape {
  int32_t rows = 0, in = 0, out = 0;
  kernels::DType dtype = kernels::DType::kBf16;  // x and w
  bool y_fp32 = false;                           // y fp32, else `dtype`
  bool accumulate = false;                       // y += (beta = 1)
  bool operator==(const GemmShape&) const = default;
};

std::string gemm_shape_name(const GemmShape& shape);

// Row buckets: powers of two up to 8, multiples of 8 up to 64, then powers of two. Untuned rows
// follow their bucket's choice, and the CUDA runner pads graph steps to these (so an eager step
// runs the algorithm of its graph's bucket).
int32_t gemm_row_bucket(int32_t rows);

// What tune() measured: the default and every candidate (median µs per GEMM), the choice.
struct GemmTuneResult {
  struct Candidate {
    std::string algo;      // cuBLASLt config: algo id, tile, stages, split-K, reduction, cluster
    std::string source;    // heuristic, split-K variant, algo-id search (wide search)
    double median_us = 0;  // < 0: failed to launch; the fastest few: their second timing
  };
  GemmShape shape;
  double default_us = 0;  // cublasGemmEx, CUBLAS_GEMM_DEFAULT
  std::vector<Candidate> candidates;
  int32_t chosen = -1;   // index into candidates; -1: the default stays
  double tuning_ms = 0;  // host time of tune()
  double chosen_us() const { return chosen < 0 ? default_us : candidates[chosen].median_us; }
  std::string chosen_algo() const;
};

class GemmTuner {
 public:
  // A candidate must beat cublasGemmEx's default by more than this fraction to be chosen
  // (medians of a few event-timed passes differ by < 0.5 % run to run on the H100).
  static constexpr double kMinGain = 0.01;

  // Launches on `stream`; `workspace` (fixed, owned by the caller) serves every GEMM.
  GemmTuner(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~GemmTuner();
  GemmTuner(const GemmTuner&) = delete;
  GemmTuner& operator=(const GemmTuner&) = delete;

  // Times the candidates for `shape` over `weights` (each [out][in], used in turn) with x
  // [rows][in] and y [rows][out] (scratch: overwritten, or accumulated into), and remembers
  // the choice for the shape. Synchronises the stream.
  GemmTuneResult tune(const GemmShape& shape, std::span<const void* const> weights, const void* x,
                      void* y);

  // y = x * w^T (+ y when shape.accumulate) on the chosen algorithm (see the top).
  void gemm(const GemmShape& shape, const void* x, const void* w, void* y);

  // Off: every gemm() is cublasGemmEx's default (choices are kept for when it is on again).
  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }

  // Wide search (off by default): tune() also asks the heuristic for the best few
  // configurations of every other algorithm id cuBLASLt has for the types, and their split-K
  // variants (~3-4x the candidates).
  void set_wide_search(bool on) { wide_search_ = on; }

  // Tests: make candidate `index` of the shape's last tune() the choice (-1: the default).
  void force_choice(const GemmShape& shape, int32_t index);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool enabled_ = true;
  bool wide_search_ = false;
};

}  // namespace deft::models
