#include "models/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::models {

absl::Status check_tensor_parallel(const ModelConfig& config, int32_t ranks) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel: ", ranks, " ranks; it must be at least 1"));
  }
  const auto refuse = [&](int32_t count, const char* what, const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel: the model's ", count, " ", what, " do not split over ",
                     ranks, " ranks (", why, "); use a rank count that divides ", count));
  };
  if (config.num_key_value_heads % ranks != 0) {
    return refuse(config.num_key_value_heads, "KV heads",
                  "each rank holds whole KV heads and their GQA groups");
  }
  if (config.num_attention_heads % ranks != 0) {
    return refuse(config.num_attention_heads, "query heads", "each rank holds whole heads");
  }
  if (config.intermediate_size % ranks != 0) {
    return refuse(config.intermediate_size, "MLP columns (intermediate_size)",
                  "gate/up and down split evenly");
  }
  return absl::OkStatus();
}

ModelConfig shard_config(const ModelConfig& config, int32_t ranks) {
  DEFT_CHECK(check_tensor_parallel(config, ranks).ok(), "shard_config: %d ranks do not divide",
             ranks);
  ModelConfig shard = config;
  shard.num_attention_heads /= ranks;
  shard.num_key_value_heads /= ranks;
  shard.intermediate_size /= ranks;
  return shard;
}

VocabShard vocab_shard(int32_t vocab_size, TensorParallelRank rank) {
  DEFT_CHECK(rank.ranks >= 1 && rank.rank >= 0 && rank.rank < rank.ranks,
             "vocab_shard: rank %d of %d", rank.rank, rank.ranks);
  const int32_t rows = (vocab_size + rank.ranks - 1) / rank.ranks;
  const int32_t begin = std::min(vocab_size, rank.rank * rows);
  return {.begin = begin, .count = std::min(vocab_size, begin + rows) - begin, .rows = rows};
}

ShardRange even_shard(int64_t extent, TensorParallelRank rank) {
  DEFT_CHECK(rank.ranks >= 1 && extent % rank.ranks == 0, "even_shard: %lld over %d ranks",
             static_cast<long long>(extent), rank.ranks);
  const int64_t count = extent / rank.ranks;
  return {.begin = rank.rank * count, .count = count};
}

TensorShard::TensorShard(const TensorView& tensor, ShardAxis axis, int64_t begin, int64_t count,
                         int64_t padded)
    : shape_(tensor.shape.begin(), tensor.shape.end()) {
  const int dim = axis == ShardAxis::kRows ? 0 : 1;
  DEFT_CHECK(static_cast<int>(shape_.size()) > dim && begin >= 0 && count >= 0 &&
                 begin + count <= shape_[dim] && padded >= count,
             "TensorShard %.*s: [%lld, +%lld) padded to %lld along dim %d",
             static_cast<int>(tensor.name.size()), tensor.name.data(),
             static_cast<long long>(begin), static_cast<long long>(count),
             static_cast<long long>(padded), dim);
  const size_t element = dtype_bytes(tensor.dtype);
  // Elements of one dim-0 row, and of one slice of it along dim 1 (vectors: one element).
  const int64_t row_elements = shape_.size() > 1 ? tensor.numel() / shape_[0] : 1;
  view_ = tensor;
  shape_[dim] = padded;
  if (axis == ShardAxis::kRows) {
    const std::byte* first = tensor.data + static_cast<size_t>(begin * row_elements) * element;
    const size_t bytes = static_cast<size_t>(count * row_elements) * element;
    if (padded == count) {
      view_.data = first;  // contiguous rows: no copy
    } else {
      owned_.assign(static_cast<size_t>(padded * row_elements) * element, std::byte{0});
      if (bytes > 0) std::memcpy(owned_.data(), first, bytes);
      view_.data = owned_.data();
    }
  } else {
    // Columns of every row: [rows][padded], each row's slice copied, the padding zero.
    const int64_t rows = shape_[0];
    const int64_t columns = tensor.shape[1];
    const int64_t inner = row_elements / columns;  // elements per column (1 for a matrix)
    owned_.assign(static_cast<size_t>(rows * padded * inner) * element, std::byte{0});
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(owned_.data() + static_cast<size_t>(r * padded * inner) * element,
                  tensor.data + static_cast<size_t>((r * columns + begin) * inner) * element,
                  static_cast<size_t>(count * inner) * element);
    }
    view_.data = owned_.data();
  }
  view_.shape = shape_;
  int64_t numel = 1;
  for (int64_t extent : shape_) numel *= extent;
  view_.bytes = static_cast<size_t>(numel) * element;
}

}  // namespace deft::models
