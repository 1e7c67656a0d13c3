// The engine Scheduler end to end on the embedded default model (CPU backend): continuous
// batching of many jobs equals running each alone, prefix reuse, tree sessions (create,
// extend, decode, branch, score, prune, close) against Generate, Verify of the model's own
// greedy continuation, RunTree replay, and the KV pool back to empty after everything.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "engine/works/generate_work.h"
#include "engine/works/tree_search_work.h"
#include "models/llama_cpu.h"

namespace deft::engine {
namespace {

constexpr int32_t kPageTokens = 8;
constexpr int32_t kPages = 1024;

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
        load_tokenizer(DEFT_SOURCE_DIR "/models/default");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer);
    absl::StatusOr<std::unique_ptr<models::LlamaCpuRunner>> runner = models::LlamaCpuRunner::load(
        DEFT_SOURCE_DIR "/models/default", int64_t{kPages} * kPageTokens);
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner);
    scheduler_ = make_scheduler(/*max_step_tokens=*/256);
  }

  std::unique_ptr<Scheduler> make_scheduler(int32_t max_step_tokens) {
    SchedulerOptions options{.page_tokens = kPageTokens, .kv_pages = kPages,
                             .max_step_tokens = max_step_tokens};
    return std::make_unique<Scheduler>(options, *runner_, *tokenizer_);
  }

  // Steps (at least once) until `done` holds (or a step limit, which fails the test).
  void run_until(Scheduler& scheduler, const std::function<bool()>& done) {
    for (int i = 0; i < 5000; ++i) {
      scheduler.prepare();
      (void)scheduler.step();
      if (done()) break;
    }
    ASSERT_TRUE(done()) << "the scheduler did not finish";
  }

  std::vector<TokenId> encode(const std::string& text) {
    return *tokenizer_->encode(text, /*add_bos=*/true, /*parse_special=*/false);
  }

  std::shared_ptr<GenerateEvents> submit_generate(Scheduler& scheduler,
                                                  std::vector<TokenId> prompt, int32_t n,
                                                  int32_t max_tokens) {
    auto events = std::make_shared<GenerateEvents>();
    GenerateJob job{.prompt = std::move(prompt), .n = n, .max_tokens = max_tokens,
                    .sampling = {.temperature = 0.0f}};
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<GenerateWork>(std::move(job), events, *tokenizer_,
                                                           kPageTokens))
                    .ok());
    return events;
  }

  // Every branch's tokens, once the job has finished.
  static std::vector<std::vector<TokenId>> branches(GenerateEvents& events, int32_t n) {
    std::vector<std::vector<TokenId>> out(static_cast<size_t>(n));
    std::vector<GenerateEvent> batch;
    while (events.next(batch, std::chrono::milliseconds(0))) {
      for (const GenerateEvent& event : batch) {
        out[event.branch].insert(out[event.branch].end(), event.delta.ids.begin(),
                                 event.delta.ids.end());
      }
      batch.clear();
    }
    EXPECT_TRUE(events.final_status().ok()) << events.final_status();
    return out;
  }

  std::vector<std::vector<TokenId>> generate_alone(std::vector<TokenId> prompt, int32_t n,
                                                   int32_t max_tokens) {
    std::unique_ptr<Scheduler> alone = make_scheduler(256);
    std::shared_ptr<GenerateEvents> events = submit_generate(*alone, prompt, n, max_tokens);
    run_until(*alone, [&] { return events->finished(); });
    return branches(*events, n);
  }

  // Once every work and session has ended: no KV is referenced any more, and whatever the
  // pool still holds is cached prefixes (engine/forest.h), which a new work may evict at once.
  // With the prefix cache off (the NoPrefixCache test) that is an empty pool.
  static void expect_only_cached_kv(const Scheduler& scheduler) {
    EXPECT_EQ(scheduler.forest().referenced_pages(), 0);
    EXPECT_EQ(scheduler.kv().used_pages(), scheduler.forest().cached_pages());
    const absl::Status invariants = scheduler.forest().check_invariants();
    EXPECT_TRUE(invariants.ok()) << invariants;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<models::LlamaCpuRunner> runner_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, SixteenConcurrentJobsEqualEachAlone) {
  const std::vector<std::string> texts = {
      "Once upon a time", "The little fox", "Once upon a time there was", "The king said",
      "In the forest", "Once upon a time there was a tree", "The river", "A mathematician",
      "She walked to", "The little fox ran", "Every morning", "The old man", "Under the bridge",
      "The king said to the", "Once", "In the forest there was a"};
  std::vector<std::shared_ptr<GenerateEvents>> events;
  for (size_t i = 0; i < texts.size(); ++i) {
    events.push_back(submit_generate(*scheduler_, encode(texts[i]), 1 + static_cast<int32_t>(i % 3), 10));
  }
  run_until(*scheduler_, [&] {
    for (const auto& e : events) {
      if (!e->finished()) return false;
    }
    return true;
  });
  expect_only_cached_kv(*scheduler_);
  for (size_t i = 0; i < texts.size(); ++i) {
    SCOPED_TRACE(texts[i]);
    const int32_t n = 1 + static_cast<int32_t>(i % 3);
    EXPECT_EQ(branches(*events[i], n), generate_alone(encode(texts[i]), n, 10));
  }
}

TEST_F(SchedulerTest, ChunkedPrefillUnderASmallBudgetGivesTheSameTokens) {
  std::unique_ptr<Scheduler> small = make_scheduler(/*max_step_tokens=*/5);
  const std::vector<TokenId> prompt = encode("Once upon a time there was a tree that grew beside");
  std::shared_ptr<GenerateEvents> events = submit_generate(*small, prompt, 2, 8);
  std::shared_ptr<GenerateEvents> other = submit_generate(*small, encode("The king said"), 3, 8);
  run_until(*small, [&] { return events->finished() && other->finished(); });
  EXPECT_EQ(branches(*events, 2), generate_alone(prompt, 2, 8));
  expect_only_cached_kv(*small);
}

