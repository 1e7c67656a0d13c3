// The DeFT paper's workloads (../shared/workloads/README.md) replayed through the engine: one
// engine::Scheduler over any engine::ModelRunner, step by step, the way the server runs them
// (admission, the step's rows, one plan, one forward pass, device sampling where the runner
// has it). CPU-compilable: bench/workload_replay/workload_replay.cu runs it on the CUDA runner,
// workload_replay_test.cc on the embedded default model.
//
// How each family is driven, and why:
// - Few-shot: a GenerateWork, the server's Generate (n branches of one prompt, greedy, EOS
//   ignored): the workload is exactly a Generate job.
// - Reasoning: ReasoningReplayWork (here). The trace's siblings have different lengths and the
//   next level starts while the pruned siblings still decode (up to 19 live queries from two
//   levels in sorting128ToT), so neither a session (one command at a time, one max_tokens per
//   decode) nor a session per node (they share prefixes only through prompt placement) follows
//   it step by step. A work of our own on the scheduler's Forest does, exactly: every iteration
//   its nodes start, each live node decodes one token (its row sampled greedily on the device),
//   and a childless node is released (its KV freed) after its last token.
// - Speculative decoding: SpecDecReplayWork (here). Each step hangs the Medusa tree under the
//   session node as engine/works/verify_work.cc does (the root token appended to the node, the
//   entries as child nodes, a chain of only children in one node), every row sampled greedily
//   on the device (what a greedy verifier compares: one argmax per row), and then commits the
//   trace's accept length A: the root and the first A - 1 entries of the top-ranked path, the
//   bonus token being the argmax after them. Acceptance is forced (a bench-only choice: random
//   weights accept nothing); the accepted entries are appended to the session node, standing
//   for the KV copy a verifier makes (the copy itself is not run), so the session's context
//   stays one node as in the paper. VerifyWork instead keeps the accepted path as a chain of
//   one-token nodes (a page each) and downloads every drafted row's full logits.
//
// Sampling (`stride` > 1, reasoning and speculative only): iteration 1 + k * stride runs
// through the engine; the iterations between are fast-forwarded (the same tree edits, their
// tokens appended without a forward pass: their KV slots keep what the pool holds, zeros or
// an earlier token's KV; they count in ReplayResult::generated_tokens as a run step's do),
// and each run step stands for the iterations up to the next.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/model_runner.h"
#include "engine/tokenizer/tokenizer.h"

namespace deft::bench {

// n branches of one prompt, each decoding one token per iteration (README: 4000, {20, 30, 50},
// 400).
struct FewShotWorkload {
  int32_t prompt_tokens = 4000;
  int32_t branches = 20;
  int32_t iterations = 400;
};

// One tree-of-thought record; node 0 is the prompt.
struct ReasoningWorkload {
  ReasoningTrace trace;
  int32_t prompt_tokens = 0;  // 0: the trace's (node 0's length); tests shorten it
};

// A Medusa token tree verified step by step under one growing session node.
struct SpecDecWorkload {
  std::vector<int32_t> parents;         // entry 0 is the root (-1); parents[i] < i
  std::vector<int32_t> accept_lengths;  // committed tokens per step (>= 1), cycled
  std::vector<engine::TokenId> prompt;  // prefilled first
  int64_t generate_tokens = 0;          // the replay stops once this many are committed
};

using Workload = std::variant<FewShotWorkload, ReasoningWorkload, SpecDecWorkload>;

struct ReplayOptions {
  engine::PlannerOptions planner;  // the method (plan kind); the wave comes from the runner
  int32_t page_tokens = 16;
  int32_t kv_pages = 4096;         // the runner must hold kv_pages * page_tokens slots
  int32_t max_step_tokens = 2048;  // prompts prefill in chunks of this many rows
  int64_t max_iterations = 0;      // 0: the whole workload
  int32_t stride = 1;              // reasoning and speculative; few-shot always runs every one
  uint64_t seed = 1;               // prompt and draft token ids
};

// One engine step of the replay.
struct StepRecord {
  int64_t iteration = -1;  // the workload iteration (1-based) of a decode step; -1: prefill
  int32_t weight = 0;      // iterations the step stands for (stride sampling); 0: prefill
  int64_t rows = 0;
  double wall_seconds = 0;  // Scheduler::prepare + step, fast-forwarded tree edits excluded
  double plan_seconds = 0;
  double forward_seconds = 0;
  double attention_seconds = -1;  // the scheduler times attention on every 16th step
  int64_t tree_kv_tokens = 0;     // distinct tokens the step's queries see (decode steps)
  int64_t query_path_tokens = 0;  // sum over its queries of the tokens each sees
  int64_t kv_tokens_read = 0;     // the plan's, per KV head and layer
};

// The tree the workload had at one iteration (run or fast-forwarded).
struct IterationShape {
  int32_t queries = 0;
  int64_t tree_tokens = 0;  // after the iteration's tokens were appended
};

struct ReplayResult {
  absl::Status status;                     // a failed step, an aborted work, a stuck replay
  std::vector<StepRecord> steps;           // prefill steps, then decode steps
  std::vector<IterationShape> iterations;  // every iteration of the workload
  int64_t prompt_tokens = 0;
  // Sampled by decode rows (few-shot, reasoning) or committed (speculative), the iterations
  // fast-forwarded by stride sampling included (a token per live node, or the accept length).
  int64_t generated_tokens = 0;
  int64_t kv_pages_left = -1;  // used pages once the work ended (0: all KV was freed)
};

using StepObserver = std::function<void(const StepRecord&)>;

// Runs one workload on a fresh Scheduler (its own KV pool bookkeeping over the runner's slots)
// until its work ends; `on_step` sees every step as it completes.
ReplayResult replay_workload(engine::ModelRunner& runner, const engine::Tokenizer& tokenizer,
                             const Workload& workload, const ReplayOptions& options,
                             const StepObserver& on_step = {});

// Iterations the workload has (before options.max_iterations): few-shot's, the trace's last
// iteration, or the verify steps needed to commit generate_tokens.
int64_t workload_iterations(const Workload& workload);

// The prompt text of record `record` of a speculative-decoding trace file.
absl::StatusOr<std::string> load_specdec_prompt(const std::string& path, int32_t record = 0);

// Tokens of the first APPS record's prompt (every apps_tree_size*.json has the same first
// record) as Llama 3's tokenizer encodes it, BOS included: the length a replay without that
// tokenizer at hand gives its prompt.
inline constexpr int32_t kAppsPromptLlama3Tokens = 1016;

// True for Llama 3's tokenizer (the paper's model's): <|begin_of_text|> and 128256 ids.
bool is_llama3_tokenizer(const engine::Tokenizer& tokenizer);

// The speculative workloads' prompt: `text` encoded with BOS when `tokenizer` is Llama 3's, else
// kAppsPromptLlama3Tokens ids drawn at random below `vocab`.
std::vector<engine::TokenId> specdec_prompt_tokens(const std::string& text,
                                                   const engine::Tokenizer& tokenizer,
                                                   int32_t vocab, uint64_t seed);

}  // namespace deft::bench
