// The one place that allocates device and pinned host memory (STYLE.md: no cudaMalloc outside
// one allocator type). Move-only RAII owners; sizes in bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "kernels/cuda_check.h"

namespace deft::kernels {

namespace detail {

struct DeviceAllocator {
  static void* allocate(size_t bytes) {
    void* ptr = nullptr;
    DEFT_CUDA_CHECK(cudaMalloc(&ptr, bytes));
    return ptr;
  }
  static void release(void* ptr) { DEFT_CUDA_CHECK(cudaFree(ptr)); }
};

struct PinnedHostAllocator {
  static void* allocate(size_t bytes) {
    void* ptr = nullptr;
    DEFT_CUDA_CHECK(cudaMallocHost(&ptr, bytes));
    return ptr;
  }
  static void release(void* ptr) { DEFT_CUDA_CHECK(cudaFreeHost(ptr)); }
};

template <typename Allocator>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes) { reset(bytes); }
  ~Buffer() { free(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      free();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  // Frees the old allocation (contents are lost) and allocates `bytes`.
  void reset(size_t bytes) {
    free();
    if (bytes > 0) {
      data_ = Allocator::allocate(bytes);
      bytes_ = bytes;
    }
  }
  // Grows to at least `bytes` (contents are lost on growth); never shrinks.
  void reserve(size_t bytes) {
    if (bytes > bytes_) reset(bytes);
  }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void free() {
    if (data_ != nullptr) Allocator::release(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace detail

using DeviceBuffer = detail::Buffer<detail::DeviceAllocator>;
using PinnedHostBuffer = detail::Buffer<detail::PinnedHostAllocator>;

}  // namespace deft::kernels
