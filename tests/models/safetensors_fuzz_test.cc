// Randomized robustness test of the safetensors header parser: thousands of seeded mutations
// and truncations of a valid file. Each must give either an error or a header whose every
// tensor lies inside the file, and reading every tensor of an accepted file must stay inside
// the buffer (run it in the -DDEFT_SANITIZE=ON build to have ASan check that).
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "models/safetensors.h"
#include "tests/testing/fuzz_outcomes.h"

namespace deft::models {
namespace {

constexpr int kIterations = 20000;

std::vector<std::byte> valid_file() {
  std::vector<OwnedTensor> tensors;
  std::vector<float> values(24);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 2.0f;
  tensors.push_back(make_tensor("model.embed_tokens.weight", DType::kBF16, {4, 6}, values));
  tensors.push_back(make_tensor("model.layers.0.self_attn.q_proj.weight", DType::kF16, {3, 4},
                                std::span(values).first(12)));
  tensors.push_back(make_tensor("model.norm.weight", DType::kF32, {6}, std::span(values).first(6)));
  tensors.push_back(make_tensor("s", DType::kF32, {}, std::span(values).first(1)));
  tensors.push_back(make_tensor("z", DType::kF16, {0}, {}));
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors, {{"format", "pt"}});
  EXPECT_TRUE(bytes.ok());
  return *bytes;
}

// One random edit. JSON-aware edits (digits, structural characters) reach the semantic checks
// past the JSON parser; raw edits and truncations exercise the framing.
void mutate(std::vector<std::byte>& bytes, std::mt19937_64& rng) {
  auto pick = [&rng](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto random_byte = [&rng] {
    return static_cast<std::byte>(std::uniform_int_distribution<int>(0, 255)(rng));
  };
  static constexpr char kJsonChars[] = "{}[],:\"0123456789-.eE \\";
  switch (pick(8)) {
    case 0:  // truncate anywhere
      bytes.resize(pick(bytes.size() + 1));
      break;
    case 1:  // flip bits of a random byte
      if (!bytes.empty()) bytes[pick(bytes.size())] ^= static_cast<std::byte>(1u << pick(8));
      break;
    case 2:  // random byte anywhere
      if (!bytes.empty()) bytes[pick(bytes.size())] = random_byte();
      break;
    case 3: {  // rewrite a digit of the header (shapes, offsets)
      std::vector<size_t> digits;
      for (size_t i = 8; i < bytes.size(); ++i) {
        const char c = static_cast<char>(bytes[i]);
        if (c >= '0' && c <= '9') digits.push_back(i);
      }
      if (!digits.empty())
        bytes[digits[pick(digits.size())]] = static_cast<std::byte>('0' + pick(10));
      break;
    }
    case 4:  // JSON structural character somewhere in the header
      if (bytes.size() > 8) {
        bytes[8 + pick(bytes.size() - 8)] =
            static_cast<std::byte>(kJsonChars[pick(sizeof(kJsonChars) - 1)]);
      }
      break;
    case 5: {  // insert or delete a few bytes (header and data shift against the length)
      const size_t at = pick(bytes.size() + 1);
      if (pick(2) == 0) {
        const size_t count = 1 + pick(4);
        for (size_t i = 0; i < count; ++i) {
          bytes.insert(bytes.begin() + static_cast<ptrdiff_t>(at), random_byte());
        }
      } else if (at < bytes.size()) {
        const size_t count = std::min(bytes.size() - at, 1 + pick(4));
        bytes.erase(bytes.begin() + static_cast<ptrdiff_t>(at),
                    bytes.begin() + static_cast<ptrdiff_t>(at + count));
      }
      break;
    }
    case 6: {  // a new header length
      if (bytes.size() >= 8) {
        uint64_t length = pick(2) == 0 ? pick(bytes.size() + 16) : rng();
        for (int i = 0; i < 8; ++i) {
          bytes[i] = static_cast<std::byte>(length & 0xff);
          length >>= 8;
        }
      }
      break;
    }
    default: {  // append garbage
      const size_t count = 1 + pick(16);
      for (size_t i = 0; i < count; ++i) bytes.push_back(random_byte());
      break;
    }
  }
}

// What an accepted header promises: every tensor lies inside the file and matches its shape.
void check_accepted(const std::vector<std::byte>& bytes, const SafetensorsHeader& header) {
  ASSERT_LE(header.data_offset, bytes.size());
  uint64_t cursor = 0;
  for (const TensorEntry& entry : header.tensors) {
    ASSERT_EQ(entry.data_begin, cursor);
    ASSERT_LE(entry.data_end, bytes.size() - header.data_offset);
    uint64_t numel = 1;
    for (int64_t dim : entry.shape) numel *= static_cast<uint64_t>(dim);
    ASSERT_EQ(entry.data_end - entry.data_begin, numel * dtype_bytes(entry.dtype));
    cursor = entry.data_end;
  }
  ASSERT_EQ(cursor, bytes.size() - header.data_offset);
  // Read every element through the public accessors (ASan checks the bounds).
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::from_bytes(bytes, "fuzz.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TensorEntry& entry : (*file)->entries()) {
    absl::StatusOr<TensorView> view = (*file)->tensor(entry.name);
    ASSERT_TRUE(view.ok());
    const std::vector<float> values = tensor_to_floats(*view);
    ASSERT_EQ(static_cast<int64_t>(values.size()), view->numel());
  }
}

TEST(SafetensorsFuzzTest, RandomMutationsNeverCrash) {
  const std::vector<std::byte> original = valid_file();
  int accepted = 0;
  int refused = 0;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    const uint64_t seed = 0xdef7'0000ull + static_cast<uint64_t>(iteration);
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    std::vector<std::byte> bytes = original;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int edit = 0; edit < edits; ++edit) mutate(bytes, rng);

    absl::StatusOr<SafetensorsHeader> header = parse_safetensors_header(bytes, "fuzz.safetensors");
    if (header.ok()) {
      ++accepted;
      check_accepted(bytes, *header);
      if (::testing::Test::HasFatalFailure()) return;
    } else {
      ++refused;
      ASSERT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_NE(header.status().message().find("fuzz.safetensors"), absl::string_view::npos)
          << header.status();
    }
  }
  // Both outcomes are exercised (edits that keep the file valid, e.g. in a metadata value or in
  // tensor data, and edits that break it).
  deft::testing::expect_both_outcomes(accepted, refused, kIterations / 50, kIterations / 2);
}

}  // namespace
}  // namespace deft::models
