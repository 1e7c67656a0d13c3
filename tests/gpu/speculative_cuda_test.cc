// Server-side speculative decoding on the CUDA backend: the embedded default model as the target
// and its trained draft (models/default-draft), both LlamaCudaRunners, through the engine
// Scheduler. Speculative Generates of every policy must give the tokens plain decoding gives on
// the same runner; the draft passes must replay CUDA graphs; both KV pools must end with nothing
// referenced.
//
// Exactness on a GPU: a tree's rows run in a larger batch than plain decoding's one row per
// branch, and cuBLAS picks kernels by shape, so a logit may differ in its last bits. Greedy
// output of this model (its margins are wide: it knows its corpus by heart) must match exactly;
// sampled output must match for nearly every job (a draw falling within a rounding error of a
// probability boundary may flip; issue 37's deterministic mode is what removes that).
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/generate_work.h"
#include "models/llama_cuda.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::engine {
namespace {

using kernels::cuda_device_visible;

constexpr int32_t kPageTokens = 16;
constexpr int32_t kPages = 1024;

std::string source_dir() {
  const char* root = std::getenv("DEFT_SOURCE_DIR");
  return root != nullptr ? root : DEFT_SOURCE_DIR;
}

std::unique_ptr<models::LlamaCudaRunner> load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> runner =
      models::LlamaCudaRunner::load(dir, {.num_kv_slots = int64_t{kPages} * kPageTokens,
                                          .page_tokens = kPageTokens,
                                          .max_batch_rows = 1024});
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? std::move(*runner) : nullptr;
}

struct Job {
  std::vector<TokenId> prompt;
  int32_t n = 1;
  int32_t max_tokens = 48;
  SamplingParams sampling;
};

std::vector<std::vector<std::vector<TokenId>>> run(Scheduler& scheduler, const Tokenizer& tokenizer,
                                                   const std::vector<Job>& jobs,
                                                   std::shared_ptr<const SpeculativeOptions> spec) {
  std::vector<std::shared_ptr<GenerateEvents>> events;
  for (const Job& job : jobs) {
    auto queue = std::make_shared<GenerateEvents>();
    GenerateJob generate{.prompt = job.prompt,
                         .n = job.n,
                         .max_tokens = job.max_tokens,
                         .sampling = job.sampling,
                         .speculative = spec};
    EXPECT_TRUE(scheduler
                    .submit(std::make_unique<GenerateWork>(std::move(generate), queue, tokenizer,
                                                           kPageTokens))
                    .ok());
    events.push_back(queue);
  }
  const auto done = [&] {
    for (const auto& e : events) {
      if (!e->finished()) return false;
    }
    return true;
  };
  for (int i = 0; i < 20000 && !done(); ++i) {
    scheduler.prepare();
    (void)scheduler.step();
  }
  EXPECT_TRUE(done()) << "live " << scheduler.live() << ", queued " << scheduler.queued();
  std::vector<std::vector<std::vector<TokenId>>> out;
  for (size_t j = 0; j < jobs.size(); ++j) {
    std::vector<std::vector<TokenId>> branches(static_cast<size_t>(jobs[j].n));
    // An unfinished job's queue never ends: take what it has without waiting for its end.
    if (!events[j]->finished()) events[j]->cancel();
    if (!events[j]->finished()) {
      out.push_back(std::move(branches));
      continue;
    }
    std::vector<GenerateEvent> batch;
    while (events[j]->next(batch, std::chrono::milliseconds(0))) {
      for (const GenerateEvent& event : batch) {
        auto& ids = branches[static_cast<size_t>(event.branch)];
        ids.insert(ids.end(), event.delta.ids.begin(), event.delta.ids.end());
      }
      batch.clear();
    }
    EXPECT_TRUE(events[j]->final_status().ok()) << events[j]->final_status();
    out.push_back(std::move(branches));
  }
  return out;
}

TEST(SpeculativeCuda, EveryPolicyGivesThePlainTokensWithTheTrainedDraft) {
  DEFT_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      load_tokenizer(source_dir() + "/models/default");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::unique_ptr<models::LlamaCudaRunner> target = load(source_dir() + "/models/default");
  std::unique_ptr<models::LlamaCudaRunner> draft = load(source_dir() + "/models/default-draft");
  ASSERT_NE(target, nullptr);
  ASSERT_NE(draft, nullptr);
  const std::vector<std::string> texts = {
      "Once upon a time",  "The little fox",   "The king said", "In the forest there was a",
      "Every morning the", "Under the bridge", "The old man",   "A mathematician"};
  std::vector<Job> jobs;
  for (size_t i = 0; i < texts.size() * 2; ++i) {
    Job job{.prompt = *(*tokenizer)->encode(texts[i % texts.size()], true, false),
            .n = 1 + static_cast<int32_t>(i % 3),
            .max_tokens = 24 + static_cast<int32_t>(i * 5) % 40};
    job.sampling = i < texts.size()
                       ? SamplingParams{.temperature = 0.0f}
                       : SamplingParams{.temperature = 0.8f, .top_p = 0.95f, .seed = 77 + i};
    jobs.push_back(std::move(job));
  }
  const SchedulerOptions options{
      .page_tokens = kPageTokens, .kv_pages = kPages, .max_step_tokens = 1024};
  std::vector<std::vector<std::vector<TokenId>>> plain;
  {
    Scheduler scheduler(options, *target, **tokenizer);
    plain = run(scheduler, **tokenizer, jobs, nullptr);
  }
  const std::vector<SpeculativeOptions> policies = {
      {.policy = TreePolicy::kStatic, .tree_tokens = 63, .depth = 6},
      {.policy = TreePolicy::kDynamic, .tree_tokens = 32, .depth = 6, .top_k = 8},
      {.policy = TreePolicy::kNgram, .tree_tokens = 16, .depth = 6, .top_k = 4}};
  for (const SpeculativeOptions& policy : policies) {
    SCOPED_TRACE(absl::StrCat("policy ", static_cast<int>(policy.policy)));
    const int64_t graphs_before = draft->cuda_graph_stats().graph_steps;
    Scheduler scheduler(options, *target, **tokenizer, draft.get());
    const auto got =
        run(scheduler, **tokenizer, jobs, std::make_shared<const SpeculativeOptions>(policy));
    int sampled_equal = 0;
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (jobs[j].sampling.temperature == 0.0f) {
        EXPECT_EQ(got[j], plain[j]) << "greedy job " << j;
      } else {
        sampled_equal += got[j] == plain[j] ? 1 : 0;
      }
    }
    EXPECT_GE(sampled_equal, static_cast<int>(texts.size()) - 1)
        << "sampled jobs equal to plain decoding: " << sampled_equal << " of " << texts.size();
    EXPECT_EQ(scheduler.forest().referenced_pages(), 0);
    EXPECT_EQ(scheduler.draft()->forest().referenced_pages(), 0);
    if (policy.policy != TreePolicy::kNgram) {
      EXPECT_GT(draft->cuda_graph_stats().graph_steps, graphs_before)
          << "the draft passes should replay CUDA graphs";
    }
  }
}

}  // namespace
}  // namespace deft::engine
