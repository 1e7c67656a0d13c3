// One benchmark job as the client sees it: what it is given (JobEnv), what it records
// (JobRecord), and the kinds' entry points (generate_job.cc, runtree_job.cc,
// session_job.cc, spec_job.cc). A job runs on the calling thread with the synchronous gRPC API,
// timestamps every token message it reads, and checks that each stream produced exactly the
// tokens it asked for.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench/serve_bench/job_mix.h"
#include "bench/serve_bench/serve_options.h"
#include "bench/serve_bench/workload_shapes.h"
#include "deft/v1/deft.grpc.pb.h"

namespace deft::bench::serve {

namespace v1 = deft::v1;
using Clock = std::chrono::steady_clock;

// JobRecord::failure codes of the client's own checks (the others are google.rpc.Code names).
inline constexpr char kTokenCount[] = "TOKEN_COUNT";
inline constexpr char kProtocol[] = "PROTOCOL";

// What one job did.
struct JobRecord {
  JobKind kind = JobKind::kFewShot;
  Clock::time_point start;  // closed loop: sent; open loop: its scheduled arrival
  Clock::time_point end;
  double ttft_s = -1;           // start -> the job's first generated token; < 0: none came
  std::vector<double> itl_s;    // inter-token gaps (see TokenTimer)
  int64_t tokens = 0;           // generated tokens received
  int64_t expected_tokens = 0;  // what it asked for (spec: the least its steps must commit)
  // Empty: the job finished with every stream's expected tokens. Otherwise a google.rpc.Code
  // name of a failed RPC or refused session command ("RESOURCE_EXHAUSTED"), or TOKEN_COUNT
  // (a stream ended with other than the tokens asked for), or PROTOCOL (an answer that does not
  // fit the request); failure_message says what.
  std::string failure;
  std::string failure_message;

  bool ok() const { return failure.empty(); }
  double latency_s() const { return std::chrono::duration<double>(end - start).count(); }
  void fail(std::string code, std::string message) {
    if (!ok()) return;  // keep the first failure
    failure = std::move(code);
    failure_message = std::move(message);
  }
  void fail(const grpc::Status& status);
};

// Timestamps a job's token messages. A stream is what one sequence of tokens arrives on: a
// Generate branch, a RunTree node, a session node during one decode command, a speculative
// session's verify answers. The job's first token sets ttft_s; every later message of the same
// stream adds its gap to the stream's previous message, as `count` samples of gap / count (a
// message of k tokens stands for k tokens generated over that gap).
class TokenTimer {
 public:
  // `received_tokens` counts every token of every job (the level's throughput window reads it).
  TokenTimer(JobRecord* record, std::atomic<int64_t>* received_tokens)
      : record_(record), received_tokens_(received_tokens) {}
  void add(int64_t stream, int count);
  // The next message of every stream starts afresh (no gap across session commands).
  void restart_streams() { last_.clear(); }

 private:
  JobRecord* record_;
  std::atomic<int64_t>* received_tokens_;
  std::unordered_map<int64_t, Clock::time_point> last_;
};

// The model as ModelInfo describes it; prompts and drafts are random ids of its vocabulary.
struct ModelFacts {
  int32_t vocab_size = 0;
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
  int32_t max_context = 0;
};

// Shared by every job of a level; read-only while it runs (but for the token counter).
struct JobEnv {
  const ServeOptions* options = nullptr;
  const WorkloadShapes* shapes = nullptr;
  ModelFacts model;
  std::atomic<int64_t>* received_tokens = nullptr;
};

// `job_index` numbers the job within its level; it seeds the job's prompt and picks its trace
// record, so every plan sees the same jobs.
JobRecord run_job(JobKind kind, v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                  Clock::time_point start);

// The kinds (one file each). fewshot and stream are both Generate jobs, of `n` samples of
// `tokens` tokens from a random `prompt_tokens`-token prompt.
// stop_min > 0 (n = 1 only): read U[stop_min, tokens] tokens, then cancel the call.
void run_generate_job(v1::Deft::Stub& stub, const JobEnv& env, int32_t prompt_tokens, int32_t n,
                      int32_t tokens, std::mt19937_64& rng, JobRecord* record,
                      int32_t stop_min = 0);
void run_runtree_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                     std::mt19937_64& rng, JobRecord* record);
void run_session_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index,
                     std::mt19937_64& rng, JobRecord* record);
void run_spec_job(v1::Deft::Stub& stub, const JobEnv& env, uint64_t job_index, std::mt19937_64& rng,
                  JobRecord* record);

// Helpers of the kinds.
// `tokens` random ids of the vocabulary (BOS first when the model has one; no EOS or BOS
// elsewhere, so a prompt reads like text to the server).
std::vector<int32_t> random_prompt(const ModelFacts& model, int32_t tokens, std::mt19937_64& rng);
int32_t random_token(const ModelFacts& model, std::mt19937_64& rng);
// A deadline of --job-timeout from now on `context`.
void set_job_deadline(const JobEnv& env, grpc::ClientContext* context);

}  // namespace deft::bench::serve