TEST_F(SchedulerTest, SessionCommandsMatchGenerate) {
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler_->open_session(1, events).ok());
  const std::vector<TokenId> prompt = encode("Once upon a time");
  std::vector<SessionEvent> seen;
  const auto command = [&](SessionCommand c) {
    const size_t before = seen.size();
    scheduler_->session_command(1, std::move(c));
    run_until(*scheduler_, [&] {
      std::vector<SessionEvent> batch;
      events->next(batch, std::chrono::milliseconds(0));
      seen.insert(seen.end(), batch.begin(), batch.end());
      // A command is done when its last answer arrived (decode: every node finished).
      for (size_t i = before; i < seen.size(); ++i) {
        if (seen[i].kind != SessionEvent::Kind::kDecoded) return true;
        if (seen[i].delta.finish != FinishReason::kNone) return true;
      }
      return false;
    });
    return seen.back();
  };
  SessionEvent created = command({.request_id = 1, .op = CreateCommand{.prompt = prompt}});
  ASSERT_EQ(created.kind, SessionEvent::Kind::kCreated) << created.error;
  const NodeId root = created.node;

  // decode == Generate (greedy).
  const std::vector<std::vector<TokenId>> expected = generate_alone(prompt, 1, 12);
  SessionEvent decoded = command(
      {.request_id = 2,
       .op = DecodeCommand{.nodes = {root}, .sampling = {.temperature = 0.0f}, .max_tokens = 12}});
  std::vector<TokenId> decoded_ids;
  for (const SessionEvent& e : seen) {
    if (e.request_id == 2) decoded_ids.insert(decoded_ids.end(), e.delta.ids.begin(), e.delta.ids.end());
  }
  EXPECT_EQ(decoded_ids, expected[0]);

  // score of that continuation from a branch == the logprobs greedy decoding reported.
  SessionEvent branched = command({.request_id = 3, .op = BranchCommand{.node = root, .k = 2}});
  ASSERT_EQ(branched.kind, SessionEvent::Kind::kBranched) << branched.error;
  ASSERT_EQ(branched.children.size(), 2u);
  // The decoded root is inner now: extending it is refused, nothing changes.
  SessionEvent refused =
      command({.request_id = 4, .op = ExtendCommand{.node = root, .tokens = {5}}});
  EXPECT_EQ(refused.kind, SessionEvent::Kind::kError);
  EXPECT_EQ(refused.error.code(), absl::StatusCode::kFailedPrecondition);
  SessionEvent unknown = command({.request_id = 5, .op = PruneCommand{.node = 12345}});
  EXPECT_EQ(unknown.error.code(), absl::StatusCode::kNotFound);

  // extend a child with text, then decode == Generate on prompt + decoded + text.
  const NodeId child = branched.children[0];
  std::vector<TokenId> more = encode(" there was a tree");
  more.erase(more.begin());  // no BOS inside
  SessionEvent extended =
      command({.request_id = 6, .op = ExtendCommand{.node = child, .tokens = more}});
  ASSERT_EQ(extended.kind, SessionEvent::Kind::kExtended) << extended.error;
  EXPECT_EQ(extended.length,
            static_cast<int64_t>(prompt.size() + decoded_ids.size() + more.size()));
  std::vector<TokenId> full = prompt;
  full.insert(full.end(), decoded_ids.begin(), decoded_ids.end());
  full.insert(full.end(), more.begin(), more.end());
  SessionEvent scored = command(
      {.request_id = 7, .op = ScoreCommand{.node = branched.children[1], .continuation = more}});
  ASSERT_EQ(scored.kind, SessionEvent::Kind::kScored) << scored.error;
  EXPECT_EQ(scored.token_logprobs.size(), more.size());
  EXPECT_LT(scored.logprob, 0.0);
  const std::vector<std::vector<TokenId>> expected_more = generate_alone(full, 1, 6);
  command(
      {.request_id = 8,
       .op = DecodeCommand{.nodes = {child}, .sampling = {.temperature = 0.0f}, .max_tokens = 6}});
  std::vector<TokenId> more_ids;
  for (const SessionEvent& e : seen) {
    if (e.request_id == 8) more_ids.insert(more_ids.end(), e.delta.ids.begin(), e.delta.ids.end());
  }
  EXPECT_EQ(more_ids, expected_more[0]);

  // A second session on the same prompt shares its KV, and closing both frees everything.
  const int32_t used = scheduler_->forest().referenced_pages();
  auto other_events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler_->open_session(2, other_events).ok());
  scheduler_->session_command(2, {.request_id = 1, .op = CreateCommand{.prompt = prompt}});
  run_until(*scheduler_, [&] { return !scheduler_->has_live() && scheduler_->queued() == 0; });
  EXPECT_LE(scheduler_->forest().referenced_pages(), used + 1);
  scheduler_->close_session(2);
  command({.request_id = 9, .op = PruneCommand{.node = child}});
  command({.request_id = 10, .op = CloseCommand{}});
  run_until(*scheduler_, [&] { return scheduler_->sessions() == 0; });
  expect_only_cached_kv(*scheduler_);
  EXPECT_TRUE(scheduler_->forest().tree().check_invariants());
}

// The engine loop sleeps when nothing is live and nothing is ready; a session's next command,
// queued while its previous one ran, must count as ready once that one ends.
TEST_F(SchedulerTest, ASessionsQueuedCommandIsReadyWhenTheRunningOneEnds) {
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler_->open_session(4, events).ok());
  EXPECT_FALSE(scheduler_->has_ready_sessions());
  scheduler_->session_command(
      4, {.request_id = 1, .op = CreateCommand{.prompt = encode("Once upon a time")}});
  scheduler_->session_command(
      4, {.request_id = 2, .op = ScoreCommand{.node = 1, .continuation = {5}}});
  EXPECT_TRUE(scheduler_->has_ready_sessions());
  scheduler_->prepare();  // the create starts; the score waits behind it
  EXPECT_TRUE(scheduler_->has_live());
  EXPECT_FALSE(scheduler_->has_ready_sessions());
  for (int i = 0; i < 100 && scheduler_->has_live(); ++i) (void)scheduler_->step();
  EXPECT_FALSE(scheduler_->has_live());
  EXPECT_TRUE(scheduler_->has_ready_sessions()) << "the score would wait for the idle timeout";
  scheduler_->prepare();
  EXPECT_TRUE(scheduler_->has_live());  // the score runs
  scheduler_->close_session(4);
  run_until(*scheduler_, [&] { return scheduler_->sessions() == 0; });
  expect_only_cached_kv(*scheduler_);
}

// Admission in a 64-page pool (8-token pages). A session holds two prompts (57 pages); a
// Generate that fits the pool but not the 7 free pages queues; the session then scores one node
// and prunes the other. The score must not wait behind the Generate (which waits for the pages
// the prune frees): everything finishes, the Generate as it would alone.
class SmallPoolTest : public SchedulerTest {
 protected:
  std::unique_ptr<Scheduler> small_pool(int32_t patience = 64,
                                        Admission admission = Admission::kStep) {
    SchedulerOptions options{.page_tokens = kPageTokens,
                             .kv_pages = 64,
                             .admission_patience = patience,
                             .admission = admission,
                             .max_step_tokens = 256};
    return std::make_unique<Scheduler>(options, *runner_, *tokenizer_);
  }
  static std::vector<TokenId> ids(size_t count, TokenId first) {
    std::vector<TokenId> out;
    for (size_t i = 0; i < count; ++i)
      out.push_back(3 + static_cast<TokenId>((first + i * 7) % 500));
    return out;
  }
  // Sends a command and steps until its answer (the first non-decode event) arrives.
  SessionEvent answer(Scheduler& scheduler, uint64_t session, SessionEvents& events,
                      SessionCommand command) {
    scheduler.session_command(session, std::move(command));
    std::vector<SessionEvent> seen;
    run_until(scheduler, [&] {
      events.next(seen, std::chrono::milliseconds(0));
      return !seen.empty();
    });
    return seen.empty() ? SessionEvent{} : seen.back();
  }
};

TEST_F(SmallPoolTest, ASessionsScoreAndPruneNeverWaitBehindAQueuedJob) {
  std::unique_ptr<Scheduler> scheduler = small_pool();
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler->open_session(1, events).ok());
  const SessionEvent a =
      answer(*scheduler, 1, *events, {.request_id = 1, .op = CreateCommand{.prompt = ids(250, 1)}});
  const SessionEvent b =
      answer(*scheduler, 1, *events, {.request_id = 2, .op = CreateCommand{.prompt = ids(200, 2)}});
  ASSERT_EQ(a.kind, SessionEvent::Kind::kCreated) << a.error;
  ASSERT_EQ(b.kind, SessionEvent::Kind::kCreated) << b.error;
  EXPECT_EQ(scheduler->kv().used_pages(), 57);

  const std::vector<TokenId> prompt = ids(50, 3);
  std::shared_ptr<GenerateEvents> job = submit_generate(*scheduler, prompt, 4, 40);
  scheduler->prepare();
  EXPECT_EQ(scheduler->queued(), 1) << "the job fits the pool but not the free pages";
  scheduler->session_command(
      1, {.request_id = 3, .op = ScoreCommand{.node = a.node, .continuation = {5, 6, 7}}});
  scheduler->session_command(1, {.request_id = 4, .op = PruneCommand{.node = b.node}});
  std::vector<SessionEvent> seen;
  run_until(*scheduler, [&] {
    events->next(seen, std::chrono::milliseconds(0));
    return job->finished() && seen.size() >= 2;
  });
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen[0].kind, SessionEvent::Kind::kScored) << seen[0].error;
  EXPECT_EQ(seen[1].kind, SessionEvent::Kind::kPruned) << seen[1].error;
  EXPECT_EQ(branches(*job, 4), generate_alone(prompt, 4, 40));
  scheduler->close_session(1);
  run_until(*scheduler, [&] { return scheduler->sessions() == 0; });
  expect_only_cached_kv(*scheduler);
}

