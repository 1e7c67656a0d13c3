#include "models/safetensors.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deft::models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<float> iota_floats(size_t count, float scale) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = scale * (static_cast<float>(i) - 3.0f);
  return values;
}

// A file's bytes from a header text and raw data, with the length prefix set to the header.
std::vector<std::byte> craft(const std::string& header, size_t data_bytes,
                             std::optional<uint64_t> length_override = std::nullopt) {
  std::vector<std::byte> out(8 + header.size() + data_bytes, std::byte{0x3c});
  uint64_t length = length_override.value_or(header.size());
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<std::byte>(length & 0xff);
    length >>= 8;
  }
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

std::string parse_error(const std::vector<std::byte>& bytes) {
  absl::StatusOr<SafetensorsHeader> header = parse_safetensors_header(bytes, "bad.safetensors");
  if (header.ok()) return "OK";
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(header.status().message()), HasSubstr("bad.safetensors"));
  return std::string(header.status().message());
}

std::vector<OwnedTensor> sample_tensors() {
  std::vector<OwnedTensor> tensors;
  tensors.push_back(make_tensor("model.embed_tokens.weight", DType::kBF16, {4, 3},
                                iota_floats(12, 0.5f)));
  tensors.push_back(make_tensor("model.norm.weight", DType::kF32, {3}, iota_floats(3, 1.25f)));
  tensors.push_back(make_tensor("half", DType::kF16, {2, 1, 3}, iota_floats(6, 0.125f)));
  tensors.push_back(make_tensor("scalar", DType::kF32, {}, std::vector<float>{42.0f}));
  tensors.push_back(make_tensor("empty", DType::kBF16, {0, 5}, {}));
  return tensors;
}

TEST(DTypeTest, HalfPrecisionRoundTripsEveryPattern) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const auto half = static_cast<uint16_t>(bits);
    const float from_fp16 = fp16_to_float(half);
    const float from_bf16 = bf16_to_float(half);
    if (std::isnan(from_fp16)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(from_fp16))));
    } else {
      EXPECT_EQ(float_to_fp16(from_fp16), half) << bits;
    }
    if (std::isnan(from_bf16)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bf16))));
    } else {
      EXPECT_EQ(float_to_bf16(from_bf16), half) << bits;
    }
  }
}

TEST(DTypeTest, RoundsToNearestEven) {
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(1.0f + 0x1.0p-11f), 0x3c00);           // tie: to even
  EXPECT_EQ(float_to_fp16(1.0f + 3 * 0x1.0p-11f), 0x3c02);       // tie: to even (up)
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);                    // overflow to inf
  EXPECT_EQ(float_to_fp16(0x1.0p-24f), 0x0001);                  // smallest subnormal
  EXPECT_EQ(float_to_fp16(0x1.0p-25f), 0x0000);                  // tie below it: to even (0)
  EXPECT_EQ(float_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(1.0f + 0x1.0p-8f), 0x3f80);            // tie: to even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1.0p-8f), 0x3f82);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_FLOAT_EQ(fp16_to_float(0x3555), 0.333251953125f);
}

TEST(SafetensorsTest, WriteThenReadBack) {
  const std::filesystem::path dir = fresh_dir("deft_safetensors_roundtrip");
  const std::vector<OwnedTensor> tensors = sample_tensors();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "test"}};
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors, metadata).ok());

  // The header is padded to 8 bytes, as the reference writer does.
  std::ifstream stream(dir / "model.safetensors", std::ios::binary);
  uint64_t header_bytes = 0;
  stream.read(reinterpret_cast<char*>(&header_bytes), 8);
  EXPECT_EQ(header_bytes % 8, 0u);

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::open(dir / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(), metadata);
  EXPECT_EQ((*file)->entries().size(), tensors.size());
  for (const OwnedTensor& written : tensors) {
    absl::StatusOr<TensorView> view = (*file)->tensor(written.name);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype, written.dtype);
    EXPECT_EQ(std::vector<int64_t>(view->shape.begin(), view->shape.end()), written.shape);
    ASSERT_EQ(view->bytes, written.bytes.size());
    EXPECT_EQ(std::memcmp(view->data, written.bytes.data(), view->bytes), 0) << written.name;
  }
  // bf16 and fp16 hold these small multiples of powers of two exactly.
  absl::StatusOr<TensorView> embed = (*file)->tensor("model.embed_tokens.weight");
  EXPECT_EQ(tensor_to_floats(*embed), iota_floats(12, 0.5f));
  absl::StatusOr<TensorView> half = (*file)->tensor("half");
  EXPECT_EQ(tensor_to_floats(*half), iota_floats(6, 0.125f));
  absl::StatusOr<TensorView> scalar = (*file)->tensor("scalar");
  EXPECT_EQ(scalar->numel(), 1);
  EXPECT_EQ(scalar->at(0), 42.0f);
  absl::StatusOr<TensorView> empty = (*file)->tensor("empty");
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(empty->bytes, 0u);

  std::vector<float> too_small(2);
  EXPECT_FALSE(tensor_to_floats(*embed, too_small).ok());

  absl::StatusOr<TensorView> missing = (*file)->tensor("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("nope"));
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsTest, BytesRoundTripAndRounding) {
  const float value = 1.0f + 0x1.0p-9f;  // not representable in bf16: rounds to 1.0
  const std::vector<OwnedTensor> tensors = {
      make_tensor("x", DType::kBF16, {1}, std::vector<float>{value})};
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors);
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::from_bytes(*bytes, "memory");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensor("x")->at(0), 1.0f);
}

