// Tensor maps (CUtensorMap) for the bulk tensor copy engine, encoded through the driver entry
// point that the CUDA runtime hands out (no link against libcuda), and cached: a decode step
// copies from the same weights and activation buffers every time, and encoding costs host time.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace deft::kernels {

// A row-major [rows][cols] matrix of 16-bit `dtype` elements at `base` (16-byte aligned, cols a
// multiple of 8), copied in boxes of [box_rows][64] elements into shared memory in the 128-byte
// swizzle of kernels/wgmma.cuh. Boxes past the matrix's edges read zeros.
CUtensorMap swizzled_tile_map(const void* base, int64_t rows, int64_t cols, DType dtype,
                              int32_t box_rows);

}  // namespace deft::kernels