// A decode that could never fit the pool is refused with one error and nothing else: no
// CANCELLED finish per node, and the node keeps its logits (a smaller decode then runs).
TEST_F(SmallPoolTest, ARefusedSessionDecodeAnswersOnlyItsError) {
  std::unique_ptr<Scheduler> scheduler = small_pool();
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler->open_session(1, events).ok());
  const SessionEvent root =
      answer(*scheduler, 1, *events, {.request_id = 1, .op = CreateCommand{.prompt = ids(10, 1)}});
  ASSERT_EQ(root.kind, SessionEvent::Kind::kCreated) << root.error;
  scheduler->session_command(
      1, {.request_id = 2,
          .op = DecodeCommand{
              .nodes = {root.node}, .sampling = {.temperature = 0.0f}, .max_tokens = 1000}});
  std::vector<SessionEvent> answers;
  for (int i = 0; i < 3; ++i) {
    scheduler->prepare();
    (void)scheduler->step();
    events->next(answers, std::chrono::milliseconds(0));
  }
  ASSERT_EQ(answers.size(), 1u) << "only the error answers the refused decode";
  EXPECT_EQ(answers[0].kind, SessionEvent::Kind::kError);
  EXPECT_EQ(answers[0].error.code(), absl::StatusCode::kResourceExhausted) << answers[0].error;
  const SessionEvent decoded =
      answer(*scheduler, 1, *events,
             {.request_id = 3,
              .op = DecodeCommand{
                  .nodes = {root.node}, .sampling = {.temperature = 0.0f}, .max_tokens = 3}});
  EXPECT_EQ(decoded.kind, SessionEvent::Kind::kDecoded) << decoded.error;
  scheduler->close_session(1);
  run_until(*scheduler, [&] { return scheduler->sessions() == 0; });
}

// A one-page job does not wait behind a queued job that needs more than the free pages.
TEST_F(SmallPoolTest, ASmallJobPassesALargeOneThatDoesNotFitYet) {
  std::unique_ptr<Scheduler> scheduler = small_pool();
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler->open_session(1, events).ok());
  const SessionEvent held =
      answer(*scheduler, 1, *events, {.request_id = 1, .op = CreateCommand{.prompt = ids(450, 1)}});
  ASSERT_EQ(held.kind, SessionEvent::Kind::kCreated) << held.error;
  std::shared_ptr<GenerateEvents> large = submit_generate(*scheduler, ids(60, 2), 2, 40);
  std::shared_ptr<GenerateEvents> small = submit_generate(*scheduler, ids(3, 3), 1, 4);
  run_until(*scheduler, [&] { return small->finished(); });
  EXPECT_FALSE(large->finished());
  EXPECT_EQ(scheduler->queued(), 1);
  // The session lets go of its prompt: the large job runs.
  scheduler->session_command(1, {.request_id = 2, .op = PruneCommand{.node = held.node}});
  run_until(*scheduler, [&] { return large->finished(); });
  EXPECT_TRUE(large->final_status().ok()) << large->final_status();
  scheduler->close_session(1);
  run_until(*scheduler, [&] { return scheduler->sessions() == 0; });
  expect_only_cached_kv(*scheduler);
}

// Passing is bounded: once a job has waited `admission_patience` steps, jobs that arrive after
// it are not admitted before it. (Worst-case admission, so that the large job cannot fit
// beside the running one; the rule is the same under step admission.)
TEST_F(SmallPoolTest, AJobOutOfPatienceHoldsBackLaterJobs) {
  std::unique_ptr<Scheduler> scheduler = small_pool(/*patience=*/3, Admission::kWorstCase);
  std::shared_ptr<GenerateEvents> running = submit_generate(*scheduler, ids(100, 1), 1, 200);
  scheduler->prepare();
  ASSERT_TRUE(scheduler->has_live());
  std::shared_ptr<GenerateEvents> large = submit_generate(*scheduler, ids(100, 2), 1, 150);
  std::shared_ptr<GenerateEvents> early = submit_generate(*scheduler, ids(8, 3), 1, 8);
  for (int i = 0; i < 5; ++i) {
    scheduler->prepare();
    (void)scheduler->step();
  }
  EXPECT_EQ(scheduler->queued(), 1) << "the small early job passes the large one";
  // The late job would fit, but the large one has waited out its patience: it goes first.
  std::shared_ptr<GenerateEvents> late = submit_generate(*scheduler, ids(8, 4), 1, 8);
  int large_first = -1, late_first = -1;
  std::vector<GenerateEvent> batch;
  for (int step = 0; step < 3000 && !(large->finished() && late->finished()); ++step) {
    scheduler->prepare();
    (void)scheduler->step();
    batch.clear();
    large->next(batch, std::chrono::milliseconds(0));
    if (large_first < 0 && !batch.empty()) large_first = step;
    batch.clear();
    late->next(batch, std::chrono::milliseconds(0));
    if (late_first < 0 && !batch.empty()) late_first = step;
  }
  EXPECT_TRUE(large->finished() && late->finished());
  ASSERT_GE(large_first, 0);
  ASSERT_GE(late_first, 0);
  EXPECT_LE(large_first, late_first);
  run_until(*scheduler, [&] { return running->finished() && early->finished(); });
  expect_only_cached_kv(*scheduler);
}

// Step admission in a 64-page pool: 32 jobs whose worst cases add up to 11 times the pool all
// run, with preemptions (and evictions of the preempted jobs' cached KV) along the way, and
// each gives exactly the tokens it gives alone: a preempted job recomputes its KV and goes on.
TEST_F(SmallPoolTest, ThirtyTwoJobsTenTimesThePoolAllFinishAsAlone) {
  std::unique_ptr<Scheduler> scheduler = small_pool();
  constexpr int kJobs = 32;
  int64_t worst_case = 0;
  std::vector<std::vector<TokenId>> prompts;
  std::vector<std::shared_ptr<GenerateEvents>> jobs;
  for (int i = 0; i < kJobs; ++i) {
    prompts.push_back(ids(10 + static_cast<size_t>(i % 5), static_cast<TokenId>(i * 13)));
    GenerateJob job{.prompt = prompts.back(), .n = 2, .max_tokens = 80};
    worst_case += GenerateWork::max_pages(job, kPageTokens);
    jobs.push_back(submit_generate(*scheduler, prompts.back(), 2, 80));
  }
  EXPECT_GE(worst_case, 10 * 64);
  for (int step = 0; step < 20000; ++step) {
    scheduler->prepare();
    (void)scheduler->step();
    const absl::Status invariants = scheduler->forest().check_invariants();
    ASSERT_TRUE(invariants.ok()) << "step " << step << ": " << invariants;
    if (std::all_of(jobs.begin(), jobs.end(), [](const auto& job) { return job->finished(); })) {
      break;
    }
  }
  for (const auto& job : jobs) ASSERT_TRUE(job->finished());
  expect_only_cached_kv(*scheduler);
  EXPECT_GT(scheduler->preemptions(), 0);
  EXPECT_GT(scheduler->forest().cache_stats().evicted_pages, 0);
  for (int i = 0; i < kJobs; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(branches(*jobs[i], 2), generate_alone(prompts[i], 2, 80));
  }
}

// Worst-case admission runs the same jobs one pool's worth at a time, never preempting.
TEST_F(SmallPoolTest, WorstCaseAdmissionNeverPreempts) {
  std::unique_ptr<Scheduler> scheduler = small_pool(64, Admission::kWorstCase);
  std::vector<std::shared_ptr<GenerateEvents>> jobs;
  for (int i = 0; i < 8; ++i) jobs.push_back(submit_generate(*scheduler, ids(12, i * 5), 2, 80));
  run_until(*scheduler, [&] {
    return std::all_of(jobs.begin(), jobs.end(), [](const auto& job) { return job->finished(); });
  });
  EXPECT_EQ(scheduler->preemptions(), 0);
  for (const auto& job : jobs) EXPECT_TRUE(job->final_status().ok()) << job->final_status();
  expect_only_cached_kv(*scheduler);
}

