// Server-side speculative decoding through the engine Scheduler (CPU backend): the target is the
// embedded default model; drafts are the same model (every draft right: long accepted paths), a
// random-weight model of the same vocabulary (drafts mostly wrong: rejections everywhere) and
// prompt lookup (no draft model). Whatever the draft, a speculative Generate must give exactly
// the tokens plain decoding gives, greedy and sampled (same seed), under concurrency, chunked
// prefill and preemption; its sampled tokens must follow the target's distribution (a χ² test
// against probabilities computed from the model's logits); and no KV may stay referenced in
// either forest once the jobs end or are cancelled mid-speculation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/scheduler.h"
#include "engine/works/generate_work.h"
#include "engine/works/session.h"
#include "models/llama_cpu.h"
#include "tests/models/tiny_llama.h"

namespace deft::engine {
namespace {

constexpr int32_t kPageTokens = 8;
constexpr int32_t kPages = 2048;

struct BranchResult {
  std::vector<TokenId> tokens;
  SpeculationStats speculation;
};
using JobResult = std::vector<BranchResult>;

SpeculativeOptions spec(TreePolicy policy, int32_t tree_tokens = 24, int32_t depth = 5,
                        int32_t top_k = 4) {
  return {.policy = policy, .tree_tokens = tree_tokens, .depth = depth, .top_k = top_k};
}

class SpeculativeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
        load_tokenizer(DEFT_SOURCE_DIR "/models/default");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer).release();
    target_ = load_default().release();
    self_draft_ = load_default().release();
    // A random model of the same vocabulary: its drafts are mostly rejected.
    const models::testing::TinyLlama random = models::testing::make_tiny_llama({.hidden = 32,
                                                                                .heads = 2,
                                                                                .kv_heads = 1,
                                                                                .head_dim = 16,
                                                                                .intermediate = 64,
                                                                                .layers = 1,
                                                                                .vocab = 512,
                                                                                .seed = 7});
    absl::StatusOr<std::unique_ptr<models::LlamaCpuRunner>> runner = models::LlamaCpuRunner::create(
        random.config, random.checkpoint, int64_t{kPages} * kPageTokens, "random-draft");
    ASSERT_TRUE(runner.ok()) << runner.status();
    random_draft_ = std::move(*runner).release();
  }

  static std::unique_ptr<models::LlamaCpuRunner> load_default() {
    absl::StatusOr<std::unique_ptr<models::LlamaCpuRunner>> runner = models::LlamaCpuRunner::load(
        DEFT_SOURCE_DIR "/models/default", int64_t{kPages} * kPageTokens);
    EXPECT_TRUE(runner.ok()) << runner.status();
    return std::move(*runner);
  }

  static std::unique_ptr<Scheduler> make_scheduler(ModelRunner* draft,
                                                   int32_t max_step_tokens = 512,
                                                   int32_t kv_pages = kPages,
                                                   int32_t speculative_max_batch = 0) {
    SchedulerOptions options{.page_tokens = kPageTokens,
                             .kv_pages = kv_pages,
                             .max_queued_works = 4096,
                             .max_step_tokens = max_step_tokens,
                             .speculative_max_batch = speculative_max_batch};
    return std::make_unique<Scheduler>(options, *target_, *tokenizer_, draft);
  }

  static std::vector<TokenId> encode(const std::string& text) {
    return *tokenizer_->encode(text, /*add_bos=*/true, /*parse_special=*/false);
  }

  struct Job {
    std::vector<TokenId> prompt;
    int32_t n = 1;
    int32_t max_tokens = 32;
    SamplingParams sampling{.temperature = 0.0f};
    std::optional<SpeculativeOptions> speculative;
  };

  static std::shared_ptr<GenerateEvents> submit(Scheduler& scheduler, const Job& job) {
    auto events = std::make_shared<GenerateEvents>();
    GenerateJob generate{
        .prompt = job.prompt, .n = job.n, .max_tokens = job.max_tokens, .sampling = job.sampling};
    if (job.speculative) {
      generate.speculative = std::make_shared<const SpeculativeOptions>(*job.speculative);
    }
    const absl::Status status = scheduler.submit(
        std::make_unique<GenerateWork>(std::move(generate), events, *tokenizer_, kPageTokens));
    EXPECT_TRUE(status.ok()) << status;
    return events;
  }

  static void run_until(Scheduler& scheduler, const std::function<bool()>& done,
                        const std::function<void()>& after_step = {}) {
    for (int i = 0; i < 20000 && !done(); ++i) {
      scheduler.prepare();
      (void)scheduler.step();
      if (after_step) after_step();
    }
    ASSERT_TRUE(done()) << "the scheduler did not finish";
  }

  static JobResult collect(GenerateEvents& events, int32_t n) {
    JobResult out(static_cast<size_t>(n));
    std::vector<GenerateEvent> batch;
    while (events.next(batch, std::chrono::milliseconds(0))) {
      for (const GenerateEvent& event : batch) {
        BranchResult& branch = out[static_cast<size_t>(event.branch)];
        branch.tokens.insert(branch.tokens.end(), event.delta.ids.begin(), event.delta.ids.end());
        if (event.delta.finish != FinishReason::kNone) branch.speculation = event.speculation;
      }
      batch.clear();
    }
    EXPECT_TRUE(events.final_status().ok()) << events.final_status();
    return out;
  }

  // Runs every job at once on `scheduler` and returns their branches.
  static std::vector<JobResult> run_jobs(Scheduler& scheduler, const std::vector<Job>& jobs) {
    std::vector<std::shared_ptr<GenerateEvents>> events;
    for (const Job& job : jobs) events.push_back(submit(scheduler, job));
    run_until(
        scheduler,
        [&] {
          for (const auto& e : events) {
            if (!e->finished()) return false;
          }
          return true;
        },
        [&] { check_forests(scheduler); });
    std::vector<JobResult> out;
    for (size_t i = 0; i < jobs.size(); ++i) out.push_back(collect(*events[i], jobs[i].n));
    return out;
  }

  static void check_forests(const Scheduler& scheduler) {
    const absl::Status target = scheduler.forest().check_invariants();
    ASSERT_TRUE(target.ok()) << target;
    if (scheduler.draft() != nullptr) {
      const absl::Status draft = scheduler.draft()->forest().check_invariants();
      ASSERT_TRUE(draft.ok()) << draft;
    }
  }

  // Nothing referenced in either forest: every drafted node was discarded, every branch
  // released.
  static void expect_no_referenced_kv(const Scheduler& scheduler) {
    EXPECT_EQ(scheduler.forest().referenced_pages(), 0);
    EXPECT_EQ(scheduler.kv().used_pages(), scheduler.forest().cached_pages());
    if (scheduler.draft() != nullptr) {
      EXPECT_EQ(scheduler.draft()->forest().referenced_pages(), 0);
      EXPECT_EQ(scheduler.draft()->kv().used_pages(), scheduler.draft()->forest().cached_pages());
    }
    check_forests(scheduler);
  }

  // The same jobs without speculation, each alone.
  static std::vector<JobResult> plain(std::vector<Job> jobs) {
    std::vector<JobResult> out;
    for (Job& job : jobs) {
      job.speculative.reset();
      std::unique_ptr<Scheduler> scheduler = make_scheduler(nullptr);
      out.push_back(run_jobs(*scheduler, {job})[0]);
    }
    return out;
  }

  static void expect_same_tokens(const std::vector<JobResult>& got,
                                 const std::vector<JobResult>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t j = 0; j < got.size(); ++j) {
      ASSERT_EQ(got[j].size(), want[j].size());
      for (size_t b = 0; b < got[j].size(); ++b) {
        EXPECT_EQ(got[j][b].tokens, want[j][b].tokens) << "job " << j << " branch " << b;
      }
    }
  }

  static SpeculationStats total(const std::vector<JobResult>& results) {
    SpeculationStats sum;
    for (const JobResult& job : results) {
      for (const BranchResult& branch : job) {
        sum.steps += branch.speculation.steps;
        sum.drafted += branch.speculation.drafted;
        sum.accepted += branch.speculation.accepted;
      }
    }
    return sum;
  }

  static std::vector<Job> mixed_jobs(const SpeculativeOptions& options, SamplingParams sampling) {
    const std::vector<std::string> texts = {
        "Once upon a time", "The little fox",   "In the forest there was a", "The king said",
        "A mathematician",  "Under the bridge", "Every morning the",         "The old man"};
    std::vector<Job> jobs;
    for (size_t i = 0; i < texts.size(); ++i) {
      SamplingParams params = sampling;
      params.seed = sampling.seed + i;
      jobs.push_back({.prompt = encode(texts[i]),
                      .n = 1 + static_cast<int32_t>(i % 3),
                      .max_tokens = 1 + static_cast<int32_t>(7 * i) % 40,
                      .sampling = params,
                      .speculative = options});
    }
    return jobs;
  }

  static inline Tokenizer* tokenizer_ = nullptr;
  static inline models::LlamaCpuRunner* target_ = nullptr;
  static inline models::LlamaCpuRunner* self_draft_ = nullptr;
  static inline models::LlamaCpuRunner* random_draft_ = nullptr;
};