TEST(SafetensorsTest, WriterRefusesInconsistentTensors) {
  std::vector<OwnedTensor> tensors = sample_tensors();
  tensors.push_back(tensors.front());
  EXPECT_THAT(std::string(serialize_safetensors(tensors).status().message()),
              HasSubstr("given twice"));
  OwnedTensor wrong = make_tensor("w", DType::kF32, {2, 2}, iota_floats(3, 1.0f));
  EXPECT_FALSE(serialize_safetensors(std::vector<OwnedTensor>{wrong}).ok());
  OwnedTensor reserved = make_tensor("__metadata__", DType::kF32, {1}, iota_floats(1, 1.0f));
  EXPECT_FALSE(serialize_safetensors(std::vector<OwnedTensor>{reserved}).ok());
}

TEST(SafetensorsTest, EmptyFileHasNoTensors) {
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors({});
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<SafetensorsHeader> header = parse_safetensors_header(*bytes, "empty");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_TRUE(header->tensors.empty());
}

TEST(SafetensorsCorruptionTest, TooShortForTheLength) {
  EXPECT_THAT(parse_error(std::vector<std::byte>(5)), HasSubstr("shorter than the 8-byte"));
  absl::StatusOr<SafetensorsHeader> empty = parse_safetensors_header({}, "bad.safetensors");
  EXPECT_FALSE(empty.ok());
}

TEST(SafetensorsCorruptionTest, HeaderLengthBeyondFile) {
  EXPECT_THAT(parse_error(craft("{}", 0, 1000)), HasSubstr("header length 1000 exceeds"));
  EXPECT_THAT(parse_error(craft("{}", 0, std::numeric_limits<uint64_t>::max())),
              HasSubstr("exceeds the limit"));
}

TEST(SafetensorsCorruptionTest, MalformedJson) {
  EXPECT_THAT(parse_error(craft("{\"a\": ", 0)), HasSubstr("not well-formed JSON"));
  EXPECT_THAT(parse_error(craft("[1, 2]  ", 0)), HasSubstr("does not start with '{'"));
  EXPECT_THAT(parse_error(craft("", 0)), HasSubstr("does not start with '{'"));
  EXPECT_THAT(parse_error(craft("{} trailing", 0)), HasSubstr("not well-formed JSON"));
  EXPECT_THAT(parse_error(craft("{\"a\": \"\xff\xfe\"}", 0)), HasSubstr("not well-formed JSON"));
}

TEST(SafetensorsCorruptionTest, EntryFields) {
  EXPECT_THAT(parse_error(craft(R"({"t": 5})", 0)), HasSubstr("'t': header entry is not"));
  EXPECT_THAT(parse_error(craft(R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4)),
              HasSubstr("\"dtype\""));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "data_offsets": [0, 4]}})", 4)),
              HasSubstr("\"shape\""));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4)),
              HasSubstr("non-negative"));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4)),
              HasSubstr("non-negative"));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4)),
              HasSubstr("data_offsets"));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4)),
              HasSubstr("end before they begin"));
  EXPECT_THAT(parse_error(craft(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}})", 4)),
              HasSubstr("data_offsets"));
  EXPECT_THAT(parse_error(craft(R"({"__metadata__": {"a": 1}})", 0)),
              HasSubstr("__metadata__ value of \"a\""));
  EXPECT_THAT(parse_error(craft(R"({"__metadata__": [1]})", 0)), HasSubstr("__metadata__"));
}