// A seeded, sampled job that is preempted gives the same tokens as alone too: draws depend on
// the seed and the token's position only.
TEST_F(SmallPoolTest, APreemptedSampledJobGivesTheSameTokens) {
  const auto sampled = [&](Scheduler& scheduler, const std::vector<TokenId>& prompt) {
    auto events = std::make_shared<GenerateEvents>();
    GenerateJob job{.prompt = prompt,
                    .n = 3,
                    .max_tokens = 60,
                    .sampling = {.temperature = 0.9f, .top_p = 0.95f, .seed = 77}};
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<GenerateWork>(std::move(job), events, *tokenizer_,
                                                           kPageTokens))
                    .ok());
    return events;
  };
  const std::vector<TokenId> prompt = ids(30, 9);
  std::unique_ptr<Scheduler> alone = make_scheduler(256);
  std::shared_ptr<GenerateEvents> reference = sampled(*alone, prompt);
  run_until(*alone, [&] { return reference->finished(); });

  std::unique_ptr<Scheduler> scheduler = small_pool();
  std::vector<std::shared_ptr<GenerateEvents>> crowd;
  for (int i = 0; i < 6; ++i) crowd.push_back(submit_generate(*scheduler, ids(20, i), 2, 70));
  std::shared_ptr<GenerateEvents> job = sampled(*scheduler, prompt);
  run_until(*scheduler, [&] { return job->finished(); });
  EXPECT_GT(scheduler->preemptions(), 0);
  EXPECT_EQ(branches(*job, 3), branches(*reference, 3));
  run_until(*scheduler, [&] {
    return std::all_of(crowd.begin(), crowd.end(), [](const auto& e) { return e->finished(); });
  });
  expect_only_cached_kv(*scheduler);
}

// Fair share: a client with 40 waiting jobs does not starve one that sends a single job after
// them; and a high-priority job goes before normal ones that came first.
TEST_F(SmallPoolTest, AdmissionSharesBetweenClientsAndHonoursPriority) {
  // A budget that prefills every admitted prompt in one step: first tokens show admission.
  SchedulerOptions options{.page_tokens = kPageTokens,
                           .kv_pages = 64,
                           .max_step_tokens = 1024,
                           .max_prefill_tokens = 1024};
  auto scheduler = std::make_unique<Scheduler>(options, *runner_, *tokenizer_);
  const auto submit = [&](uint64_t client, Priority priority, TokenId seed) {
    auto events = std::make_shared<GenerateEvents>();
    GenerateJob job{.prompt = ids(40, seed),
                    .n = 1,
                    .max_tokens = 20,
                    .requester = {.client = client, .priority = priority}};
    EXPECT_TRUE(scheduler
                    ->submit(std::make_unique<GenerateWork>(std::move(job), events, *tokenizer_,
                                                            kPageTokens))
                    .ok());
    return events;
  };
  std::vector<std::shared_ptr<GenerateEvents>> busy;
  for (int i = 0; i < 40; ++i)
    busy.push_back(submit(1, Priority::kNormal, static_cast<TokenId>(i)));
  std::shared_ptr<GenerateEvents> single = submit(2, Priority::kNormal, 100);
  std::shared_ptr<GenerateEvents> urgent = submit(3, Priority::kHigh, 200);
  std::shared_ptr<GenerateEvents> idle = submit(4, Priority::kLow, 300);
  // The step at which each job's first token arrives.
  std::vector<std::shared_ptr<GenerateEvents>> all = busy;
  all.insert(all.end(), {single, urgent, idle});
  std::vector<int> first(all.size(), -1);
  std::vector<GenerateEvent> batch;
  for (int step = 0; step < 20000; ++step) {
    scheduler->prepare();
    (void)scheduler->step();
    for (size_t i = 0; i < all.size(); ++i) {
      batch.clear();
      all[i]->next(batch, std::chrono::milliseconds(0));
      if (first[i] < 0 && !batch.empty()) first[i] = step;
    }
    if (std::all_of(all.begin(), all.end(), [](const auto& e) { return e->finished(); })) break;
  }
  ASSERT_TRUE(std::all_of(first.begin(), first.end(), [](int step) { return step >= 0; }));
  std::vector<int> busy_first(first.begin(), first.begin() + 40);
  std::sort(busy_first.begin(), busy_first.end());
  const int single_first = first[40], urgent_first = first[41], idle_first = first[42];
  EXPECT_LE(urgent_first, busy_first.front()) << "high priority goes first";
  EXPECT_LE(single_first, busy_first.front()) << "admitted with the busy client's first job";
  EXPECT_GE(idle_first, busy_first.back()) << "low priority waits for everything else";
  expect_only_cached_kv(*scheduler);
}

// A long prompt arriving while branches decode takes at most max_prefill_tokens rows a step:
// the running branches get a token every step.
TEST_F(SchedulerTest, ALongPromptDoesNotStallRunningBranches) {
  SchedulerOptions options{.page_tokens = kPageTokens,
                           .kv_pages = kPages,
                           .max_step_tokens = 256,
                           .max_prefill_tokens = 64};
  Scheduler scheduler(options, *runner_, *tokenizer_);
  std::shared_ptr<GenerateEvents> running =
      submit_generate(scheduler, encode("Once upon a time"), 4, 40);
  std::vector<GenerateEvent> batch;
  run_until(scheduler, [&] {
    running->next(batch, std::chrono::milliseconds(0));
    return !batch.empty();
  });
  std::vector<TokenId> long_prompt;
  for (int i = 0; i < 600; ++i) long_prompt.push_back(3 + (i * 11) % 500);
  std::shared_ptr<GenerateEvents> arriving = submit_generate(scheduler, long_prompt, 1, 4);
  int steps = 0;
  while (!arriving->finished() && steps < 100) {
    scheduler.prepare();
    const std::optional<StepStats> stats = scheduler.step();
    ASSERT_TRUE(stats.has_value());
    batch.clear();
    running->next(batch, std::chrono::milliseconds(0));
    int tokens = 0;
    for (const GenerateEvent& event : batch) tokens += static_cast<int>(event.delta.ids.size());
    if (running->finished()) break;
    EXPECT_EQ(tokens, 4) << "step " << steps << ": every running branch decodes";
    EXPECT_LE(stats->rows, 64 + 4);
    ++steps;
  }
  EXPECT_GE(steps, 600 / 64);
  run_until(scheduler, [&] { return running->finished() && arriving->finished(); });
}

TEST_F(SchedulerTest, VerifyAcceptsTheModelsOwnGreedyPath) {
  const std::vector<TokenId> prompt = encode("Once upon a time");
  const std::vector<TokenId> greedy = generate_alone(prompt, 1, 10)[0];
  ASSERT_EQ(greedy.size(), 10u);
  auto events = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler_->open_session(3, events).ok());
  scheduler_->session_command(3, {.request_id = 1, .op = CreateCommand{.prompt = prompt}});
  run_until(*scheduler_, [&] { return !scheduler_->has_live() && scheduler_->queued() == 0; });
  std::vector<SessionEvent> batch;
  events->next(batch, std::chrono::milliseconds(0));
  ASSERT_EQ(batch.size(), 1u);
  const NodeId node = batch[0].node;

  // A chain of the first 8 greedy tokens, with a wrong sibling at every level.
  VerifyCommand verify{.node = node, .sampling = {.temperature = 0.0f}};
  int32_t parent = -1;
  for (int i = 0; i < 8; ++i) {
    verify.tokens.push_back((greedy[i] + 7) % 512);  // wrong
    verify.parents.push_back(parent);
    verify.tokens.push_back(greedy[i]);
    verify.parents.push_back(parent);
    parent = static_cast<int32_t>(verify.tokens.size()) - 1;
  }
  auto reply = std::make_shared<VerifyReply>();
  verify.reply = reply;
  scheduler_->session_command(3, {.op = std::move(verify)});
  run_until(*scheduler_, [&] { return reply->finished(); });
  std::vector<VerifyOutcome> outcome;
  reply->next(outcome, std::chrono::milliseconds(0));
  ASSERT_EQ(outcome.size(), 1u) << reply->final_status();
  EXPECT_EQ(outcome[0].accepted, std::vector<TokenId>(greedy.begin(), greedy.begin() + 8));
  EXPECT_EQ(outcome[0].bonus_token, greedy[8]);

  // The committed leaf continues exactly like plain greedy decoding.
  scheduler_->session_command(
      3, {.request_id = 2,
          .op = DecodeCommand{
              .nodes = {outcome[0].node}, .sampling = {.temperature = 0.0f}, .max_tokens = 2}});
  run_until(*scheduler_, [&] { return !scheduler_->has_live() && scheduler_->queued() == 0; });
  std::vector<TokenId> next;
  batch.clear();
  events->next(batch, std::chrono::milliseconds(0));
  for (const SessionEvent& e : batch) next.insert(next.end(), e.delta.ids.begin(), e.delta.ids.end());
  EXPECT_EQ(next, std::vector<TokenId>(greedy.begin() + 8, greedy.end()));

  scheduler_->close_session(3);
  run_until(*scheduler_, [&] { return scheduler_->sessions() == 0; });
  expect_only_cached_kv(*scheduler_);
}

