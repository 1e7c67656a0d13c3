#include "models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer/string_compat.h"
#include "nlohmann/json.hpp"

namespace deft::models {
namespace {

using nlohmann::json;

using engine::str_cat;

constexpr std::string_view kMetadataKey = "__metadata__";

absl::Status bad_file(std::string_view file, std::string_view what) {
  return absl::InvalidArgumentError(str_cat("safetensors file '", file, "': ", what));
}

absl::Status bad_tensor(std::string_view file, std::string_view tensor, std::string_view what) {
  return absl::InvalidArgumentError(
      str_cat("safetensors file '", file, "', tensor '", tensor, "': ", what));
}

// JSON parse that also reports whether any object repeated a key (nlohmann keeps the last
// value silently; the format forbids duplicates, and a repeated tensor name would hide data).
struct ParsedJson {
  json value;
  std::string duplicate_key;  // the first repeated key, empty if none
};

ParsedJson parse_json_checking_duplicates(std::string_view text) {
  ParsedJson result;
  std::vector<std::set<std::string>> open_objects;
  json::parser_callback_t callback = [&](int /*depth*/, json::parse_event_t event,
                                         json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second &&
            result.duplicate_key.empty()) {
          result.duplicate_key = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  result.value = json::parse(text, callback, /*allow_exceptions=*/false);
  return result;
}

// A non-negative integer that fits in int64.
bool read_non_negative(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return *out <= static_cast<uint64_t>(INT64_MAX);
  }
  if (value.is_number_integer()) {
    const int64_t number = value.get<int64_t>();
    if (number < 0) return false;
    *out = static_cast<uint64_t>(number);
    return true;
  }
  return false;
}

absl::StatusOr<TensorEntry> parse_entry(const std::string& name, const json& value,
                                        std::string_view file) {
  if (!value.is_object()) return bad_tensor(file, name, "header entry is not a JSON object");
  TensorEntry entry;
  entry.name = name;

  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end() || !dtype_it->is_string()) {
    return bad_tensor(file, name, "missing or non-string \"dtype\"");
  }
  const std::string dtype_text = dtype_it->get<std::string>();
  const std::optional<DType> dtype = parse_dtype_name(dtype_text);
  if (!dtype) {
    return bad_tensor(file, name,
                      str_cat("unsupported dtype \"", dtype_text, "\" (supported: F32, F16, BF16)"));
  }
  entry.dtype = *dtype;

  const auto shape_it = value.find("shape");
  if (shape_it == value.end() || !shape_it->is_array()) {
    return bad_tensor(file, name, "missing or non-array \"shape\"");
  }
  uint64_t numel = 1;
  for (const json& dim_value : *shape_it) {
    uint64_t dim = 0;
    if (!read_non_negative(dim_value, &dim)) {
      return bad_tensor(file, name,
                        str_cat("shape ", shape_it->dump(),
                            " has a dimension that is not a "
                            "non-negative integer"));
    }
    if (__builtin_mul_overflow(numel, dim, &numel) || numel > static_cast<uint64_t>(INT64_MAX)) {
      return bad_tensor(file, name, str_cat("shape ", shape_it->dump(), " overflows"));
    }
    entry.shape.push_back(static_cast<int64_t>(dim));
  }

  const auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !read_non_negative((*offsets_it)[0], &entry.data_begin) ||
      !read_non_negative((*offsets_it)[1], &entry.data_end)) {
    return bad_tensor(file, name,
                      "\"data_offsets\" is not a pair of non-negative integers [begin, end]");
  }
  if (entry.data_end < entry.data_begin) {
    return bad_tensor(file, name,
                      str_cat("data_offsets ", offsets_it->dump(), " end before they begin"));
  }
  uint64_t expected_bytes = 0;
  if (__builtin_mul_overflow(numel, dtype_bytes(entry.dtype), &expected_bytes) ||
      entry.data_end - entry.data_begin != expected_bytes) {
    return bad_tensor(file, name,
                      str_cat("data_offsets ", offsets_it->dump(), " span ",
                          entry.data_end - entry.data_begin, " bytes, but shape ", shape_it->dump(),
                          " of ", dtype_text, " needs ", numel, " x ", dtype_bytes(entry.dtype)));
  }
  return entry;
}

