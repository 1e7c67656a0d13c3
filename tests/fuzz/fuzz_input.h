// Support for the libFuzzer harnesses of tests/fuzz (header only): a reader that turns the fuzz
// input into the values a harness needs, and the check that stops a run on a broken contract.
//
// FuzzInput reads from the front of the input; once the bytes run out every read returns the
// low end of its range, so any input (the empty one too) is a valid case and a short input is a
// small case. Reads are little-endian and take only the bytes their range needs, so that
// libFuzzer's byte-level mutations map onto small changes of the case.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"

// libFuzzer's own byte mutation, for the harnesses' custom mutators (json_mutator.h,
// rpc_request); weak, so that the replay build (replay_main.cc) links without libFuzzer and
// never calls it.
extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size)
    __attribute__((weak));

namespace deft::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t remaining() const { return size_ - offset_; }
  bool empty() const { return offset_ == size_; }

  // A value in [low, high] (inclusive); `low` once the input is used up.
  int64_t take_int(int64_t low, int64_t high) {
    const uint64_t span = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
    uint64_t raw = 0;
    for (uint64_t covered = 0; covered < span && offset_ < size_; covered = (covered << 8) | 0xff) {
      raw = (raw << 8) | data_[offset_++];
    }
    return static_cast<int64_t>(static_cast<uint64_t>(low) +
                                (span == UINT64_MAX ? raw : raw % (span + 1)));
  }
  bool take_bool() { return take_int(0, 1) == 1; }
  // One of `count` choices.
  size_t take_index(size_t count) {
    return static_cast<size_t>(take_int(0, static_cast<int64_t>(count) - 1));
  }
  // Up to `max_bytes` bytes, the length read first.
  std::string take_bytes(size_t max_bytes) {
    const auto length = static_cast<size_t>(take_int(0, static_cast<int64_t>(max_bytes)));
    return take_exact(length);
  }
  // The rest of the input.
  std::string take_rest() { return take_exact(remaining()); }

 private:
  std::string take_exact(size_t length) {
    if (length > remaining()) length = remaining();
    std::string bytes(reinterpret_cast<const char*>(data_ + offset_), length);
    offset_ += length;
    return bytes;
  }

  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
};

// True when `status`'s message mentions `what` (Debian's absl::string_view is not std's).
inline bool mentions(const absl::Status& status, std::string_view what) {
  return std::string(status.message()).find(what) != std::string::npos;
}

// Stops the run with a message when a contract does not hold: libFuzzer records the input as
// a crash, and the replay program (replay_main.cc) fails its ctest.
[[noreturn]] inline void contract_broken(const char* file, int line, const char* condition,
                                         std::string_view detail) {
  std::fprintf(stderr, "%s:%d: contract broken: %s\n  %.*s\n", file, line, condition,
               static_cast<int>(detail.size()), detail.data());
  std::abort();
}

}  // namespace deft::fuzz

// FUZZ_CHECK(condition, detail): `detail` is anything convertible to std::string_view and is
// evaluated only on failure.
#define FUZZ_CHECK(condition, detail)                                                          \
  do {                                                                                         \
    if (!(condition)) ::deft::fuzz::contract_broken(__FILE__, __LINE__, #condition, (detail)); \
  } while (false)