TEST_F(SchedulerTest, RunTreeFinishesReplaysAndFreesItsKv) {
  const auto run = [&](Scheduler& scheduler) {
    auto events = std::make_shared<TreeSearchEvents>();
    TreeSearchJob job{.prompt = encode("Once upon a time"),
                      .policy = {.branch_factor = 3, .every_tokens = 4, .max_depth = 2,
                                 .keep_best = 2},
                      .sampling = {.temperature = 0.0f},
                      .max_tokens = 12};
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<TreeSearchWork>(std::move(job), events, *tokenizer_,
                                                             kPageTokens))
                    .ok());
    run_until(scheduler, [&] { return events->finished(); });
    std::vector<TreeSearchEvent> all;
    events->next(all, std::chrono::milliseconds(0));
    EXPECT_TRUE(events->final_status().ok()) << events->final_status();
    return all;
  };
  const std::vector<TreeSearchEvent> first = run(*scheduler_);
  ASSERT_FALSE(first.empty());
  const TreeSearchEvent& result = first.back();
  ASSERT_EQ(result.kind, TreeSearchEvent::Kind::kFinished);
  // 3 children of the prompt, 2 kept x 3 children at depth 2; 1 pruned at depth 1.
  EXPECT_EQ(result.nodes.size(), 1u + 3u + 6u);
  int pruned = 0;
  for (const TreeSearchEvent& e : first) pruned += e.kind == TreeSearchEvent::Kind::kPruned;
  EXPECT_EQ(pruned, 1);
  ASSERT_EQ(result.best_path.size(), 3u);
  EXPECT_EQ(result.best_path[0], 0);
  int64_t path_tokens = 0;
  for (int32_t id : result.best_path) {
    if (id != 0) path_tokens += static_cast<int64_t>(result.nodes[id].tokens.size());
  }
  EXPECT_EQ(path_tokens, 12);
  expect_only_cached_kv(*scheduler_);
  const std::vector<TreeSearchEvent> second = run(*scheduler_);
  ASSERT_EQ(second.back().kind, TreeSearchEvent::Kind::kFinished);
  EXPECT_EQ(second.back().best_path, result.best_path);
  EXPECT_EQ(second.back().best_text, result.best_text);
}

}  // namespace
}  // namespace deft::engine

namespace deft::engine {
namespace {

// Random interleavings of every session command (valid and invalid node ids, random drafted
// trees) with Generate and RunTree jobs and cancellations: nothing crashes, every command is
// answered, the forest stays consistent, and once everything is closed the KV pool is empty.
TEST_F(SchedulerTest, RandomCommandsKeepTheForestConsistentAndFreeEverything) {
  std::mt19937 random(2026);
  const auto pick = [&](int n) { return static_cast<int>(random() % static_cast<unsigned>(n)); };
  const int kSessions = 3;
  std::vector<std::shared_ptr<SessionEvents>> events(kSessions);
  std::vector<std::vector<NodeId>> nodes(kSessions);
  for (int s = 0; s < kSessions; ++s) {
    events[s] = std::make_shared<SessionEvents>();
    ASSERT_TRUE(scheduler_->open_session(100 + s, events[s]).ok());
  }
  std::vector<std::shared_ptr<GenerateEvents>> jobs;
  std::vector<std::shared_ptr<VerifyReply>> replies;
  const std::vector<std::string> texts = {"Once upon a time", "The king said", "The little fox"};
  for (int round = 0; round < 300; ++round) {
    const int s = pick(kSessions);
    const auto node = [&]() -> NodeId {
      if (nodes[s].empty() || pick(8) == 0) return pick(400);  // often unknown or foreign
      return nodes[s][static_cast<size_t>(pick(static_cast<int>(nodes[s].size())))];
    };
    SessionCommand command{.request_id = static_cast<uint64_t>(round)};
    switch (pick(9)) {
      case 0:
        command.op = CreateCommand{.prompt = encode(texts[static_cast<size_t>(pick(3))])};
        break;
      case 1: {
        ExtendCommand extend{.node = node()};
        extend.tokens = {static_cast<TokenId>(3 + pick(500)), static_cast<TokenId>(3 + pick(500))};
        command.op = std::move(extend);
        break;
      }
      case 2: {
        DecodeCommand decode{.nodes = {node()}};
        if (pick(2) == 0) decode.nodes.push_back(node());
        decode.sampling = {.temperature = pick(2) == 0 ? 0.0f : 1.0f, .seed = 7};
        decode.max_tokens = 1 + pick(4);
        command.op = std::move(decode);
        break;
      }
      case 3: {
        BranchCommand branch{.node = node()};
        branch.k = pick(4);  // 0 is invalid
        command.op = branch;
        break;
      }
      case 4:
        command.op = PruneCommand{.node = node()};
        break;
      case 5: {
        ScoreCommand score{.node = node()};
        score.continuation = {static_cast<TokenId>(3 + pick(500))};
        command.op = std::move(score);
        break;
      }
      case 6: {
        VerifyCommand verify{.node = node()};
        const int entries = 1 + pick(6);
        for (int i = 0; i < entries; ++i) {
          verify.tokens.push_back(static_cast<TokenId>(3 + pick(500)));
          verify.parents.push_back(i == 0 ? -1 : pick(i + 1) - 1);
        }
        verify.sampling = {.temperature = 0.0f};
        verify.reply = std::make_shared<VerifyReply>();
        replies.push_back(verify.reply);
        command.op = std::move(verify);
        break;
      }
      case 7: {
        if (pick(3) == 0 && !jobs.empty()) {
          jobs[static_cast<size_t>(pick(static_cast<int>(jobs.size())))]->cancel();
        } else {
          jobs.push_back(submit_generate(*scheduler_, encode(texts[static_cast<size_t>(pick(3))]),
                                         1 + pick(3), 1 + pick(6)));
        }
        continue;
      }
      default:
        scheduler_->prepare();
        (void)scheduler_->step();
        continue;
    }
    scheduler_->session_command(100 + s, std::move(command));
    for (int i = pick(3); i > 0; --i) {
      scheduler_->prepare();
      (void)scheduler_->step();
    }
    // Learn the node ids the session now holds from its answers.
    std::vector<SessionEvent> batch;
    events[s]->next(batch, std::chrono::milliseconds(0));
    for (const SessionEvent& e : batch) {
      if (e.kind == SessionEvent::Kind::kCreated) nodes[s].push_back(e.node);
      if (e.kind == SessionEvent::Kind::kBranched) {
        nodes[s].insert(nodes[s].end(), e.children.begin(), e.children.end());
      }
    }
    for (const auto& reply : replies) {
      std::vector<VerifyOutcome> outcome;
      reply->next(outcome, std::chrono::milliseconds(0));
      for (const VerifyOutcome& o : outcome) {
        for (int t = 0; t < kSessions; ++t) {
          if (t == s) nodes[t].push_back(o.node);
        }
      }
    }
    ASSERT_TRUE(scheduler_->forest().tree().check_invariants()) << "round " << round;
    ASSERT_TRUE(scheduler_->kv().check_invariants()) << "round " << round;
    const absl::Status invariants = scheduler_->forest().check_invariants();
    ASSERT_TRUE(invariants.ok()) << "round " << round << ": " << invariants;
  }
  size_t learned = 0;
  for (const auto& held : nodes) learned += held.size();
  EXPECT_GT(learned, 20u);  // the commands did real work, not only errors
  for (int s = 0; s < kSessions; ++s) scheduler_->close_session(100 + s);
  for (const auto& job : jobs) job->cancel();
  run_until(*scheduler_, [&] {
    return scheduler_->sessions() == 0 && !scheduler_->has_live() && scheduler_->queued() == 0;
  });
  for (const auto& reply : replies) EXPECT_TRUE(reply->finished());
  expect_only_cached_kv(*scheduler_);
  // Every node left is cached KV, none referenced.
  for (NodeId node : scheduler_->forest().tree().dfs_order()) {
    if (node != scheduler_->forest().tree().root()) {
      EXPECT_FALSE(scheduler_->forest().referenced(node)) << node;
    }
  }
}

}  // namespace
}  // namespace deft::engine