struct Case {
  const char* name;
  TreePolicy policy;
  int draft;  // 0: none, 1: the target itself, 2: a random model
};

class SpeculativeEquality : public SpeculativeTest, public ::testing::WithParamInterface<Case> {
 protected:
  ModelRunner* draft_runner() const {
    switch (GetParam().draft) {
      case 1:
        return self_draft_;
      case 2:
        return random_draft_;
      default:
        return nullptr;
    }
  }
};

TEST_P(SpeculativeEquality, GreedyConcurrentJobsGiveThePlainTokens) {
  const std::vector<Job> jobs = mixed_jobs(spec(GetParam().policy), {.temperature = 0.0f});
  std::unique_ptr<Scheduler> scheduler = make_scheduler(draft_runner());
  const std::vector<JobResult> got = run_jobs(*scheduler, jobs);
  expect_same_tokens(got, plain(jobs));
  expect_no_referenced_kv(*scheduler);
  const SpeculationStats stats = total(got);
  EXPECT_GT(stats.steps, 0);
  if (GetParam().draft == 1) {
    // The target drafting for itself: every greedy step accepts a whole path of the tree
    // (the length limit cuts the last ones short).
    EXPECT_GT(static_cast<double>(stats.accepted) / static_cast<double>(stats.steps), 2.5);
  }
}

