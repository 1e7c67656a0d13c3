// Random requests of every RPC against the real deft-server (embedded model, CPU backend): prompts
// of random ids (inside and outside the vocabulary) or random text (NUL, control and multi-byte
// characters),
// sampling parameters at and past their bounds (NaN, infinities, negatives, huge values), tree
// policies, drafted trees with bad parents or probabilities, and TreeSession commands on live,
// pruned and made-up nodes. Every call must end with OK or a client-error status (never
// INTERNAL, UNKNOWN or UNAVAILABLE), the server must stay SERVING, and once every stream and
// session has ended the KV pool must be back to its baseline. The seed is fixed
// (DEFT_REQUEST_FUZZ_SEED picks another).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/integration/server_process.h"
#include "tests/integration/tree_clients.h"
#include "tests/testing/client_error_codes.h"

namespace deft::testing {
namespace {

namespace v1 = deft::v1;

constexpr int kVocab = 512;  // the embedded default model
constexpr int kCalls = 300;
constexpr int kBadOneIn = 8;

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  template <typename T>
  T pick(const std::vector<T>& values) {
    return values[rng_() % values.size()];
  }
  bool coin(int one_in) { return rng_() % static_cast<uint64_t>(one_in) == 0; }
  // Mostly a value the server takes, one time in kBadOneIn one at or past a bound: a request
  // of several fields is then often whole and runs, and each field is often the bad one.
  template <typename T>
  T pick(const std::vector<T>& good, const std::vector<T>& bad) {
    return coin(kBadOneIn) ? pick(bad) : pick(good);
  }

  v1::Prompt prompt() {
    v1::Prompt prompt;
    if (coin(2)) {
      const int length = pick<int>({1, 3, 8, 40}, {0, 70});
      std::string text;
      for (int i = 0; i < length; ++i)
        text += coin(4) ? odd_character() : std::string(1, 'a' + rng_() % 26);
      prompt.set_text(text);
    } else {
      const int length = pick<int>({1, 2, 5, 16}, {0, 70});
      const bool bad_id = coin(kBadOneIn);
      for (int i = 0; i < length; ++i) {
        prompt.mutable_tokens()->add_ids(bad_id && coin(4) ? pick<int32_t>({-1, kVocab, 1 << 30})
                                                           : static_cast<int32_t>(rng_() % kVocab));
      }
    }
    return prompt;
  }

  // Valid UTF-8 only: protobuf refuses a string field of invalid UTF-8 before the server sees it
  // (gRPC answers INTERNAL: a protocol error of the client's library, not a request).
  std::string odd_character() {
    return pick<std::string>({std::string(1, '\0'), "\n", "\t", " ", "\xC3\xA9", "\xE2\x96\x81",
                              "\xF0\x9F\x98\x80", "\xEF\xBF\xBD", "\xCC\x81", "<s>", "</s>",
                              "\x7F"});
  }

  v1::SamplingParams sampling() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    v1::SamplingParams s;
    s.set_temperature(pick<float>({0.0f, 0.0f, 0.7f, 1.0f, 2.0f}, {-1.0f, nan, inf, 1e30f}));
    s.set_top_k(pick<int32_t>({0, 0, 1, 5}, {-3, std::numeric_limits<int32_t>::max()}));
    s.set_top_p(pick<float>({0.0f, 1.0f, 0.9f, 0.5f}, {1.5f, -0.1f, nan}));
    s.set_seed(rng_());
    s.set_top_logprobs(pick<int32_t>({0, 0, 1, 20}, {21, -1, 1000}));
    s.set_max_tokens(pick<int32_t>({0, 1, 3, 6}, {-1, 100000}));
    if (coin(4))
      s.add_stop(pick<std::string>({"a", "\xC3\xA9", "the"}, {"", std::string(300, 'x')}));
    if (coin(4)) s.add_stop_token_ids(pick<int32_t>({0, 2, 13}, {-1, kVocab, 999999}));
    s.set_ignore_eos(coin(2));
    return s;
  }

  v1::BranchPolicy policy() {
    v1::BranchPolicy p;
    p.set_branch_factor(pick<int32_t>({1, 2, 3}, {-1, 0, 100}));
    switch (rng_() % 4) {
      case 0:
        p.set_every_tokens(pick<int32_t>({1, 2, 5}, {-1, 0}));
        break;
      case 1:
        p.set_delimiter(pick<std::string>({".", "\n", "\xE2\x96\x81"}, {""}));
        break;
      case 2:
        p.set_step_end_token(pick<int32_t>({0, 13}, {-1, kVocab}));
        break;
      default:
        break;  // no trigger
    }
    p.set_max_depth(pick<int32_t>({1, 2, 3}, {-1, 0, 1000}));
    p.set_score(static_cast<v1::BranchPolicy::Score>(pick<int>({0, 1, 2}, {7})));
    p.set_keep_best(pick<int32_t>({0, 1, 2}, {-1}));
    return p;
  }