// Maps a whole file read-only; RAII over the mapping lives in SafetensorsFile.
struct Mapping {
  void* address = nullptr;
  size_t size = 0;
};

absl::StatusOr<Mapping> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        str_cat("cannot open safetensors file '", path, "': ", std::strerror(errno)));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return bad_file(path, "not a regular file");
  }
  Mapping mapping;
  mapping.size = static_cast<size_t>(info.st_size);
  if (mapping.size < 8) {
    ::close(fd);
    return bad_file(path,
                    str_cat("only ", mapping.size, " bytes: shorter than the 8-byte header length"));
  }
  mapping.address = ::mmap(nullptr, mapping.size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (mapping.address == MAP_FAILED) {
    return absl::InternalError(
        str_cat("cannot mmap safetensors file '", path, "': ", std::strerror(map_errno)));
  }
  return mapping;
}

// Rejects shard names that would leave the checkpoint directory.
bool is_plain_relative(const std::string& name) {
  if (name.empty()) return false;
  const std::filesystem::path path(name);
  if (path.is_absolute()) return false;
  for (const auto& part : path) {
    if (part == "..") return false;
  }
  return true;
}

absl::StatusOr<std::string> read_text_file(const std::filesystem::path& path) {
  std::ifstream stream(path, std::ios::binary);
  if (!stream) return absl::NotFoundError(str_cat("cannot open '", path.string(), "'"));
  std::ostringstream text;
  text << stream.rdbuf();
  return text.str();
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

std::vector<float> tensor_to_floats(const TensorView& tensor) {
  std::vector<float> out(static_cast<size_t>(tensor.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = tensor.at(i);
  return out;
}

absl::Status tensor_to_floats(const TensorView& tensor, std::span<float> out) {
  if (static_cast<int64_t>(out.size()) != tensor.numel()) {
    return absl::InvalidArgumentError(str_cat("tensor '", tensor.name, "' has ", tensor.numel(),
                                          " elements, output holds ", out.size()));
  }
  for (size_t i = 0; i < out.size(); ++i) out[i] = tensor.at(i);
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> file_bytes,
                                                           std::string_view file_name) {
  if (file_bytes.size() < 8) {
    return bad_file(file_name, str_cat("only ", file_bytes.size(),
                                   " bytes: shorter than the 8-byte header length"));
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<uint8_t>(file_bytes[i]);
  }
  const uint64_t available = file_bytes.size() - 8;
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return bad_file(file_name, str_cat("header length ", header_bytes, " exceeds the limit of ",
                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_bytes > available) {
    return bad_file(file_name, str_cat("header length ", header_bytes, " exceeds the ", available,
                                   " bytes after the length field (truncated?)"));
  }
  const std::string_view text(reinterpret_cast<const char*>(file_bytes.data() + 8),
                              static_cast<size_t>(header_bytes));
  if (text.empty() || text.front() != '{') {
    return bad_file(file_name, "header does not start with '{'");
  }
  ParsedJson parsed = parse_json_checking_duplicates(text);
  if (parsed.value.is_discarded()) return bad_file(file_name, "header is not well-formed JSON");
  if (!parsed.value.is_object()) return bad_file(file_name, "header is not a JSON object");
  if (!parsed.duplicate_key.empty()) {
    return bad_file(file_name, str_cat("header repeats the key \"", parsed.duplicate_key,
                                   "\" (duplicate tensor name?)"));
  }

  SafetensorsHeader header;
  header.data_offset = 8 + header_bytes;
  for (const auto& [key, value] : parsed.value.items()) {
    if (key == kMetadataKey) {
      if (value.is_null()) continue;
      if (!value.is_object()) return bad_file(file_name, "__metadata__ is not a JSON object");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          return bad_file(file_name,
                          str_cat("__metadata__ value of \"", meta_key, "\" is not a string"));
        }
        header.metadata.emplace(meta_key, meta_value.get<std::string>());
      }
      continue;
    }
    absl::StatusOr<TensorEntry> entry = parse_entry(key, value, file_name);
    if (!entry.ok()) return entry.status();
    header.tensors.push_back(*std::move(entry));
  }

  // Byte ranges: inside the data, then in order, without overlap or gaps, covering the data.
  const uint64_t data_bytes = available - header_bytes;
  for (const TensorEntry& entry : header.tensors) {
    if (entry.data_end > data_bytes) {
      return bad_tensor(file_name, entry.name,
                        str_cat("data ends at byte ", entry.data_end, " but the file holds ",
                            data_bytes, " bytes of data (truncated?)"));
    }
  }
  std::sort(
      header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
        return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
      });
  uint64_t cursor = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& entry : header.tensors) {
    if (entry.data_begin < cursor) {
      return bad_tensor(
          file_name, entry.name,
          str_cat("data [", entry.data_begin, ", ", entry.data_end, ") overlaps tensor '",
              previous->name, "' [", previous->data_begin, ", ", previous->data_end, ")"));
    }
    if (entry.data_begin > cursor) {
      return bad_tensor(
          file_name, entry.name,
          str_cat("data begins at byte ", entry.data_begin, ", leaving a gap after byte ", cursor));
    }
    cursor = entry.data_end;
    previous = &entry;
  }
  if (cursor != data_bytes) {
    return bad_file(file_name, str_cat(data_bytes - cursor, " bytes after the last tensor ",
                                   "(tensors cover ", cursor, " of ", data_bytes, " data bytes)"));
  }
  return header;
}

