// A structure-aware libFuzzer mutation for harnesses whose input is a JSON document (after a
// fixed number of prefix bytes): half of the mutations parse the document, replace one of its
// values, picked at random at any depth, by a value of another JSON type or an edge value (a
// number past int32 or int64, a huge or empty string, null, an empty list or object), or drop
// one of an object's keys, and write it back; the other half, and any input that does not parse,
// get libFuzzer's own byte mutations. Byte mutations alone rarely turn a field into another
// type, which is where a parser that assumes its input's types throws or wraps (a number for a
// string, 2^32 + 2 for a token id).
//
// A harness opts in by defining, beside LLVMFuzzerTestOneInput:
//   extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
//                                             unsigned int seed) {
//     return deft::fuzz::mutate_json(data, size, max_size, seed, /*prefix_bytes=*/0);
//   }
// The replay build (replay_main.cc) never calls it, and links without libFuzzer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_input.h"

namespace deft::fuzz {

namespace json_mutator_detail {

using json = nlohmann::json;

// Documents nest deeper than this only in inputs that test depth, which byte mutations reach.
constexpr int kMaxDepth = 32;

inline void collect(json& node, int depth, std::vector<json*>* nodes) {
  nodes->push_back(&node);
  if (depth >= kMaxDepth) return;
  if (node.is_object() || node.is_array()) {
    for (json& child : node) collect(child, depth + 1, nodes);
  }
}

inline json edge_value(std::mt19937& rng, const json& old) {
  switch (rng() % 14) {
    case 0:
      return nullptr;
    case 1:
      return rng() % 2 == 0;
    case 2:
      return 0;
    case 3:
      return -1;
    case 4:
      return std::numeric_limits<int32_t>::max() + int64_t{1};
    case 5:
      return (int64_t{1} << 32) + 2;
    case 6:
      return std::numeric_limits<int64_t>::min();
    case 7:
      return std::numeric_limits<uint64_t>::max();
    case 8:
      return rng() % 2 == 0 ? 0.5 : 1e300;
    case 9:
      return "";
    case 10:
      return std::string(1 + rng() % 4096, 'x');
    case 11:
      return json::array({old});
    case 12:
      return json::object({{"type", old}});
    default:
      return rng() % 2 == 0 ? json::array() : json::object();
  }
}

}  // namespace json_mutator_detail

// `ends_at_nul`: the document ends at the first NUL byte after the prefix (what follows is kept
// as it is), else at the end of the input.
inline size_t mutate_json(uint8_t* data, size_t size, size_t max_size, unsigned int seed,
                          size_t prefix_bytes, bool ends_at_nul = false) {
  using json_mutator_detail::json;
  std::mt19937 rng(seed);
  if (size > prefix_bytes && rng() % 2 == 0) {
    const uint8_t* end = data + size;
    if (ends_at_nul) {
      const void* nul = std::memchr(data + prefix_bytes, 0, size - prefix_bytes);
      if (nul != nullptr) end = static_cast<const uint8_t*>(nul);
    }
    const std::string tail(reinterpret_cast<const char*>(end),
                           static_cast<size_t>(data + size - end));
    const uint8_t* begin = data + prefix_bytes;
    json document = json::parse(begin, end, nullptr, /*allow_exceptions=*/false);
    if (!document.is_discarded()) {
      std::vector<json*> nodes;
      json_mutator_detail::collect(document, 0, &nodes);
      json& target = *nodes[rng() % nodes.size()];
      if (target.is_object() && !target.empty() && rng() % 4 == 0) {
        auto key = target.begin();
        std::advance(key, static_cast<std::ptrdiff_t>(rng() % target.size()));
        target.erase(key);
      } else {
        target = json_mutator_detail::edge_value(rng, target);
      }
      const std::string text = document.dump(-1, ' ', false, json::error_handler_t::replace) + tail;
      if (prefix_bytes + text.size() <= max_size) {
        std::memcpy(data + prefix_bytes, text.data(), text.size());
        return prefix_bytes + text.size();
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

}  // namespace deft::fuzz