namespace deft::engine {
namespace {

// A CPU runner that claims to sample on its device: the Scheduler then sends every step with a
// decode row through forward_sampled() (here the default forward() + Sampler), the path the CUDA
// runner takes, with the logits of only the rows that want them. Generate, RunTree and session
// decodes (and a score after one, which reads the logits the decode kept) must give exactly the
// tokens of the logits path.
class DeviceSamplingRunner final : public ModelRunner {
 public:
  explicit DeviceSamplingRunner(ModelRunner& inner) : inner_(inner) {}
  const ModelInfo& info() const override { return inner_.info(); }
  absl::Status forward(const StepBatch& batch, std::span<float> logits) override {
    return inner_.forward(batch, logits);
  }
  absl::Status forward_sampled(const StepBatch& batch, std::span<const RowSampling> rows,
                               std::span<SampledToken> out, std::span<float> logits) override {
    ++sampled_steps;
    const bool wants = std::any_of(rows.begin(), rows.end(),
                                   [](const RowSampling& row) { return row.params == nullptr; });
    const bool samples = std::any_of(rows.begin(), rows.end(),
                                     [](const RowSampling& row) { return row.params != nullptr; });
    mixed_steps += wants && samples ? 1 : 0;
    return ModelRunner::forward_sampled(batch, rows, out, logits);
  }
  bool samples_on_device() const override { return true; }
  int sampled_steps = 0;
  int mixed_steps = 0;

 private:
  ModelRunner& inner_;
};

TEST_F(SchedulerTest, DeviceSamplingStepsGiveTheSameTokens) {
  DeviceSamplingRunner device(*runner_);
  Scheduler sampled({.page_tokens = kPageTokens, .kv_pages = kPages, .max_step_tokens = 256},
                    device, *tokenizer_);
  const auto run = [&](Scheduler& scheduler) {
    std::vector<std::shared_ptr<GenerateEvents>> jobs;
    for (int i = 0; i < 4; ++i) {
      auto events = std::make_shared<GenerateEvents>();
      GenerateJob job{.prompt = encode(i % 2 == 0 ? "Once upon a time" : "The king said"),
                      .n = 2 + i % 2, .max_tokens = 9,
                      .sampling = {.temperature = i < 2 ? 0.0f : 0.9f,
                                   .seed = static_cast<uint64_t>(i)}};
      EXPECT_TRUE(scheduler
                      .submit(std::make_unique<GenerateWork>(std::move(job), events, *tokenizer_,
                                                             kPageTokens))
                      .ok());
      jobs.push_back(events);
    }
    auto tree = std::make_shared<TreeSearchEvents>();
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<TreeSearchWork>(
                        TreeSearchJob{.prompt = encode("The little fox"),
                                      .policy = {.branch_factor = 2, .every_tokens = 3,
                                                 .max_depth = 2},
                                      .sampling = {.temperature = 0.8f, .seed = 5},
                                      .max_tokens = 9},
                        tree, *tokenizer_, kPageTokens))
                    .ok());
    // A session: two children decoded together (sampled), then scores after each (from the
    // logits the decode kept), then close; commands queue in order.
    auto session = std::make_shared<SessionEvents>();
    EXPECT_TRUE(scheduler.open_session(9, session).ok());
    scheduler.session_command(
        9, {.request_id = 1, .op = CreateCommand{.prompt = encode("The old tree")}});
    std::vector<SessionEvent> session_events;
    run_until(scheduler, [&] {
      session->next(session_events, std::chrono::milliseconds(0));
      return !session_events.empty();
    });
    const NodeId root = session_events.at(0).node;
    scheduler.session_command(9, {.request_id = 2, .op = BranchCommand{.node = root, .k = 2}});
    run_until(scheduler, [&] {
      session->next(session_events, std::chrono::milliseconds(0));
      return session_events.size() > 1;
    });
    const std::vector<NodeId> children = session_events.at(1).children;
    EXPECT_EQ(children.size(), 2u);
    const NodeId first_child = children.at(0), second_child = children.at(1);
    scheduler.session_command(9, {.request_id = 3,
                                  .op = DecodeCommand{.nodes = {first_child, second_child},
                                                      .sampling = {.temperature = 0.8f, .seed = 3},
                                                      .max_tokens = 7}});
    scheduler.session_command(
        9, {.request_id = 4, .op = ScoreCommand{.node = first_child, .continuation = {5, 6}}});
    scheduler.session_command(
        9, {.request_id = 5, .op = ScoreCommand{.node = second_child, .continuation = {7}}});
    scheduler.session_command(9, {.request_id = 6, .op = CloseCommand{}});
    run_until(scheduler, [&] {
      for (const auto& e : jobs) {
        if (!e->finished()) return false;
      }
      return tree->finished() && session->finished();
    });
    std::vector<std::vector<std::vector<TokenId>>> out;
    for (size_t i = 0; i < jobs.size(); ++i) out.push_back(branches(*jobs[i], 2 + i % 2));
    std::vector<TreeSearchEvent> events;
    tree->next(events, std::chrono::milliseconds(0));
    std::vector<std::vector<TokenId>> tree_nodes;
    for (const TreeSearchNode& node : events.back().nodes) tree_nodes.push_back(node.tokens);
    out.push_back(tree_nodes);
    session->next(session_events, std::chrono::milliseconds(0));
    std::map<NodeId, std::vector<TokenId>> decoded;
    std::vector<TokenId> scores;  // the scores' logprobs, scaled to ids for one comparison
    for (const SessionEvent& e : session_events) {
      EXPECT_NE(e.kind, SessionEvent::Kind::kError) << e.error;
      if (e.kind == SessionEvent::Kind::kDecoded) {
        decoded[e.node].insert(decoded[e.node].end(), e.delta.ids.begin(), e.delta.ids.end());
      }
      if (e.kind == SessionEvent::Kind::kScored) {
        for (float logprob : e.token_logprobs) {
          scores.push_back(static_cast<TokenId>(std::lround(logprob * 1e4)));
        }
      }
    }
    EXPECT_EQ(decoded.size(), 2u);
    for (const auto& [node, ids] : decoded) out.push_back({ids});
    EXPECT_EQ(scores.size(), 3u);
    out.push_back({scores});
    return out;
  };
  EXPECT_EQ(run(sampled), run(*scheduler_));
  EXPECT_GT(device.sampled_steps, 0);
  EXPECT_GT(device.mixed_steps, 0);
  expect_only_cached_kv(sampled);
}

}  // namespace
}  // namespace deft::engine