TEST(SafetensorsCorruptionTest, UnsupportedAndUnknownDtypes) {
  for (const char* dtype : {"I64", "F64", "U8", "BOOL", "F8_E4M3", "Q4"}) {
    const std::string header = std::string(R"({"ids": {"dtype": ")") + dtype +
                               R"(", "shape": [1], "data_offsets": [0, 8]}})";
    const std::string message = parse_error(craft(header, 8));
    EXPECT_THAT(message, HasSubstr("'ids'"));
    EXPECT_THAT(message, HasSubstr(std::string("unsupported dtype \"") + dtype));
    EXPECT_THAT(message, HasSubstr("supported: F32, F16, BF16"));
  }
}

TEST(SafetensorsCorruptionTest, SizeMustMatchShape) {
  EXPECT_THAT(
      parse_error(craft(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10)),
      HasSubstr("'w': data_offsets [0,10] span 10 bytes, but shape [2,3] of BF16 needs 6 x 2"));
  EXPECT_THAT(parse_error(craft(
                  R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})",
                  0)),
              HasSubstr("overflows"));
}

TEST(SafetensorsCorruptionTest, OffsetsOutOfRangeOverlappingOrGapped) {
  // Truncated data: the tensor ends beyond the file.
  EXPECT_THAT(parse_error(craft(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12)),
              HasSubstr("'w': data ends at byte 16 but the file holds 12 bytes of data (truncated?)"));
  EXPECT_THAT(parse_error(craft(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                12)),
              HasSubstr("overlaps tensor 'a'"));
  EXPECT_THAT(parse_error(craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                     "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                                12)),
              HasSubstr("'b': data begins at byte 8, leaving a gap after byte 4"));
  EXPECT_THAT(parse_error(craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 9)),
              HasSubstr("5 bytes after the last tensor"));
  // Offsets past 2^63 are refused, not wrapped.
  EXPECT_THAT(parse_error(craft(
                  R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [18446744073709551615, 18446744073709551615]}})",
                  0)),
              HasSubstr("data_offsets"));
}