TEST_P(SpeculativeEquality, SampledJobsGiveThePlainTokensOfTheirSeeds) {
  const std::vector<Job> jobs = mixed_jobs(
      spec(GetParam().policy), {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 11});
  std::unique_ptr<Scheduler> scheduler = make_scheduler(draft_runner());
  const std::vector<JobResult> got = run_jobs(*scheduler, jobs);
  expect_same_tokens(got, plain(jobs));
  expect_no_referenced_kv(*scheduler);
}

TEST_P(SpeculativeEquality, ChunkedPrefillAndASmallStepBudgetGiveThePlainTokens) {
  // 24 rows a step: prompts arrive in chunks (in the draft too) and trees are cut to what the
  // step leaves.
  std::vector<Job> jobs = mixed_jobs(spec(GetParam().policy), {.temperature = 0.0f});
  jobs[0].prompt = encode(
      "Once upon a time there was a tree that grew beside a river, and every morning the little "
      "fox came to drink");
  std::unique_ptr<Scheduler> scheduler = make_scheduler(draft_runner(), /*max_step_tokens=*/24);
  expect_same_tokens(run_jobs(*scheduler, jobs), plain(jobs));
  expect_no_referenced_kv(*scheduler);
}

INSTANTIATE_TEST_SUITE_P(Policies, SpeculativeEquality,
                         ::testing::Values(Case{"StaticSelfDraft", TreePolicy::kStatic, 1},
                                           Case{"StaticRandomDraft", TreePolicy::kStatic, 2},
                                           Case{"DynamicSelfDraft", TreePolicy::kDynamic, 1},
                                           Case{"DynamicRandomDraft", TreePolicy::kDynamic, 2},
                                           Case{"Ngram", TreePolicy::kNgram, 0},
                                           Case{"NgramBesideADraftModel", TreePolicy::kNgram, 2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

TEST_F(SpeculativeTest, TheDefaultStaticTreeAndLongRunsGiveThePlainTokens) {
  // The shipped 63-entry tree, 6 levels, 120 tokens of the corpus's own text.
  SpeculativeOptions options{.policy = TreePolicy::kStatic, .tree_tokens = 63, .depth = 6};
  const std::vector<Job> jobs = {
      {.prompt = encode("Once upon a time"), .max_tokens = 120, .speculative = options},
      {.prompt = encode("The little fox"),
       .n = 2,
       .max_tokens = 120,
       .sampling = {.temperature = 0.7f, .seed = 3},
       .speculative = options}};
  std::unique_ptr<Scheduler> scheduler = make_scheduler(self_draft_);
  const std::vector<JobResult> got = run_jobs(*scheduler, jobs);
  expect_same_tokens(got, plain(jobs));
  expect_no_referenced_kv(*scheduler);
}

// Above SchedulerOptions::speculative_max_batch live works a step drafts nothing (no draft
// pass, no tree rows); once the batch has shrunk to the limit, the rest speculate. The tokens
// are the plain ones throughout, for a draft model's policy and for prompt lookup.
TEST_F(SpeculativeTest, SpeculationPausesAboveTheBatchLimit) {
  for (const TreePolicy policy : {TreePolicy::kStatic, TreePolicy::kNgram}) {
    SCOPED_TRACE(static_cast<int>(policy));
    const std::vector<Job> jobs = mixed_jobs(spec(policy), {.temperature = 0.0f});
    std::unique_ptr<Scheduler> scheduler =
        make_scheduler(self_draft_, 512, kPages, /*speculative_max_batch=*/3);
    std::vector<std::shared_ptr<GenerateEvents>> events;
    for (const Job& job : jobs) events.push_back(submit(*scheduler, job));
    const auto all_finished = [&] {
      return std::all_of(events.begin(), events.end(), [](const auto& e) { return e->finished(); });
    };
    int64_t paused_steps = 0, speculating_steps = 0;
    for (int i = 0; i < 20000 && !all_finished(); ++i) {
      scheduler->prepare();
      const int32_t live = scheduler->live();
      const std::optional<StepStats> stats = scheduler->step();
      ASSERT_NO_FATAL_FAILURE(check_forests(*scheduler));
      if (!stats.has_value()) continue;
      if (live > 3) {
        EXPECT_EQ(stats->drafted, 0) << "step " << i << " of " << live << " works";
        EXPECT_EQ(stats->draft.passes, 0) << "step " << i << " of " << live << " works";
        ++paused_steps;
      } else if (stats->drafted > 0) {
        ++speculating_steps;
      }
    }
    ASSERT_TRUE(all_finished());
    EXPECT_GT(paused_steps, 0);
    EXPECT_GT(speculating_steps, 0);
    std::vector<JobResult> got;
    for (size_t j = 0; j < jobs.size(); ++j) got.push_back(collect(*events[j], jobs[j].n));
    expect_same_tokens(got, plain(jobs));
    expect_no_referenced_kv(*scheduler);
  }
}

TEST_F(SpeculativeTest, PreemptedSpeculativeJobsGiveThePlainTokens) {
  // A pool far smaller than the jobs' worst cases: steps run short of KV and preempt.
  std::vector<Job> jobs = mixed_jobs(spec(TreePolicy::kStatic, 8, 4), {.temperature = 0.0f});
  for (Job& job : jobs) job.max_tokens = 60;
  std::unique_ptr<Scheduler> scheduler =
      make_scheduler(random_draft_, /*max_step_tokens=*/512, /*kv_pages=*/64);
  expect_same_tokens(run_jobs(*scheduler, jobs), plain(jobs));
  EXPECT_GT(scheduler->preemptions(), 0);
  expect_no_referenced_kv(*scheduler);
}

TEST_F(SpeculativeTest, CancellingMidSpeculationFreesTheKvOfBothModels) {
  std::unique_ptr<Scheduler> scheduler = make_scheduler(self_draft_);
  const Job job{.prompt = encode("Once upon a time"),
                .n = 3,
                .max_tokens = 200,
                .speculative = spec(TreePolicy::kDynamic)};
  std::shared_ptr<GenerateEvents> events = submit(*scheduler, job);
  for (int i = 0; i < 4; ++i) {
    scheduler->prepare();
    ASSERT_TRUE(scheduler->step().has_value());
  }
  EXPECT_GT(scheduler->draft()->forest().referenced_pages(), 0);
  events->cancel();
  scheduler->prepare();
  EXPECT_TRUE(events->finished());
  EXPECT_EQ(scheduler->live(), 0);
  expect_no_referenced_kv(*scheduler);
}

TEST_F(SpeculativeTest, ADraftPolicyWithoutADraftModelIsRefused) {
  std::unique_ptr<Scheduler> scheduler = make_scheduler(nullptr);
  auto events = std::make_shared<GenerateEvents>();
  GenerateJob job{
      .prompt = encode("Once"),
      .max_tokens = 4,
      .speculative = std::make_shared<const SpeculativeOptions>(spec(TreePolicy::kStatic))};
  const absl::Status status =
      scheduler->submit(std::make_unique<GenerateWork>(std::move(job), events, *tokenizer_, 8));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(events->finished());
}

// A tree session's decodes with and without speculation: create, branch 3 ways, decode the
// children twice (the second decode starts from the logits the first one kept), close.
// Returns every decoded node's tokens in order.
std::vector<std::vector<TokenId>> session_decodes(SpeculativeTest& test, Scheduler& scheduler,
                                                  const std::vector<TokenId>& prompt,
                                                  std::shared_ptr<const SpeculativeOptions> spec,
                                                  uint64_t session) {
  auto events = std::make_shared<SessionEvents>();
  EXPECT_TRUE(scheduler.open_session(session, events).ok());
  std::vector<SessionEvent> seen;
  const auto run = [&](SessionCommand command, size_t answers) {
    const size_t before = seen.size();
    scheduler.session_command(session, std::move(command));
    for (int i = 0; i < 5000; ++i) {
      scheduler.prepare();
      (void)scheduler.step();
      std::vector<SessionEvent> batch;
      events->next(batch, std::chrono::milliseconds(0));
      seen.insert(seen.end(), batch.begin(), batch.end());
      size_t finished = 0;
      for (size_t k = before; k < seen.size(); ++k) {
        const bool last = seen[k].kind != SessionEvent::Kind::kDecoded ||
                          seen[k].delta.finish != FinishReason::kNone;
        finished += last ? 1 : 0;
      }
      if (finished >= answers) break;
    }
    return std::vector<SessionEvent>(seen.begin() + static_cast<std::ptrdiff_t>(before),
                                     seen.end());
  };
  (void)test;
  const std::vector<SessionEvent> created =
      run({.request_id = 1, .op = CreateCommand{.prompt = prompt}}, 1);
  EXPECT_EQ(created.back().kind, SessionEvent::Kind::kCreated) << created.back().error;
  const std::vector<SessionEvent> branched =
      run({.request_id = 2, .op = BranchCommand{.node = created.back().node, .k = 3}}, 1);
  const std::vector<NodeId> children = branched.back().children;
  EXPECT_EQ(children.size(), 3u);
  std::vector<std::vector<TokenId>> out;
  for (uint64_t round = 0; round < 2; ++round) {
    DecodeCommand decode{.nodes = children,
                         .sampling = {.temperature = 0.8f, .seed = 9 + round},
                         .max_tokens = 20 + static_cast<int32_t>(round) * 7,
                         .speculative = spec};
    const std::vector<SessionEvent> decoded =
        run({.request_id = 3 + round, .op = std::move(decode)}, children.size());
    for (NodeId child : children) {
      std::vector<TokenId>& ids = out.emplace_back();
      for (const SessionEvent& event : decoded) {
        EXPECT_EQ(event.kind, SessionEvent::Kind::kDecoded) << event.error;
        if (event.node == child)
          ids.insert(ids.end(), event.delta.ids.begin(), event.delta.ids.end());
      }
    }
  }
  run({.request_id = 9, .op = CloseCommand{}}, 1);
  return out;
}

TEST_F(SpeculativeTest, SpeculativeSessionDecodesGiveThePlainTokens) {
  const std::vector<TokenId> prompt = encode("Once upon a time there was a");
  std::vector<std::vector<TokenId>> plain;
  {
    std::unique_ptr<Scheduler> scheduler = make_scheduler(nullptr);
    plain = session_decodes(*this, *scheduler, prompt, nullptr, 1);
  }
  ASSERT_EQ(plain.size(), 6u);
  struct Policy {
    SpeculativeOptions options;
    ModelRunner* draft;
  };
  for (const Policy& policy : {Policy{spec(TreePolicy::kStatic), self_draft_},
                               Policy{spec(TreePolicy::kDynamic), random_draft_},
                               Policy{spec(TreePolicy::kNgram), nullptr}}) {
    SCOPED_TRACE(static_cast<int>(policy.options.policy));
    std::unique_ptr<Scheduler> scheduler = make_scheduler(policy.draft);
    EXPECT_EQ(session_decodes(*this, *scheduler, prompt,
                              std::make_shared<const SpeculativeOptions>(policy.options), 2),
              plain);
    expect_no_referenced_kv(*scheduler);
  }
  // With speculation paused above one live work: a plain Generate beside the session pauses it
  // for the Generate's steps, and the session speculates once it is alone; the same tokens.
  std::unique_ptr<Scheduler> scheduler =
      make_scheduler(self_draft_, 512, kPages, /*speculative_max_batch=*/1);
  const std::shared_ptr<GenerateEvents> beside =
      submit(*scheduler, {.prompt = encode("The little fox"), .n = 2, .max_tokens = 30});
  EXPECT_EQ(
      session_decodes(*this, *scheduler, prompt,
                      std::make_shared<const SpeculativeOptions>(spec(TreePolicy::kStatic)), 3),
      plain);
  EXPECT_TRUE(beside->finished());
  expect_no_referenced_kv(*scheduler);
}

// The χ² test: tokens 1-3 of sampled speculative decoding across thousands of seeds (token 3 is
// where an accepted draft entry's row decides) against the target's own joint probability of
// them, computed from its logits. Fixed seeds: the test is deterministic.
TEST_F(SpeculativeTest, SampledSpeculativeTokensFollowTheTargetDistribution) {
  constexpr float kTemperature = 1.5f;
  constexpr int32_t kSeeds = 2000;
  const std::vector<TokenId> prompt = encode("The king said to the");
  models::testing::RunnerHarness harness(DEFT_SOURCE_DIR "/models/default", 4096, kPageTokens);
  const auto probabilities = [&](const std::vector<float>& logits) {
    std::vector<double> p(logits.size());
    double max = -INFINITY;
    for (float x : logits) max = std::max(max, static_cast<double>(x) / kTemperature);
    double sum = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      sum += p[i] = std::exp(static_cast<double>(logits[i]) / kTemperature - max);
    }
    for (double& x : p) x /= sum;
    return p;
  };
  // Tokens below this probability are left out of the exact computation (their mass goes to
  // the "rest" bin).
  constexpr double kSupport = 2e-4;
  std::unique_ptr<SequenceTree> tree = harness.new_tree();
  const models::testing::TreeStep prefill =
      models::testing::RunnerHarness::append(*tree, tree->root(), prompt);
  const std::vector<double> p1 = probabilities(harness.step({&prefill, 1}).back());
  struct Prefix {
    std::vector<TokenId> tokens;
    double p = 0;
    NodeId node = -1;
  };
  const auto grow = [&](const std::vector<Prefix>& from,
                        const std::vector<std::vector<double>>& rows) {
    std::vector<Prefix> out;
    for (size_t i = 0; i < from.size(); ++i) {
      for (size_t t = 0; t < rows[i].size(); ++t) {
        if (from[i].p * rows[i][t] < kSupport) continue;
        Prefix next = from[i];
        next.tokens.push_back(static_cast<TokenId>(t));
        next.p *= rows[i][t];
        out.push_back(std::move(next));
      }
    }
    return out;
  };
  // One step runs every prefix's last token as a child of its parent's node.
  const auto run = [&](std::vector<Prefix>& prefixes, const std::vector<NodeId>& parents) {
    models::testing::TreeStep step{.tree = tree.get()};
    for (size_t i = 0; i < prefixes.size(); ++i) {
      const TokenId token = prefixes[i].tokens.back();
      absl::StatusOr<NodeId> child = tree->add_child(parents[i], std::span(&token, 1));
      EXPECT_TRUE(child.ok()) << child.status();
      prefixes[i].node = *child;
      step.queries.push_back({*child, 0});
      step.tokens.push_back(token);
    }
    std::vector<std::vector<double>> rows;
    for (const std::vector<float>& logits : harness.step({&step, 1})) {
      rows.push_back(probabilities(logits));
    }
    return rows;
  };
  std::vector<Prefix> level1 = grow({Prefix{.p = 1.0}}, {p1});
  const std::vector<std::vector<double>> rows1 =
      run(level1, std::vector<NodeId>(level1.size(), tree->root()));
  std::vector<Prefix> level2 = grow(level1, rows1);
  std::vector<NodeId> parents2;
  for (const Prefix& prefix : level2) {
    for (const Prefix& parent : level1) {
      if (parent.tokens[0] == prefix.tokens[0]) parents2.push_back(parent.node);
    }
  }
  const std::vector<std::vector<double>> rows2 = run(level2, parents2);
  const std::vector<Prefix> level3 = grow(level2, rows2);

  // The speculative jobs: the target drafting for itself (dynamic trees), so token 3 is often
  // an accepted entry's.
  std::unique_ptr<Scheduler> scheduler = make_scheduler(self_draft_, 2048);
  std::vector<Job> jobs;
  for (int32_t seed = 0; seed < kSeeds; ++seed) {
    jobs.push_back({.prompt = prompt,
                    .max_tokens = 3,
                    .sampling = {.temperature = kTemperature, .seed = 1000003u * seed + 17u},
                    .speculative = spec(TreePolicy::kDynamic, 16, 3, 4)});
  }
  std::map<std::vector<TokenId>, int64_t> counts;
  int64_t accepted = 0;
  for (size_t begin = 0; begin < jobs.size(); begin += 250) {
    const std::vector<Job> batch(jobs.begin() + static_cast<std::ptrdiff_t>(begin),
                                 jobs.begin() + static_cast<std::ptrdiff_t>(begin + 250));
    for (const JobResult& result : run_jobs(*scheduler, batch)) {
      ++counts[result[0].tokens];
      accepted += result[0].speculation.accepted;
    }
  }
  // Token 3 came from an accepted entry's row in a good share of the jobs (a broken walk that
  // commits the draft's tokens instead of the target's draws fails below: χ² about 470).
  EXPECT_GT(accepted, kSeeds / 4);
  expect_no_referenced_kv(*scheduler);
  // Bins: every triple expected at least 5 times, the rest together.
  double chi2 = 0;
  int32_t bins = 0;
  double rest_expected = kSeeds;
  int64_t rest_count = kSeeds;
  for (const Prefix& prefix : level3) {
    const double expected = prefix.p * kSeeds;
    if (expected < 5) continue;
    const auto it = counts.find(prefix.tokens);
    const int64_t count = it == counts.end() ? 0 : it->second;
    chi2 += (count - expected) * (count - expected) / expected;
    rest_expected -= expected;
    rest_count -= count;
    ++bins;
  }
  ASSERT_GE(bins, 8) << "too few likely triples for the test to say much";
  if (rest_expected >= 5) {
    chi2 += (rest_count - rest_expected) * (rest_count - rest_expected) / rest_expected;
    ++bins;
  }
  // The χ² quantile at 1 - 1e-3 (Wilson-Hilferty): a correct sampler fails one seed set in a
  // thousand, and this seed set is fixed.
  const double df = bins - 1;
  const double z = 3.09;
  const double critical = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  EXPECT_LT(chi2, critical) << bins << " bins";
}

}  // namespace
}  // namespace deft::engine
