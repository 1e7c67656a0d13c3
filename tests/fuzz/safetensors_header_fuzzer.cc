// libFuzzer harness: the safetensors header parser (models/safetensors.h) on arbitrary file
// bytes, the input being a whole .safetensors file.
// Contracts checked:
//   - parse_safetensors_header reads nothing outside the bytes (ASan) and refuses with
//     INVALID_ARGUMENT naming the file;
//   - an accepted header is what the loader relies on: data_offset = 8 + header length within
//     the file; tensors in offset order, contiguous from byte 0 and covering the data exactly;
//     each tensor's byte range = its element count x its dtype size;
//   - SafetensorsFile::from_bytes accepts exactly what the parser accepts, finds every tensor
//     by name, and every byte of every tensor converts to float (tensor_to_floats).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

using deft::models::SafetensorsHeader;
using deft::models::TensorEntry;

constexpr std::string_view kFileName = "fuzz.safetensors";

void check_header(const SafetensorsHeader& header, size_t file_bytes) {
  FUZZ_CHECK(header.data_offset >= 8 && header.data_offset <= file_bytes,
             absl::StrCat("data_offset ", header.data_offset, " of a ", file_bytes, "-byte file"));
  const uint64_t data_bytes = file_bytes - header.data_offset;
  uint64_t cursor = 0;
  for (const TensorEntry& entry : header.tensors) {
    FUZZ_CHECK(entry.data_begin == cursor,
               absl::StrCat("tensor '", entry.name, "' begins at ", entry.data_begin,
                            ", the previous one ends at ", cursor));
    uint64_t numel = 1;
    for (int64_t dim : entry.shape) {
      FUZZ_CHECK(dim >= 0, absl::StrCat("tensor '", entry.name, "' has dimension ", dim));
      numel *= static_cast<uint64_t>(dim);
    }
    FUZZ_CHECK(entry.data_end - entry.data_begin == numel * deft::models::dtype_bytes(entry.dtype),
               absl::StrCat("tensor '", entry.name, "' spans ", entry.data_end - entry.data_begin,
                            " bytes for ", numel, " elements"));
    cursor = entry.data_end;
  }
  FUZZ_CHECK(cursor == data_bytes,
             absl::StrCat("tensors cover ", cursor, " of ", data_bytes, " data bytes"));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const absl::StatusOr<SafetensorsHeader> header =
      deft::models::parse_safetensors_header(bytes, kFileName);
  auto file = deft::models::SafetensorsFile::from_bytes(bytes, kFileName);
  FUZZ_CHECK(header.ok() == file.ok(), absl::StrCat("parser: ", header.status().ToString(),
                                                    "; from_bytes: ", file.status().ToString()));
  if (!header.ok()) {
    FUZZ_CHECK(header.status().code() == absl::StatusCode::kInvalidArgument,
               header.status().ToString());
    FUZZ_CHECK(deft::fuzz::mentions(header.status(), kFileName), header.status().ToString());
    return 0;
  }
  check_header(*header, size);
  for (const TensorEntry& entry : (*file)->entries()) {
    const absl::StatusOr<deft::models::TensorView> view = (*file)->tensor(entry.name);
    FUZZ_CHECK(view.ok(), view.status().ToString());
    FUZZ_CHECK(view->bytes == entry.data_end - entry.data_begin, entry.name);
    const std::vector<float> values = deft::models::tensor_to_floats(*view);
    FUZZ_CHECK(static_cast<int64_t>(values.size()) == view->numel(), entry.name);
  }
  return 0;
}
