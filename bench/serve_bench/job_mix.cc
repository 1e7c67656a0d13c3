#include "bench/serve_bench/job_mix.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace deft::bench::serve {
namespace {

// splitmix64's finaliser: a well-mixed 64-bit hash of the seed.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

const char* job_kind_name(JobKind kind) {
  switch (kind) {
    case JobKind::kFewShot:
      return "fewshot";
    case JobKind::kRunTree:
      return "runtree";
    case JobKind::kSession:
      return "session";
    case JobKind::kSpec:
      return "spec";
    case JobKind::kStream:
      return "stream";
    case JobKind::kRepeat:
      return "repeat";
  }
  return "?";
}

std::optional<JobKind> parse_job_kind(const std::string& name) {
  for (JobKind kind : kJobKinds) {
    if (name == job_kind_name(kind)) return kind;
  }
  return std::nullopt;
}

std::string JobMix::name() const {
  std::string text;
  for (const Entry& entry : entries) {
    absl::StrAppend(&text, text.empty() ? "" : "+", job_kind_name(entry.kind));
    if (entry.weight != 1) absl::StrAppend(&text, ":", entry.weight);
  }
  return text;
}

JobKind JobMix::pick(uint64_t seed, uint64_t job_index) const {
  double total = 0;
  for (const Entry& entry : entries) total += entry.weight;
  // The Weyl sequence frac(i * golden ratio) in 64-bit fixed point, offset by the seed: any
  // run of consecutive indices spreads evenly over [0, 1), so every run of jobs holds each
  // kind in about its share (any 5 consecutive jobs of 4 equal kinds hold every kind).
  const uint64_t weyl = job_index * 0x9e3779b97f4a7c15ULL + mix64(seed);
  const double uniform = static_cast<double>(weyl >> 11) * 0x1.0p-53;
  double at = uniform * total;
  for (const Entry& entry : entries) {
    if (at < entry.weight) return entry.kind;
    at -= entry.weight;
  }
  return entries.back().kind;
}

absl::StatusOr<JobMix> parse_job_mix(const std::string& text) {
  JobMix mix;
  for (const std::string& part :
       std::vector<std::string>(absl::StrSplit(text, ',', absl::SkipWhitespace()))) {
    const std::vector<std::string> kind_weight = absl::StrSplit(part, ':');
    const std::optional<JobKind> kind = parse_job_kind(kind_weight[0]);
    if (!kind) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix: unknown job kind '", kind_weight[0],
                       "' (fewshot, runtree, session, spec, stream, repeat)"));
    }
    double weight = 1;
    if (kind_weight.size() > 2 ||
        (kind_weight.size() == 2 && (!absl::SimpleAtod(kind_weight[1], &weight) || weight <= 0))) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix: bad weight in '", part, "' (KIND:WEIGHT, WEIGHT > 0)"));
    }
    for (const JobMix::Entry& entry : mix.entries) {
      if (entry.kind == *kind) {
        return absl::InvalidArgumentError(
            absl::StrCat("--mix: '", kind_weight[0], "' twice in '", text, "'"));
      }
    }
    mix.entries.push_back({*kind, weight});
  }
  if (mix.entries.empty()) return absl::InvalidArgumentError("--mix: an empty mix");
  return mix;
}

}  // namespace deft::bench::serve