// --- SafetensorsFile -------------------------------------------------------------------------

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(
    const std::filesystem::path& path) {
  absl::StatusOr<Mapping> mapping = map_file(path.string());
  if (!mapping.ok()) return mapping.status();
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->mapping_ = mapping->address;
  file->base_ = static_cast<const std::byte*>(mapping->address);
  file->size_ = mapping->size;
  if (absl::Status status = file->init(path.string()); !status.ok()) return status;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::from_bytes(
    std::span<const std::byte> file_bytes, std::string_view file_name) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->owned_.assign(file_bytes.begin(), file_bytes.end());
  file->base_ = file->owned_.data();
  file->size_ = file->owned_.size();
  if (absl::Status status = file->init(file_name); !status.ok()) return status;
  return file;
}

absl::Status SafetensorsFile::init(std::string_view file_name) {
  path_ = std::string(file_name);
  absl::StatusOr<SafetensorsHeader> header =
      parse_safetensors_header(std::span<const std::byte>(base_, size_), path_);
  if (!header.ok()) return header.status();
  header_ = *std::move(header);
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    index_.emplace(header_.tensors[i].name, i);
  }
  return absl::OkStatus();
}

bool SafetensorsFile::contains(std::string_view name) const { return index_.contains(name); }

TensorView SafetensorsFile::view(const TensorEntry& entry) const {
  TensorView view;
  view.name = entry.name;
  view.file = path_;
  view.dtype = entry.dtype;
  view.shape = entry.shape;
  view.data = base_ + header_.data_offset + entry.data_begin;
  view.bytes = static_cast<size_t>(entry.data_end - entry.data_begin);
  return view;
}

absl::StatusOr<TensorView> SafetensorsFile::tensor(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(str_cat("safetensors file '", path_, "' has no tensor '", name, "'"));
  }
  return view(header_.tensors[it->second]);
}

// --- SafetensorsSet --------------------------------------------------------------------------