  int64_t node(const std::vector<int64_t>& known) {
    if (!known.empty() && !coin(4)) return known[rng_() % known.size()];
    return pick<int64_t>({-1, 0, 1, 1 << 20, std::numeric_limits<int64_t>::max()});
  }

  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

grpc::StatusCode generate(v1::Deft::Stub& stub, Fuzzer& f) {
  v1::GenerateRequest request;
  *request.mutable_prompt() = f.prompt();
  request.set_n(f.pick<int32_t>({0, 1, 2, 3}, {-1, 9, 100}));
  *request.mutable_sampling() = f.sampling();
  return run_generate(stub, request).status.error_code();
}

grpc::StatusCode run_tree_job(v1::Deft::Stub& stub, Fuzzer& f) {
  v1::RunTreeRequest request;
  *request.mutable_prompt() = f.prompt();
  *request.mutable_policy() = f.policy();
  *request.mutable_sampling() = f.sampling();
  return run_tree(stub, request).status.error_code();
}

grpc::StatusCode tokenize_or_detokenize(v1::Deft::Stub& stub, Fuzzer& f) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (f.coin(2)) {
    v1::TokenizeRequest request;
    const v1::Prompt prompt = f.prompt();
    request.set_text(prompt.text());
    request.set_add_bos(f.coin(2));
    v1::TokenizeResponse response;
    return stub.Tokenize(&context, request, &response).error_code();
  }
  v1::DetokenizeRequest request;
  const v1::Prompt prompt = f.prompt();  // kept while its ids are read
  for (int32_t id : prompt.tokens().ids()) request.add_ids(id);
  request.set_skip_special(f.coin(2));
  v1::DetokenizeResponse response;
  return stub.Detokenize(&context, request, &response).error_code();
}

// A session of random commands, with a Verify or two against its nodes; the codes of every
// refused command and RPC go to `codes`.
void session(v1::Deft::Stub& stub, Fuzzer& f, std::vector<int>& codes) {
  TestSession s(stub, std::chrono::seconds(60));
  std::vector<int64_t> nodes;
  const v1::SessionResponse created = s.create(std::vector<int32_t>{1, 5, 6, 7});
  if (created.has_created_node()) nodes.push_back(created.created_node());
  const int commands = 3 + static_cast<int>(f.rng()() % 6);
  for (int c = 0; c < commands && !s.stream_ended(); ++c) {
    v1::SessionResponse response;
    switch (f.rng()() % 6) {
      case 0: {
        v1::SessionRequest request;
        *request.mutable_create()->mutable_prompt() = f.prompt();
        const auto responses = s.call(request, /*expect_end=*/true);
        if (!responses.empty()) response = responses.back();
        if (response.has_created_node()) nodes.push_back(response.created_node());
        break;
      }
      case 1: {
        v1::SessionRequest request;
        request.mutable_extend()->set_node(f.node(nodes));
        *request.mutable_extend()->mutable_content() = f.prompt();
        const auto responses = s.call(request, /*expect_end=*/true);
        if (!responses.empty()) response = responses.back();
        break;
      }
      case 2: {
        response = s.branch(f.node(nodes), f.pick<int32_t>({-1, 0, 1, 2, 5, 1000}));
        if (response.has_branched()) {
          for (int64_t child : response.branched().children()) nodes.push_back(child);
        }
        break;
      }
      case 3: {
        std::vector<int64_t> targets;
        const int count = f.pick<int>({0, 1, 2, 3});
        for (int i = 0; i < count; ++i) targets.push_back(f.node(nodes));
        v1::SamplingParams sampling = f.sampling();
        if (sampling.max_tokens() > 8) sampling.set_max_tokens(8);
        const TestSession::Decoded decoded = s.decode(targets, sampling);
        if (decoded.error) codes.push_back(decoded.error->code());
        continue;
      }
      case 4:
        response = s.prune(f.node(nodes));
        break;
      default: {
        // prompt() makes a message: keep it while its ids are read.
        const v1::Prompt prompt = f.prompt();
        std::vector<int32_t> continuation(prompt.tokens().ids().begin(),
                                          prompt.tokens().ids().end());
        response = s.score(f.node(nodes), continuation);
        break;
      }
    }
    if (response.has_error()) codes.push_back(response.error().code());
  }
  // Verify under a session node (or a made-up one): a random drafted tree.
  for (int v = 0; v < 2; ++v) {
    v1::VerifyRequest request;
    request.set_session_id(f.coin(6) ? f.rng()() : s.session_id());
    request.set_node(f.node(nodes));
    const int entries = f.pick<int>({0, 1, 3, 8, 300});
    for (int i = 0; i < entries; ++i) {
      request.add_tokens(f.coin(10) ? -4 : static_cast<int32_t>(f.rng()() % kVocab));
      request.add_parents(f.coin(10) ? f.pick<int32_t>({-2, i, i + 5})
                                     : static_cast<int32_t>(f.rng()() % (i + 1)) - 1);
    }
    if (f.coin(3)) {
      for (int i = 0; i < entries + (f.coin(4) ? 1 : 0); ++i) {
        request.add_draft_probs(f.pick<float>({0.5f, 1.0f, 0.0f, -1.0f, 2.0f, NAN}));
      }
    } else if (f.coin(2) && entries > 0) {
      // Draft distributions: mostly each parent's children listed, sometimes anything.
      request.set_draft_sampling(f.pick<v1::DraftSampling>(
          {v1::DRAFT_SAMPLING_WITH_REPLACEMENT, v1::DRAFT_SAMPLING_WITHOUT_REPLACEMENT,
           v1::DRAFT_SAMPLING_UNSPECIFIED, static_cast<v1::DraftSampling>(9)}));
      for (int32_t node = -1; node < entries; ++node) {
        if (!f.coin(2)) continue;
        v1::DraftDistribution* distribution = request.add_draft_distributions();
        distribution->set_entry(f.coin(10) ? f.pick<int32_t>({-2, entries, node}) : node);
        for (int i = 0; i < entries; ++i) {
          if (request.parents(i) != node || f.coin(10)) continue;
          distribution->add_tokens(request.tokens(i));
          distribution->add_probs(f.pick<float>({0.1f, 0.02f, 1e-30f, 0.0f, 1.5f, NAN}));
        }
        if (f.coin(5)) distribution->add_tokens(static_cast<int32_t>(f.rng()() % (kVocab + 2)));
      }
    }
    v1::SamplingParams sampling = f.sampling();
    if (sampling.max_tokens() > 8) sampling.set_max_tokens(8);
    *request.mutable_sampling() = sampling;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::VerifyResponse response;
    codes.push_back(stub.Verify(&context, request, &response).error_code());
  }
  if (!s.stream_ended() && f.coin(2)) s.close();
  // Otherwise the stream is cancelled when `s` goes (an abandoned session frees its KV too).
}

