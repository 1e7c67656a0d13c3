// Reader and writer of the safetensors format (https://github.com/huggingface/safetensors):
//   [u64 little-endian N][N bytes of JSON header][data]
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the start of the data) plus an optional "__metadata__" map of strings.
//
// Files are memory-mapped read-only; tensors are views into the mapping, valid while the
// SafetensorsFile (or SafetensorsSet) lives. Everything in the header is checked before any
// tensor is handed out, as strictly as the reference implementation: well-formed JSON, header
// length within the file, known dtypes, shapes whose element count matches the byte range,
// byte ranges inside the data, in file order without overlap or gaps, names unique. Every
// error names the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/dtype.h"

namespace deft::models {

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A tensor inside a file: where its bytes are and what they mean.
struct TensorView {
  std::string_view name;
  std::string_view file;  // the path it was read from, for messages
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  const std::byte* data = nullptr;  // not necessarily aligned to the element size
  size_t bytes = 0;

  int64_t numel() const;
  // Element i as float (any dtype, any alignment).
  float at(size_t index) const { return load_as_float(data, dtype, index); }
};

// Converts a tensor to float32 (bf16 and fp16 widened exactly).
std::vector<float> tensor_to_floats(const TensorView& tensor);
// The same into caller memory; INVALID_ARGUMENT when `out` is not numel() long.
absl::Status tensor_to_floats(const TensorView& tensor, std::span<float> out);

// One parsed header entry.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // relative to the start of the data section
  uint64_t data_end = 0;
};

// A parsed and checked header.
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in file (offset) order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + header length
};

// Parses and checks the header of a whole file held in `file_bytes`; `file_name` only labels
// messages. Never reads outside `file_bytes`.
absl::StatusOr<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> file_bytes,
                                                           std::string_view file_name);

class SafetensorsFile {
 public:
  // Maps and checks `path`.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> open(const std::filesystem::path& path);
  // Checks a file already in memory (tests, fuzzing); the bytes are copied.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> from_bytes(
      std::span<const std::byte> file_bytes, std::string_view file_name);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const std::vector<TensorEntry>& entries() const { return header_.tensors; }
  bool contains(std::string_view name) const;
  // NOT_FOUND names the file and the tensor.
  absl::StatusOr<TensorView> tensor(std::string_view name) const;
  TensorView view(const TensorEntry& entry) const;

 private:
  SafetensorsFile() = default;
  absl::Status init(std::string_view file_name);

  std::string path_;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;       // munmap()ed on destruction when set
  std::vector<std::byte> owned_;  // backing store of from_bytes()
  SafetensorsHeader header_;
  std::unordered_map<std::string_view, size_t> index_;
};

// The tensors of a checkpoint: one .safetensors file or the shards of a
// `model.safetensors.index.json`.
class SafetensorsSet {
 public:
  // `path` is a .safetensors file, a *.safetensors.index.json, or a directory holding
  // model.safetensors.index.json, model.safetensors, or exactly one *.safetensors file.
  // For an index: every shard it names is opened; each tensor must live in exactly the shard
  // the weight_map names, and every tensor of a shard must be in the weight_map.
  static absl::StatusOr<SafetensorsSet> open(const std::filesystem::path& path);

  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  // NOT_FOUND names the checkpoint and the tensor.
  absl::StatusOr<TensorView> tensor(std::string_view name) const;
  // All tensor names, sorted.
  std::vector<std::string> names() const;
  size_t size() const { return tensors_.size(); }
  const std::string& source() const { return source_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  // Adds a file's tensors (for building a set by hand in tests); duplicates are refused.
  absl::Status add_file(std::unique_ptr<SafetensorsFile> file);

 private:
  std::string source_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView, std::less<>> tensors_;
};

// --- Writing -------------------------------------------------------------------------------

// A tensor to write, owning its bytes.
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// Builds a tensor from float values, rounding to `dtype` (round to nearest even).
OwnedTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                        std::span<const float> values);

// The bytes of a safetensors file holding `tensors` in the given order. The header is padded
// with spaces to a multiple of 8 bytes, as the reference writer does. INVALID_ARGUMENT for a
// duplicate or empty name, the reserved name "__metadata__", or bytes that do not match the
// shape.
absl::StatusOr<std::vector<std::byte>> serialize_safetensors(
    std::span<const OwnedTensor> tensors, const std::map<std::string, std::string>& metadata = {});

absl::Status write_safetensors(const std::filesystem::path& path,
                               std::span<const OwnedTensor> tensors,
                               const std::map<std::string, std::string>& metadata = {});

// Writes a model.safetensors.index.json: weight_map (tensor name -> shard file name) and
// metadata.total_size (bytes of tensor data over all shards).
absl::Status write_safetensors_index(const std::filesystem::path& path,
                                     const std::map<std::string, std::string>& weight_map,
                                     uint64_t total_size);

}  // namespace deft::models
