// The kinds of job serve_bench sends and the weighted mix a load level draws them from.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::bench::serve {

enum class JobKind : uint8_t {
  kFewShot,  // Generate: n samples of one long prompt
  kRunTree,  // RunTree: a server-side tree-of-thought search shaped like a reasoning trace
  kSession,  // TreeSession: the client drives a reasoning trace's tree (branch, decode, prune)
  kSpec,     // TreeSession + verify: speculative decoding with a recorded Medusa token tree
  kStream,   // Generate: one sample of a short prompt (a chat-like stream)
  kRepeat,   // fewshot's shape, every job the same prompt (what a prefix cache serves)
};
inline constexpr JobKind kJobKinds[] = {JobKind::kFewShot, JobKind::kRunTree, JobKind::kSession,
                                        JobKind::kSpec,    JobKind::kStream,  JobKind::kRepeat};

// "fewshot", "runtree", "session", "spec", "stream", "repeat".
const char* job_kind_name(JobKind kind);
std::optional<JobKind> parse_job_kind(const std::string& name);

// Job kinds with relative weights. Job i's kind is a function of (seed, i), evenly interleaved
// (see pick), so every plan sees the same sequence of kinds.
struct JobMix {
  struct Entry {
    JobKind kind;
    double weight = 1;
  };
  std::vector<Entry> entries;

  // "fewshot", "fewshot+spec", "fewshot:3+spec" (weights other than 1 shown).
  std::string name() const;
  JobKind pick(uint64_t seed, uint64_t job_index) const;
};

// "KIND[:WEIGHT],KIND..." -> one mix; INVALID_ARGUMENT naming an unknown kind or bad weight.
absl::StatusOr<JobMix> parse_job_mix(const std::string& text);

}  // namespace deft::bench::serve