TEST(RequestFuzz, RandomRequestsGetClientErrorsAndTheKvPoolComesBack) {
  ServerProcess server({"--kv-pages", "256", "--max-prompt-tokens", "64", "--max-tree-tokens",
                        "2048", "--max-branches", "8", "--max-verify-entries", "64",
                        "--default-max-tokens", "4"});
  ASSERT_TRUE(server.running());
  auto stub = server.stub();
  const double baseline = server.metrics()["deft_kv_pages_used"];
  // DEFT_REQUEST_FUZZ_SEED runs another sequence (a longer search than the suite's).
  const char* seed_env = std::getenv("DEFT_REQUEST_FUZZ_SEED");
  const uint64_t seed = seed_env != nullptr ? std::strtoull(seed_env, nullptr, 0) : 0xf022'0001ull;
  std::printf("[request fuzz] seed %llu\n", static_cast<unsigned long long>(seed));
  Fuzzer f(seed);
  std::map<std::string, std::map<int, int>> seen;  // rpc -> code -> count
  for (int call = 0; call < kCalls; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    std::vector<int> codes;
    std::string rpc;
    switch (f.rng()() % 5) {
      case 0:
        rpc = "Generate";
        codes.push_back(generate(*stub, f));
        break;
      case 1:
        rpc = "RunTree";
        codes.push_back(run_tree_job(*stub, f));
        break;
      case 2:
        rpc = "Tokenize/Detokenize";
        codes.push_back(tokenize_or_detokenize(*stub, f));
        break;
      default:
        rpc = "TreeSession/Verify";
        session(*stub, f, codes);
        break;
    }
    for (int code : codes) {
      ++seen[rpc][code];
      ASSERT_TRUE(client_error_or_ok(static_cast<grpc::StatusCode>(code)))
          << rpc << " answered code " << code << "\n"
          << server.log();
    }
    ASSERT_TRUE(server.serving()) << server.log();
  }
  for (const auto& [rpc, codes] : seen) {
    std::string line = rpc + ":";
    for (const auto& [code, count] : codes) {
      line += " code " + std::to_string(code) + " x" + std::to_string(count);
    }
    std::printf("[request fuzz] %s\n", line.c_str());
  }
  // Both outcomes for the RPCs that run the model.
  EXPECT_GT(seen["Generate"][0], 0);
  EXPECT_GT(seen["Generate"][static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)], 0);
  EXPECT_EQ(server.wait_metric("deft_kv_pages_used", baseline), baseline) << server.log();
  EXPECT_EQ(server.stop(SIGTERM), 0) << server.log();
}

}  // namespace
}  // namespace deft::testing