namespace deft::engine {
namespace {

// The prefix cache (engine/forest.h, engine/prefix_cache.h) under the Scheduler: finished
// requests' KV stays cached and a repeated prompt prefills only what it does not find there.
class PrefixCacheTest : public SchedulerTest {
 protected:
  std::unique_ptr<Scheduler> make(int32_t kv_pages, int64_t prefix_cache_pages = -1) {
    SchedulerOptions options{.page_tokens = kPageTokens,
                             .kv_pages = kv_pages,
                             .max_step_tokens = 256,
                             .prefix_cache_pages = prefix_cache_pages};
    return std::make_unique<Scheduler>(options, *runner_, *tokenizer_);
  }
  static std::vector<TokenId> ids(size_t count, TokenId first) {
    std::vector<TokenId> out;
    for (size_t i = 0; i < count; ++i)
      out.push_back(3 + static_cast<TokenId>((first + i * 7) % 500));
    return out;
  }
  // Runs a greedy Generate to its end; returns its branches and the query rows of each step.
  struct Run {
    std::vector<std::vector<TokenId>> branches;
    std::vector<int64_t> step_rows;
  };
  Run generate(Scheduler& scheduler, std::vector<TokenId> prompt, int32_t n, int32_t max_tokens) {
    std::shared_ptr<GenerateEvents> events =
        submit_generate(scheduler, std::move(prompt), n, max_tokens);
    Run run;
    for (int i = 0; i < 1000 && !events->finished(); ++i) {
      scheduler.prepare();
      if (std::optional<StepStats> stats = scheduler.step()) run.step_rows.push_back(stats->rows);
    }
    EXPECT_TRUE(events->finished());
    run.branches = branches(*events, n);
    return run;
  }
  static int64_t total(const std::vector<int64_t>& rows) {
    int64_t sum = 0;
    for (int64_t r : rows) sum += r;
    return sum;
  }
};

TEST_F(PrefixCacheTest, ARepeatedPromptPrefillsOnlyItsNewTokens) {
  std::unique_ptr<Scheduler> scheduler = make(kPages);
  const std::vector<TokenId> prompt = ids(101, 1);
  const Run cold = generate(*scheduler, prompt, 2, 8);
  expect_only_cached_kv(*scheduler);
  EXPECT_GT(scheduler->forest().cached_pages(), 0) << "the finished job's KV stays cached";
  EXPECT_EQ(scheduler->forest().cache_stats().hit_tokens, 0);
  ASSERT_FALSE(cold.step_rows.empty());
  EXPECT_EQ(cold.step_rows[0], 101) << "a cold prompt is prefilled whole (one step: budget 256)";

  // Again: the cached prompt's whole pages before its last token (96 of 101 tokens, pages of
  // 8) are reused; only the last 5 tokens are prefilled, and the output is the same.
  const Run warm = generate(*scheduler, prompt, 2, 8);
  constexpr int64_t kShared = (101 - 1) / kPageTokens * kPageTokens;
  EXPECT_EQ(scheduler->forest().cache_stats().hit_tokens, kShared);
  ASSERT_FALSE(warm.step_rows.empty());
  EXPECT_EQ(warm.step_rows[0], 101 - kShared);
  EXPECT_EQ(total(cold.step_rows) - total(warm.step_rows), kShared)
      << "the decode rows are the same, the prefill is " << kShared << " rows shorter";
  EXPECT_EQ(warm.branches, cold.branches);
  EXPECT_EQ(warm.branches, generate_alone(prompt, 2, 8));

  // A longer prompt with the same start reuses it too, and decodes as it would cold.
  std::vector<TokenId> longer = prompt;
  const std::vector<TokenId> tail = ids(20, 9);
  longer.insert(longer.end(), tail.begin(), tail.end());
  const Run extended = generate(*scheduler, longer, 1, 6);
  EXPECT_GE(scheduler->forest().cache_stats().hit_tokens, 2 * kShared);
  EXPECT_LT(extended.step_rows[0], static_cast<int64_t>(longer.size()) - kShared + 1);
  EXPECT_EQ(extended.branches, generate_alone(longer, 1, 6));
  EXPECT_EQ(scheduler->forest().cache_stats().evicted_pages, 0);
  expect_only_cached_kv(*scheduler);
}

// A tiny pool: the first job's cached KV leaves too few free pages for the second job's worst
// case; admission counts cached pages as free, so the job is admitted at once, its steps evict
// the cached KV they need, and it decodes as it would alone.
TEST_F(PrefixCacheTest, ATinyPoolEvictsCachedKvToAdmitANewJob) {
  std::unique_ptr<Scheduler> scheduler = make(/*kv_pages=*/16);
  const Run first = generate(*scheduler, ids(60, 1), 1, 20);
  EXPECT_EQ(first.branches, generate_alone(ids(60, 1), 1, 20));
  const int64_t cached = scheduler->forest().cached_pages();
  EXPECT_GE(cached, 8);
  const int64_t worst =
      GenerateWork::max_pages({.prompt = ids(60, 2), .n = 1, .max_tokens = 20}, kPageTokens);
  ASSERT_GT(worst, scheduler->kv().free_pages()) << "the test needs a job that fits only with "
                                                    "the cached pages";
  std::shared_ptr<GenerateEvents> second = submit_generate(*scheduler, ids(60, 2), 1, 20);
  scheduler->prepare();
  EXPECT_EQ(scheduler->queued(), 0) << "admitted at once: cached pages count as free";
  run_until(*scheduler, [&] { return second->finished(); });
  EXPECT_TRUE(second->final_status().ok()) << second->final_status();
  EXPECT_EQ(branches(*second, 1), generate_alone(ids(60, 2), 1, 20));
  EXPECT_GT(scheduler->forest().cache_stats().evicted_pages, 0);
  expect_only_cached_kv(*scheduler);
}

// --no-prefix-cache (prefix_cache_pages 0): finished KV is freed at once, a repeated prompt is
// prefilled whole, and the pool is back to empty after jobs, a RunTree and a session.
TEST_F(PrefixCacheTest, NoPrefixCacheFreesEverythingAsBefore) {
  std::unique_ptr<Scheduler> scheduler = make(kPages, /*prefix_cache_pages=*/0);
  const std::vector<TokenId> prompt = ids(101, 1);
  const Run cold = generate(*scheduler, prompt, 2, 8);
  EXPECT_EQ(scheduler->kv().used_pages(), 0);
  const Run again = generate(*scheduler, prompt, 2, 8);
  EXPECT_EQ(again.step_rows, cold.step_rows);
  EXPECT_EQ(again.branches, cold.branches);
  auto tree = std::make_shared<TreeSearchEvents>();
  ASSERT_TRUE(
      scheduler
          ->submit(std::make_unique<TreeSearchWork>(
              TreeSearchJob{
                  .prompt = prompt,
                  .policy = {.branch_factor = 2, .every_tokens = 3, .max_depth = 2, .keep_best = 1},
                  .sampling = {.temperature = 0.0f},
                  .max_tokens = 8},
              tree, *tokenizer_, kPageTokens))
          .ok());
  auto session = std::make_shared<SessionEvents>();
  ASSERT_TRUE(scheduler->open_session(1, session).ok());
  scheduler->session_command(1, {.request_id = 1, .op = CreateCommand{.prompt = prompt}});
  scheduler->session_command(1, {.request_id = 2, .op = CloseCommand{}});
  run_until(*scheduler, [&] { return tree->finished() && scheduler->sessions() == 0; });
  EXPECT_EQ(scheduler->kv().used_pages(), 0);
  EXPECT_EQ(scheduler->forest().tree().num_live_nodes(), 1);
  EXPECT_EQ(scheduler->forest().cached_pages(), 0);
  EXPECT_EQ(scheduler->forest().cache_stats().hit_tokens, 0);
  EXPECT_EQ(scheduler->forest().cache_stats().evicted_pages, 0);
  const absl::Status invariants = scheduler->forest().check_invariants();
  EXPECT_TRUE(invariants.ok()) << invariants;
}

// Random Generate and RunTree jobs, cancellations, and sessions (create, extend, decode,
// branch, prune, score, verify) on a pool small enough that cached KV is evicted all the time.
// After every prepare() and step() the forest's invariants hold, and every node a session
// holds (pins) is still there with its path's tokens and KV pages unchanged (only grown):
// eviction never frees KV that a live work or a session uses.
TEST_F(PrefixCacheTest, RandomWorkOnASmallPoolNeverEvictsReferencedKv) {
  for (uint32_t seed : {11u, 12u, 13u, 14u, 15u}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 random(seed);
    const auto pick = [&](int n) { return static_cast<int>(random() % static_cast<unsigned>(n)); };
    std::unique_ptr<Scheduler> scheduler = make(/*kv_pages=*/48);
    const Forest& forest = scheduler->forest();
    // The pinned nodes of each session, with their path when learned and its ancestors.
    struct Pinned {
      std::vector<NodeId> path;  // root first, the node last
      std::vector<TokenId> tokens;
      std::vector<int32_t> pages;
    };
    const auto snapshot = [&](NodeId node) {
      Pinned pinned{.path = *forest.tree().path(node)};
      for (NodeId id : pinned.path) {
        const NodeTokens& own = forest.tree().node(id).tokens;
        pinned.tokens.insert(pinned.tokens.end(), own.begin(), own.end());
        const std::span<const int32_t> pages = scheduler->kv().pages(forest.tree().kv_key(id));
        pinned.pages.insert(pinned.pages.end(), pages.begin(), pages.end());
      }
      return pinned;
    };
    const auto check = [&](const std::map<NodeId, Pinned>& session_pins, int round) {
      const absl::Status invariants = forest.check_invariants();
      ASSERT_TRUE(invariants.ok()) << "round " << round << ": " << invariants;
      for (const auto& [node, before] : session_pins) {
        ASSERT_TRUE(forest.tree().contains(node)) << "round " << round << ": pinned " << node;
        ASSERT_GT(forest.holds(node), 0) << "round " << round << ": pinned " << node;
        const Pinned now = snapshot(node);
        ASSERT_GE(now.pages.size(), before.pages.size());
        ASSERT_TRUE(std::equal(before.pages.begin(), before.pages.end(), now.pages.begin()))
            << "round " << round << ": node " << node << " lost KV pages of its path";
        ASSERT_TRUE(std::equal(before.tokens.begin(), before.tokens.end(), now.tokens.begin()))
            << "round " << round << ": node " << node << " lost tokens of its path";
      }
    };
    constexpr int kSessions = 2;
    std::vector<std::shared_ptr<SessionEvents>> events(kSessions);
    std::vector<std::map<NodeId, Pinned>> pins(kSessions);
    for (int s = 0; s < kSessions; ++s) {
      events[s] = std::make_shared<SessionEvents>();
      ASSERT_TRUE(scheduler->open_session(200 + s, events[s]).ok());
    }
    // Prompts from a few stems, so that they share prefixes (and cached KV).
    const auto prompt = [&]() {
      std::vector<TokenId> out = ids(static_cast<size_t>(8 + pick(40)), 1 + pick(3));
      const std::vector<TokenId> tail = ids(static_cast<size_t>(1 + pick(12)), 100 + pick(50));
      out.insert(out.end(), tail.begin(), tail.end());
      return out;
    };
    // Learns the pinned nodes from the sessions' answers, in order (a prune drops the nodes
    // below the pruned one).
    size_t learned = 0;  // nodes created
    const auto learn = [&] {
      for (int t = 0; t < kSessions; ++t) {
        std::vector<SessionEvent> batch;
        events[t]->next(batch, std::chrono::milliseconds(0));
        for (const SessionEvent& e : batch) {
          // Refusals are fine (unknown nodes, a full session); a failed step is not.
          EXPECT_NE(e.error.code(), absl::StatusCode::kInternal) << e.error;
          if (e.kind == SessionEvent::Kind::kCreated) pins[t][e.node] = snapshot(e.node);
          if (e.kind == SessionEvent::Kind::kBranched) {
            for (NodeId child : e.children) pins[t][child] = snapshot(child);
          }
          learned += e.kind == SessionEvent::Kind::kCreated ? 1 : 0;
          if (e.kind == SessionEvent::Kind::kVerified && e.verified.node >= 0) {
            pins[t][e.verified.node] = snapshot(e.verified.node);
          }
          if (e.kind == SessionEvent::Kind::kPruned) {
            std::erase_if(pins[t], [&](const auto& entry) {
              const std::vector<NodeId>& path = entry.second.path;
              return std::find(path.begin(), path.end(), e.node) != path.end();
            });
          }
        }
      }
    };
    std::vector<std::shared_ptr<GenerateEvents>> jobs;
    std::vector<std::shared_ptr<TreeSearchEvents>> trees;
    for (int round = 0; round < 200; ++round) {
      const int s = pick(kSessions);
      std::map<NodeId, Pinned>& held = pins[s];
      const auto node = [&]() -> NodeId {
        if (held.empty()) return 999999;
        auto it = held.begin();
        std::advance(it, pick(static_cast<int>(held.size())));
        return it->first;
      };
      SessionCommand command{.request_id = static_cast<uint64_t>(round)};
      bool to_session = true;
      switch (pick(11)) {
        case 0:
          command.op = CreateCommand{.prompt = prompt()};
          break;
        case 1:
          command.op = ExtendCommand{.node = node(), .tokens = ids(1 + pick(10), pick(400))};
          break;
        case 2:
          command.op = DecodeCommand{
              .nodes = {node()}, .sampling = {.temperature = 0.0f}, .max_tokens = 1 + pick(6)};
          break;
        case 3:
          command.op = BranchCommand{.node = node(), .k = 1 + pick(2)};
          break;
        case 4:
          command.op = PruneCommand{.node = node()};
          break;
        case 5:
          command.op = ScoreCommand{.node = node(), .continuation = ids(1 + pick(4), pick(400))};
          break;
        case 6: {
          VerifyCommand verify{.node = node(), .sampling = {.temperature = 0.0f}};
          for (int i = 0, entries = 1 + pick(5); i < entries; ++i) {
            verify.tokens.push_back(static_cast<TokenId>(3 + pick(500)));
            verify.parents.push_back(i == 0 ? -1 : pick(i + 1) - 1);
          }
          command.op = std::move(verify);
          break;
        }
        case 7:
          to_session = false;
          if (pick(4) == 0 && !jobs.empty()) {
            jobs[static_cast<size_t>(pick(static_cast<int>(jobs.size())))]->cancel();
          } else {
            const auto events_of = std::make_shared<GenerateEvents>();
            GenerateJob job{.prompt = prompt(),
                            .n = 1 + pick(3),
                            .max_tokens = 1 + pick(12),
                            .sampling = {.temperature = 0.0f}};
            (void)scheduler->submit(std::make_unique<GenerateWork>(std::move(job), events_of,
                                                                   *tokenizer_, kPageTokens));
            jobs.push_back(events_of);
          }
          break;
        case 8: {
          to_session = false;
          auto tree = std::make_shared<TreeSearchEvents>();
          (void)scheduler->submit(std::make_unique<TreeSearchWork>(
              TreeSearchJob{
                  .prompt = prompt(),
                  .policy = {.branch_factor = 2, .every_tokens = 2, .max_depth = 2, .keep_best = 1},
                  .sampling = {.temperature = 0.0f},
                  .max_tokens = 6},
              tree, *tokenizer_, kPageTokens));
          trees.push_back(tree);
          break;
        }
        default:
          to_session = false;
          break;
      }
      if (to_session) scheduler->session_command(200 + s, std::move(command));
      for (int i = 1 + pick(3); i > 0; --i) {
        scheduler->prepare();  // runs branch and prune commands
        learn();
        check(pins[0], round);
        check(pins[1], round);
        (void)scheduler->step();
        learn();
        check(pins[0], round);
        check(pins[1], round);
      }
    }
    for (const auto& job : jobs) {
      if (job->finished()) {
        EXPECT_NE(job->final_status().code(), absl::StatusCode::kInternal);
      }
    }
    EXPECT_GT(learned, 5u) << "the sessions did real work, not only errors";
    EXPECT_GT(forest.cache_stats().hit_tokens, 0) << "prompts shared cached prefixes";
    EXPECT_GT(forest.cache_stats().evicted_pages, 0) << "the pool was small enough to evict";
    for (int s = 0; s < kSessions; ++s) scheduler->close_session(200 + s);
    for (const auto& job : jobs) job->cancel();
    for (const auto& tree : trees) tree->cancel();
    run_until(*scheduler, [&] {
      return scheduler->sessions() == 0 && !scheduler->has_live() && scheduler->queued() == 0;
    });
    expect_only_cached_kv(*scheduler);
  }
}

}  // namespace
}  // namespace deft::engine