absl::Status SafetensorsSet::add_file(std::unique_ptr<SafetensorsFile> file) {
  for (const TensorEntry& entry : file->entries()) {
    if (const auto it = tensors_.find(entry.name); it != tensors_.end()) {
      return absl::InvalidArgumentError(str_cat("tensor '", entry.name, "' is in both '",
                                            it->second.file, "' and '", file->path(), "'"));
    }
  }
  for (const TensorEntry& entry : file->entries()) tensors_.emplace(entry.name, file->view(entry));
  if (source_.empty()) source_ = file->path();
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

absl::StatusOr<TensorView> SafetensorsSet::tensor(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(str_cat("checkpoint '", source_, "' has no tensor '", name, "'"));
  }
  return it->second;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<SafetensorsSet> SafetensorsSet::open(const std::filesystem::path& path) {
  std::error_code error;
  std::filesystem::path target = path;
  if (std::filesystem::is_directory(path, error)) {
    if (std::filesystem::exists(path / "model.safetensors.index.json", error)) {
      target = path / "model.safetensors.index.json";
    } else if (std::filesystem::exists(path / "model.safetensors", error)) {
      target = path / "model.safetensors";
    } else {
      std::vector<std::filesystem::path> found;
      for (const auto& item : std::filesystem::directory_iterator(path, error)) {
        if (item.path().extension() == ".safetensors") found.push_back(item.path());
      }
      if (found.size() != 1) {
        return absl::NotFoundError(str_cat("directory '", path.string(),
                                       "' has no model.safetensors.index.json or "
                                       "model.safetensors, and ",
                                       found.size(), " *.safetensors files (need exactly one)"));
      }
      target = found.front();
    }
  }

  SafetensorsSet set;
  set.source_ = target.string();
  const std::string file_name = target.filename().string();
  if (!file_name.ends_with(".index.json")) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::open(target);
    if (!file.ok()) return file.status();
    if (absl::Status status = set.add_file(*std::move(file)); !status.ok()) return status;
    return set;
  }

  // Sharded: the index names the shard of every tensor.
  absl::StatusOr<std::string> text = read_text_file(target);
  if (!text.ok()) return text.status();
  const ParsedJson index = parse_json_checking_duplicates(*text);
  auto bad_index = [&](std::string_view what) {
    return absl::InvalidArgumentError(str_cat("safetensors index '", target.string(), "': ", what));
  };
  if (index.value.is_discarded() || !index.value.is_object()) {
    return bad_index("not a well-formed JSON object");
  }
  if (!index.duplicate_key.empty()) {
    return bad_index(str_cat("repeats the key \"", index.duplicate_key, "\""));
  }
  const auto map_it = index.value.find("weight_map");
  if (map_it == index.value.end() || !map_it->is_object()) {
    return bad_index("missing or non-object \"weight_map\"");
  }
  std::map<std::string, std::string> weight_map;  // tensor -> shard
  std::set<std::string> shard_names;
  for (const auto& [tensor_name, shard] : map_it->items()) {
    if (!shard.is_string() || !is_plain_relative(shard.get<std::string>())) {
      return bad_index(str_cat("tensor '", tensor_name, "' maps to ", shard.dump(),
                           ", not a file name inside the checkpoint directory"));
    }
    weight_map.emplace(tensor_name, shard.get<std::string>());
    shard_names.insert(shard.get<std::string>());
  }
  const std::filesystem::path directory = target.parent_path();
  for (const std::string& shard_name : shard_names) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::open(directory / shard_name);
    if (!file.ok()) return file.status();
    for (const TensorEntry& entry : (*file)->entries()) {
      const auto it = weight_map.find(entry.name);
      if (it == weight_map.end()) {
        return bad_index(str_cat("shard '", shard_name, "' holds tensor '", entry.name,
                             "', which the weight_map does not list"));
      }
      if (it->second != shard_name) {
        return bad_index(str_cat("shard '", shard_name, "' holds tensor '", entry.name,
                             "', which the weight_map puts in '", it->second, "'"));
      }
    }
    if (absl::Status status = set.add_file(*std::move(file)); !status.ok()) return status;
  }
  for (const auto& [tensor_name, shard] : weight_map) {
    if (!set.contains(tensor_name)) {
      return bad_index(str_cat("weight_map puts tensor '", tensor_name, "' in '", shard,
                           "', but that shard does not hold it"));
    }
  }
  return set;
}