TEST(SafetensorsCorruptionTest, DuplicateNames) {
  EXPECT_THAT(parse_error(craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                     "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                8)),
              HasSubstr("repeats the key \"a\""));
  EXPECT_THAT(parse_error(craft(
                  R"({"a": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}})",
                  4)),
              HasSubstr("repeats the key \"dtype\""));
}

TEST(SafetensorsCorruptionTest, TruncatedFileOnDiskNamesFileAndTensor) {
  const std::filesystem::path dir = fresh_dir("deft_safetensors_truncated");
  const std::filesystem::path path = dir / "model.safetensors";
  ASSERT_TRUE(write_safetensors(path, sample_tensors()).ok());
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(path.string()));
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("truncated"));

  std::filesystem::resize_file(path, 3);
  EXPECT_THAT(std::string(SafetensorsFile::open(path).status().message()),
              HasSubstr("shorter than the 8-byte"));
  std::filesystem::resize_file(path, 0);
  EXPECT_FALSE(SafetensorsFile::open(path).ok());
  EXPECT_EQ(SafetensorsFile::open(dir / "absent.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(SafetensorsFile::open(dir).ok());  // a directory is not a file
  std::filesystem::remove_all(dir);
}

// --- Sets and shards -------------------------------------------------------------------------

struct ShardedCheckpoint {
  std::filesystem::path dir;
  std::map<std::string, std::string> weight_map;
};

ShardedCheckpoint write_sharded(const std::string& name) {
  ShardedCheckpoint checkpoint{fresh_dir(name), {}};
  const std::vector<OwnedTensor> first = {
      make_tensor("a", DType::kF32, {2}, iota_floats(2, 1.0f)),
      make_tensor("b", DType::kBF16, {3}, iota_floats(3, 2.0f))};
  const std::vector<OwnedTensor> second = {
      make_tensor("c", DType::kF16, {2, 2}, iota_floats(4, 0.5f))};
  EXPECT_TRUE(write_safetensors(checkpoint.dir / "model-00001-of-00002.safetensors", first).ok());
  EXPECT_TRUE(write_safetensors(checkpoint.dir / "model-00002-of-00002.safetensors", second).ok());
  checkpoint.weight_map = {{"a", "model-00001-of-00002.safetensors"},
                           {"b", "model-00001-of-00002.safetensors"},
                           {"c", "model-00002-of-00002.safetensors"}};
  EXPECT_TRUE(write_safetensors_index(checkpoint.dir / "model.safetensors.index.json",
                                      checkpoint.weight_map, 8 + 6 + 8)
                  .ok());
  return checkpoint;
}

TEST(SafetensorsSetTest, ShardedThroughIndex) {
  const ShardedCheckpoint checkpoint = write_sharded("deft_safetensors_sharded");
  for (const std::filesystem::path& path :
       {checkpoint.dir, checkpoint.dir / "model.safetensors.index.json"}) {
    absl::StatusOr<SafetensorsSet> set = SafetensorsSet::open(path);
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_THAT(set->names(), ElementsAre("a", "b", "c"));
    EXPECT_EQ(set->files().size(), 2u);
    absl::StatusOr<TensorView> c = set->tensor("c");
    ASSERT_TRUE(c.ok());
    EXPECT_THAT(std::string(c->file), HasSubstr("model-00002-of-00002.safetensors"));
    EXPECT_EQ(tensor_to_floats(*c), iota_floats(4, 0.5f));
    EXPECT_EQ(tensor_to_floats(*set->tensor("b")), iota_floats(3, 2.0f));
    EXPECT_EQ(set->tensor("zzz").status().code(), absl::StatusCode::kNotFound);
  }
  std::filesystem::remove_all(checkpoint.dir);
}

TEST(SafetensorsSetTest, SingleFileAndDirectoryResolution) {
  const std::filesystem::path dir = fresh_dir("deft_safetensors_single");
  EXPECT_EQ(SafetensorsSet::open(dir).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(write_safetensors(dir / "weights.safetensors", sample_tensors()).ok());
  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::open(dir);  // the only *.safetensors
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->size(), sample_tensors().size());
  ASSERT_TRUE(write_safetensors(dir / "other.safetensors", sample_tensors()).ok());
  EXPECT_FALSE(SafetensorsSet::open(dir).ok());  // two candidates, no index: ambiguous
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", sample_tensors()).ok());
  EXPECT_TRUE(SafetensorsSet::open(dir).ok());  // model.safetensors wins
  std::filesystem::remove_all(dir);
}

void write_index(const std::filesystem::path& dir, const std::string& text) {
  std::ofstream(dir / "model.safetensors.index.json", std::ios::trunc) << text;
}

TEST(SafetensorsSetTest, IndexInconsistencies) {
  const ShardedCheckpoint checkpoint = write_sharded("deft_safetensors_bad_index");
  const std::filesystem::path& dir = checkpoint.dir;
  auto open_error = [&] {
    absl::StatusOr<SafetensorsSet> set = SafetensorsSet::open(dir);
    EXPECT_FALSE(set.ok());
    return std::string(set.status().message());
  };
  write_index(dir, "{\"weight_map\": ");
  EXPECT_THAT(open_error(), HasSubstr("not a well-formed JSON object"));
  write_index(dir, "{\"metadata\": {}}");
  EXPECT_THAT(open_error(), HasSubstr("weight_map"));
  write_index(dir, R"({"weight_map": {"a": "../escape.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("'a' maps to \"../escape.safetensors\""));
  write_index(dir, R"({"weight_map": {"a": "/etc/passwd"}})");
  EXPECT_THAT(open_error(), HasSubstr("not a file name inside"));
  write_index(dir, R"({"weight_map": {"a": 7}})");
  EXPECT_THAT(open_error(), HasSubstr("'a' maps to 7"));
  write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00001-of-00002.safetensors",
                                       "c": "model-00003-of-00002.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("model-00003-of-00002.safetensors"));
  // A shard holds a tensor the map does not list.
  write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("holds tensor 'b', which the weight_map does not list"));
  // The map puts a tensor in the wrong shard.
  write_index(dir, R"({"weight_map": {"a": "model-00002-of-00002.safetensors",
                                       "b": "model-00001-of-00002.safetensors",
                                       "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("'a', which the weight_map puts in"));
  // The map lists a tensor its shard lacks.
  write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00001-of-00002.safetensors",
                                       "c": "model-00002-of-00002.safetensors",
                                       "d": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("tensor 'd'"));
  // A corrupt shard names itself and the tensor.
  std::filesystem::resize_file(dir / "model-00002-of-00002.safetensors",
                               std::filesystem::file_size(dir / "model-00002-of-00002.safetensors") - 1);
  write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00001-of-00002.safetensors",
                                       "c": "model-00002-of-00002.safetensors"}})");
  const std::string message = open_error();
  EXPECT_THAT(message, HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_THAT(message, HasSubstr("'c'"));
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsSetTest, TensorInTwoFilesIsRefused) {
  SafetensorsSet set;
  const std::vector<OwnedTensor> tensors = sample_tensors();
  absl::StatusOr<std::vector<std::byte>> bytes = serialize_safetensors(tensors);
  ASSERT_TRUE(bytes.ok());
  ASSERT_TRUE(set.add_file(*SafetensorsFile::from_bytes(*bytes, "one")).ok());
  const absl::Status status = set.add_file(*SafetensorsFile::from_bytes(*bytes, "two"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("is in both 'one' and 'two'"));
}

}  // namespace
}  // namespace deft::models