// --- Writing ---------------------------------------------------------------------------------

OwnedTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                        std::span<const float> values) {
  OwnedTensor tensor;
  tensor.name = std::move(name);
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  tensor.bytes.resize(values.size() * dtype_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    std::byte* destination = tensor.bytes.data() + i * dtype_bytes(dtype);
    if (dtype == DType::kF32) {
      std::memcpy(destination, &values[i], 4);
    } else {
      const uint16_t bits =
          dtype == DType::kBF16 ? float_to_bf16(values[i]) : float_to_fp16(values[i]);
      std::memcpy(destination, &bits, 2);
    }
  }
  return tensor;
}

absl::StatusOr<std::vector<std::byte>> serialize_safetensors(
    std::span<const OwnedTensor> tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const OwnedTensor& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == kMetadataKey) {
      return absl::InvalidArgumentError(str_cat("cannot write a tensor named \"", tensor.name, "\""));
    }
    if (header.contains(tensor.name)) {
      return absl::InvalidArgumentError(str_cat("tensor '", tensor.name, "' given twice"));
    }
    int64_t numel = 1;
    for (int64_t dim : tensor.shape) {
      if (dim < 0) {
        return absl::InvalidArgumentError(
            str_cat("tensor '", tensor.name, "' has a negative dimension"));
      }
      numel *= dim;
    }
    if (tensor.bytes.size() != static_cast<size_t>(numel) * dtype_bytes(tensor.dtype)) {
      return absl::InvalidArgumentError(
          str_cat("tensor '", tensor.name, "' holds ", tensor.bytes.size(), " bytes, its shape needs ",
              numel * static_cast<int64_t>(dtype_bytes(tensor.dtype))));
    }
    header[tensor.name] = {{"dtype", std::string(dtype_name(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + tensor.bytes.size()}}};
    offset += tensor.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<std::byte> out(8 + text.size() + offset);
  uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<std::byte>(length & 0xff);
    length >>= 8;
  }
  std::memcpy(out.data() + 8, text.data(), text.size());
  std::byte* cursor = out.data() + 8 + text.size();
  for (const OwnedTensor& tensor : tensors) {
    if (!tensor.bytes.empty()) std::memcpy(cursor, tensor.bytes.data(), tensor.bytes.size());
    cursor += tensor.bytes.size();
  }
  return out;
}

absl::Status write_safetensors(const std::filesystem::path& path,
                               std::span<const OwnedTensor> tensors,
                               const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  if (!stream) return absl::InternalError(str_cat("cannot create '", path.string(), "'"));
  stream.write(reinterpret_cast<const char*>(bytes->data()),
               static_cast<std::streamsize>(bytes->size()));
  if (!stream.flush()) return absl::InternalError(str_cat("cannot write '", path.string(), "'"));
  return absl::OkStatus();
}

absl::Status write_safetensors_index(const std::filesystem::path& path,
                                     const std::map<std::string, std::string>& weight_map,
                                     uint64_t total_size) {
  const json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  std::ofstream stream(path, std::ios::trunc);
  if (!stream) return absl::InternalError(str_cat("cannot create '", path.string(), "'"));
  stream << index.dump(2) << "\n";
  if (!stream.flush()) return absl::InternalError(str_cat("cannot write '", path.string(), "'"));
  return absl::OkStatus();
}

}  // namespace deft::models
