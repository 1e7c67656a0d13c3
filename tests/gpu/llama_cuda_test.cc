// The CUDA runner (models/llama_cuda.h) on the GPU machine:
//   - parity with Hugging Face transformers on the goldens (tests/models/golden: float64
//     references of small fp32 models, which the runner rounds to bf16): logits of every prompt
//     position and of a token tree prefilled in one step, within kBf16LogitBound; greedy
//     continuations of every branch, all branches decoded together, token for token up to the
//     first step whose reference top-1/top-2 margin is too thin for bf16 (below
//     kMarginFactor x the worst absolute logit error measured on that model);
//   - tree decoding equals each branch decoded alone (the default model);
//   - the CUDA runner against the fp32 CPU runner: the default model (generic attention kernel,
//     head_dim 32) and tiny random models with head_dim 64 and 128 (the DeFT kernels);
//   - random weights of a Llama-3-8B-shaped model (2 layers) with the KV pool planned from free
//     memory: a prefill and tree decode steps give finite logits.
// Errors are max |ours - ref| / max |ref| per logits row, printed per case.
#include "models/llama_cuda.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "models/llama_cpu.h"
#include "models/safetensors.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/models/tiny_llama.h"

namespace deft::models {
namespace {

using engine::NodeId;
using engine::SequenceTree;
using engine::TokenId;
using kernels::cuda_device_visible;
using testing::argmax;
using testing::relative_error;
using testing::RunnerHarness;
using testing::TreeStep;
using testing::GoldenTree;
using testing::build_golden_tree;

// bf16 weights and activations against a float64 reference: relative logit error bound.
constexpr double kBf16LogitBound = 3e-2;
// A greedy step may differ from the reference only where its top-1/top-2 margin is below
// kMarginFactor x the worst absolute logit error seen on that model (two logits moving by the
// error in opposite directions can swap at 2x; 2x more for headroom).
constexpr double kMarginFactor = 4.0;
constexpr int kGreedySteps = 32;

// Data under the source tree; DEFT_SOURCE_DIR in the environment overrides the build's path
// (the GPU machine runs a copy of the binary next to copies of the models).
std::string source_path(const std::string& relative) {
  const char* root = std::getenv("DEFT_SOURCE_DIR");
  return absl::StrCat(root != nullptr ? root : DEFT_SOURCE_DIR, "/", relative);
}

double max_abs_error(std::span<const float> a, std::span<const float> b) {
  double worst = 0.0;
  for (size_t i = 0; i < b.size(); ++i) worst = std::max(worst, std::abs(double{a[i]} - b[i]));
  return worst;
}

// Runs steps of any runner: plans the parts, returns logits of every row.
class Stepper {
 public:
  Stepper(engine::ModelRunner& runner, engine::PlannerOptions options = {.chunk_tokens = 16})
      : runner_(runner), planner_(options) {}

  std::vector<std::vector<float>> step(std::span<const TreeStep> parts) {
    std::vector<engine::TreeQueries> trees;
    std::vector<TokenId> tokens;
    for (const TreeStep& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
    }
    const absl::Status planned = planner_.plan(trees, plan_);
    EXPECT_TRUE(planned.ok()) << planned;
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    const size_t vocab = static_cast<size_t>(runner_.vocab_size());
    std::vector<float> logits(rows.size() * vocab);
    const absl::Status ran =
        runner_.forward({.plan = &plan_, .tokens = tokens, .logit_rows = rows}, logits);
    EXPECT_TRUE(ran.ok()) << ran;
    std::vector<std::vector<float>> out(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      out[r].assign(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
    }
    return out;
  }

 private:
  engine::ModelRunner& runner_;
  engine::AttentionPlanner planner_;
  engine::AttentionPlan plan_;
};

std::unique_ptr<LlamaCudaRunner> load_cuda(const std::string& dir, int64_t slots) {
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> runner =
      LlamaCudaRunner::load(dir, {.num_kv_slots = slots, .max_batch_rows = 512});
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? std::move(*runner) : nullptr;
}

// ---- Goldens ------------------------------------------------------------------------------

class LlamaCudaGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCudaGoldenTest, LogitsTreeAndGreedyMatchTransformers) {
  DEFT_SKIP_WITHOUT_GPU();
  const std::string dir = source_path("tests/models/golden/" + GetParam());
  std::ifstream file(dir + "/golden.json");
  ASSERT_TRUE(file.good()) << dir;
  std::stringstream text;
  text << file.rdbuf();
  const nlohmann::json spec = nlohmann::json::parse(text.str());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> tensors =
      SafetensorsFile::open(dir + "/golden.safetensors");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  const auto reference_rows = [&](const std::string& name) {
    absl::StatusOr<TensorView> view = (*tensors)->tensor(name);
    EXPECT_TRUE(view.ok()) << view.status();
    const std::vector<float> values = tensor_to_floats(*view);
    const size_t vocab = static_cast<size_t>(view->shape[1]);
    std::vector<std::vector<float>> rows(static_cast<size_t>(view->shape[0]));
    for (size_t r = 0; r < rows.size(); ++r) {
      rows[r].assign(values.begin() + r * vocab, values.begin() + (r + 1) * vocab);
    }
    return rows;
  };
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  std::unique_ptr<LlamaCudaRunner> runner = load_cuda(dir, kv.num_slots());
  ASSERT_NE(runner, nullptr);
  Stepper stepper(*runner, {.kind = engine::PlanKind::kDeftFlatten, .chunk_tokens = 8});
  double worst = 0.0, worst_abs = 0.0;
  const auto check = [&](std::span<const float> ours, std::span<const float> reference,
                         const std::string& where) {
    const double error = relative_error(ours, reference);
    worst = std::max(worst, error);
    worst_abs = std::max(worst_abs, max_abs_error(ours, reference));
    EXPECT_LT(error, kBf16LogitBound) << GetParam() << " " << where;
  };

  // (a) prompts.
  uint32_t tree_id = 1;
  for (const nlohmann::json& prompt : spec["prompts"]) {
    SequenceTree tree(tree_id++, &kv);
    const TreeStep step =
        RunnerHarness::append(tree, tree.root(), prompt["tokens"].get<std::vector<TokenId>>());
    const std::vector<std::vector<float>> ours = stepper.step({&step, 1});
    const std::vector<std::vector<float>> reference =
        reference_rows(prompt["logits"].get<std::string>());
    ASSERT_EQ(ours.size(), reference.size());
    for (size_t row = 0; row < ours.size(); ++row) {
      check(ours[row], reference[row], absl::StrCat("prompt row ", row));
    }
  }
  const double worst_prompt = worst;

  // (b) the token tree in one step, each branch against transformers running it alone.
  const nlohmann::json& tree_spec = spec["tree"];
  const nlohmann::json& golden_nodes = tree_spec["nodes"];
  const nlohmann::json& branches = tree_spec["branches"];
  SequenceTree tree(100, &kv);
  const std::vector<TokenId> prompt = tree_spec["prompt"].get<std::vector<TokenId>>();
  GoldenTree golden_tree = build_golden_tree(tree_spec, tree);
  TreeStep& all = golden_tree.all;
  const std::vector<NodeId>& node_ids = golden_tree.node_ids;
  const auto& row_of = golden_tree.row_of;
  const std::vector<std::vector<float>> tree_logits = stepper.step({&all, 1});
  std::vector<NodeId> leaves;
  std::vector<std::vector<float>> leaf_logits;
  for (size_t b = 0; b < branches.size(); ++b) {
    const nlohmann::json& branch = branches[b];
    const std::vector<std::vector<float>> reference =
        reference_rows(branch["logits"].get<std::string>());
    std::vector<size_t> rows = {row_of.at({tree.root(), static_cast<int32_t>(prompt.size()) - 1})};
    for (int node : branch["path"].get<std::vector<int>>()) {
      const NodeId id = node_ids.at(static_cast<size_t>(node));
      for (size_t t = 0; t < golden_nodes[node]["tokens"].size(); ++t) {
        rows.push_back(row_of.at({id, static_cast<int32_t>(t)}));
      }
    }
    ASSERT_EQ(rows.size(), reference.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      check(tree_logits[rows[i]], reference[i], absl::StrCat("branch ", b, " row ", i));
    }
    leaves.push_back(node_ids.at(static_cast<size_t>(branch["path"].back().get<int>())));
    leaf_logits.push_back(tree_logits[rows.back()]);
  }
  const double worst_tree = worst;
  const double margin_floor = kMarginFactor * worst_abs;

  // (c) greedy continuations, all branches in one step each.
  std::vector<int> horizon(branches.size()), identical(branches.size(), 0);
  std::vector<bool> diverged(branches.size(), false);
  double worst_greedy = 0.0;
  for (size_t b = 0; b < branches.size(); ++b) {
    const std::vector<double> margins = branches[b]["greedy_margins"].get<std::vector<double>>();
    horizon[b] = static_cast<int>(margins.size());
    for (size_t s = 0; s < margins.size(); ++s) {
      if (margins[s] < margin_floor) {
        horizon[b] = static_cast<int>(s);
        break;
      }
    }
  }
  const size_t steps = std::min<size_t>(branches[0]["greedy_tokens"].size(), 64);
  for (size_t s = 0; s < steps; ++s) {
    TreeStep decode{.tree = &tree};
    for (size_t b = 0; b < branches.size(); ++b) {
      const nlohmann::json& branch = branches[b];
      const TokenId token = argmax(leaf_logits[b]);
      if (!diverged[b]) {
        if (token == branch["greedy_tokens"][s].get<TokenId>()) {
          ++identical[b];
          const std::vector<int> logit_steps = branch["greedy_logit_steps"].get<std::vector<int>>();
          const auto at = std::find(logit_steps.begin(), logit_steps.end(), static_cast<int>(s));
          if (at != logit_steps.end()) {
            const double error = relative_error(
                leaf_logits[b],
                reference_rows(
                    branch["greedy_logits"].get<std::string>())[at - logit_steps.begin()]);
            worst_greedy = std::max(worst_greedy, error);
            EXPECT_LT(error, kBf16LogitBound) << GetParam() << " branch " << b << " step " << s;
          }
        } else {
          diverged[b] = true;
          EXPECT_GE(static_cast<int>(s), std::min(horizon[b], kGreedySteps))
              << GetParam() << " branch " << b << " step " << s << ": greedy token " << token
              << ", transformers " << branch["greedy_tokens"][s] << ", reference margin "
              << branch["greedy_margins"][s] << " (floor " << margin_floor << ")";
        }
      }
      const TreeStep part = RunnerHarness::append(tree, leaves[b], {&token, 1});
      decode.queries.push_back(part.queries[0]);
      decode.tokens.push_back(token);
    }
    leaf_logits = stepper.step({&decode, 1});
  }
  std::string per_branch;
  for (size_t b = 0; b < branches.size(); ++b) {
    absl::StrAppend(&per_branch, b == 0 ? "" : ", ", identical[b], "/", horizon[b]);
  }
  std::printf(
      "[cuda parity] %s (%s attention): max relative logit error %.3g (prompts), %.3g "
      "(tree), %.3g (greedy steps); bound %.3g; max abs error %.3g -> margin floor %.3g; "
      "greedy tokens identical / margin horizon per branch: %s\n",
      GetParam().c_str(), runner->uses_deft_kernels() ? "DeFT" : "generic", worst_prompt,
      worst_tree, worst_greedy, kBf16LogitBound, worst_abs, margin_floor, per_branch.c_str());
}

INSTANTIATE_TEST_SUITE_P(Goldens, LlamaCudaGoldenTest,
                         ::testing::Values("llama3", "llama2", "qwen2", "mistral"));

// ---- Tree decoding = each branch alone ---------------------------------------------------------

// Prefills `prompt`, forks `first_tokens.size()` branches (branch i starts with first_tokens[i])
// and decodes `steps` greedy tokens per branch, all branches in one step.
std::vector<std::vector<TokenId>> decode_tree(
    engine::ModelRunner& runner, engine::KvCacheManager& kv, uint32_t tree_id,
    std::span<const TokenId> prompt, std::span<const TokenId> first_tokens, int steps,
    std::vector<std::vector<std::vector<float>>>* logits) {
  Stepper stepper(runner);
  SequenceTree tree(tree_id, &kv);
  const TreeStep prefill = RunnerHarness::append(tree, tree.root(), prompt);
  stepper.step({&prefill, 1});
  const std::vector<NodeId> leaves =
      *tree.branch(tree.root(), static_cast<int32_t>(first_tokens.size()));
  std::vector<std::vector<TokenId>> tokens(first_tokens.size());
  std::vector<TokenId> next(first_tokens.begin(), first_tokens.end());
  logits->assign(first_tokens.size(), {});
  for (int s = 0; s < steps; ++s) {
    TreeStep decode{.tree = &tree};
    for (size_t b = 0; b < leaves.size(); ++b) {
      const TreeStep part = RunnerHarness::append(tree, leaves[b], {&next[b], 1});
      decode.queries.push_back(part.queries[0]);
      decode.tokens.push_back(next[b]);
      tokens[b].push_back(next[b]);
    }
    const std::vector<std::vector<float>> out = stepper.step({&decode, 1});
    for (size_t b = 0; b < leaves.size(); ++b) {
      (*logits)[b].push_back(out[b]);
      next[b] = argmax(out[b]);
    }
  }
  return tokens;
}

TEST(LlamaCuda, TreeDecodingEqualsEachBranchAlone) {
  DEFT_SKIP_WITHOUT_GPU();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 128});
  std::unique_ptr<LlamaCudaRunner> runner =
      load_cuda(source_path("models/default"), kv.num_slots());
  ASSERT_NE(runner, nullptr);
  std::vector<TokenId> prompt;
  std::mt19937 rng(7);
  for (int i = 0; i < 37; ++i) prompt.push_back(3 + static_cast<TokenId>(rng() % 500));
  const std::vector<TokenId> firsts = {40, 41, 300, 301, 7};
  std::vector<std::vector<std::vector<float>>> together_logits;
  const std::vector<std::vector<TokenId>> together =
      decode_tree(*runner, kv, 1, prompt, firsts, kGreedySteps, &together_logits);
  double worst = 0.0;
  for (size_t b = 0; b < firsts.size(); ++b) {
    std::vector<std::vector<std::vector<float>>> alone_logits;
    const std::vector<std::vector<TokenId>> alone =
        decode_tree(*runner, kv, static_cast<uint32_t>(10 + b), prompt, {&firsts[b], 1},
                    kGreedySteps, &alone_logits);
    EXPECT_EQ(alone[0], together[b]) << "branch " << b;
    for (size_t s = 0; s < alone_logits[0].size(); ++s) {
      if (alone[0][s] != together[b][s]) break;
      worst = std::max(worst, relative_error(together_logits[b][s], alone_logits[0][s]));
    }
  }
  EXPECT_LT(worst, 1e-2);
  std::printf(
      "[cuda tree=alone] default model, %zu branches x %d steps: tokens identical, max "
      "relative logit difference %.3g\n",
      firsts.size(), kGreedySteps, worst);
}

// ---- CUDA vs CPU runner ----------------------------------------------------------------------

// A prompt and a token tree in one step, then greedy decode of 4 branches; the CUDA runner's
// logits against the CPU runner's on the same weights.
void compare_with_cpu(engine::ModelRunner& cuda, engine::ModelRunner& cpu, const char* name) {
  const std::vector<TokenId> firsts = {11, 12, 13, 14};
  std::vector<TokenId> prompt;
  std::mt19937 rng(3);
  for (int i = 0; i < 50; ++i) {
    prompt.push_back(3 + static_cast<TokenId>(rng() % (cuda.vocab_size() - 3)));
  }
  std::vector<std::vector<std::vector<float>>> gpu_logits, cpu_logits;
  engine::KvCacheManager kv_gpu({.page_tokens = 16, .num_pages = 64});
  engine::KvCacheManager kv_cpu({.page_tokens = 16, .num_pages = 64});
  const std::vector<std::vector<TokenId>> gpu_tokens =
      decode_tree(cuda, kv_gpu, 1, prompt, firsts, kGreedySteps, &gpu_logits);
  const std::vector<std::vector<TokenId>> cpu_tokens =
      decode_tree(cpu, kv_cpu, 1, prompt, firsts, kGreedySteps, &cpu_logits);
  double worst = 0.0;
  std::string identical;
  for (size_t b = 0; b < firsts.size(); ++b) {
    size_t same = 0;
    while (same < cpu_tokens[b].size() && gpu_tokens[b][same] == cpu_tokens[b][same]) ++same;
    // Logits are comparable while the inputs agree: step s's input is token s.
    for (size_t s = 0; s < same; ++s) {
      const double error = relative_error(gpu_logits[b][s], cpu_logits[b][s]);
      worst = std::max(worst, error);
      EXPECT_LT(error, kBf16LogitBound) << name << " branch " << b << " step " << s;
    }
    absl::StrAppend(&identical, b == 0 ? "" : ", ", same);
  }
  std::printf(
      "[cuda vs cpu] %s: max relative logit error %.3g (bound %.3g); identical greedy "
      "inputs per branch (of %d): %s\n",
      name, worst, kBf16LogitBound, kGreedySteps, identical.c_str());
}

TEST(LlamaCuda, MatchesCpuRunnerOnDefaultModel) {
  DEFT_SKIP_WITHOUT_GPU();
  const std::string dir = source_path("models/default");
  std::unique_ptr<LlamaCudaRunner> cuda = load_cuda(dir, 1024);
  ASSERT_NE(cuda, nullptr);
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> cpu = LlamaCpuRunner::load(dir, 1024);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  compare_with_cpu(*cuda, **cpu, "default model (bf16 checkpoint, head_dim 32)");
}

TEST(LlamaCuda, DeftKernelPathMatchesCpuRunner) {
  DEFT_SKIP_WITHOUT_GPU();
  for (int head_dim : {64, 128}) {
    const testing::TinyLlama model =
        testing::make_tiny_deft_llama(head_dim, static_cast<uint64_t>(head_dim));
    absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> cuda = LlamaCudaRunner::create(
        model.config, model.checkpoint, {.num_kv_slots = 1024, .max_batch_rows = 256}, "tiny");
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    EXPECT_TRUE((*cuda)->uses_deft_kernels());
    absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> cpu =
        LlamaCpuRunner::create(model.config, model.checkpoint, 1024, "tiny");
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    compare_with_cpu(
        **cuda, **cpu,
        head_dim == 64 ? "tiny head_dim 64 (DeFT kernels)" : "tiny head_dim 128 (DeFT kernels)");
  }
}

// A runner on the last GPU, driven from a thread whose current device is the first (and a runner
// on the first beside it): both match the CPU runner, and each call gives the thread's current
// device back. Needs two GPUs.
TEST(LlamaCuda, RunnersOnTwoDevicesFromOneThread) {
  DEFT_SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices, found " << count;
  const testing::TinyLlama model = testing::make_tiny_deft_llama(128, 7);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> last = LlamaCudaRunner::create(
      model.config, model.checkpoint,
      {.num_kv_slots = 1024, .max_batch_rows = 256, .device = count - 1}, "tiny, last GPU");
  ASSERT_TRUE(last.ok()) << last.status();
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "creating a runner changed the thread's current device";
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> first =
      LlamaCudaRunner::create(model.config, model.checkpoint,
                              {.num_kv_slots = 1024, .max_batch_rows = 256}, "tiny, first GPU");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE((*last)->uses_deft_kernels());
  EXPECT_GT((*last)->attention_wave().ctas, 0);
  absl::StatusOr<std::unique_ptr<LlamaCpuRunner>> cpu =
      LlamaCpuRunner::create(model.config, model.checkpoint, 1024, "tiny");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  compare_with_cpu(**last, **cpu, "tiny head_dim 128 on the last GPU, thread on GPU 0");
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "a step changed the thread's current device";
  compare_with_cpu(**first, **cpu, "tiny head_dim 128 on GPU 0 beside it");
  last->reset();  // freed on its own device
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
}

// ---- Prefill runs (PlannerOptions::min_prefill_run) --------------------------------------------

// A 150-token prompt, then in one step a 90-token extension of one branch (a run under a prefix)
// with single tokens of two other branches, then a decode step: every row's logits with prefill
// runs (the prefill kernel, or the generic kernel's run path) against the task-only plan, on the
// same runner (the second plan of a step rewrites the same KV slots).
void compare_prefill_runs(LlamaCudaRunner& runner, const char* name) {
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 60});
  Stepper tasks_only(runner, {.chunk_tokens = 16});
  Stepper with_runs(runner, {.chunk_tokens = 16, .min_prefill_run = 16});
  SequenceTree tree(1, &kv);
  std::mt19937 rng(5);
  std::uniform_int_distribution<TokenId> token(0, runner.vocab_size() - 1);
  auto tokens = [&](int n) {
    std::vector<TokenId> out(n);
    for (TokenId& t : out) t = token(rng);
    return out;
  };
  double worst = 0.0;
  auto both = [&](const std::vector<TreeStep>& parts) {
    const std::vector<std::vector<float>> a = tasks_only.step(parts);
    const std::vector<std::vector<float>> b = with_runs.step(parts);
    ASSERT_EQ(a.size(), b.size());
    for (size_t r = 0; r < a.size(); ++r) {
      for (float x : b[r]) ASSERT_TRUE(std::isfinite(x)) << "row " << r;
      worst = std::max(worst, relative_error(b[r], a[r]));
    }
  };
  const std::vector<TokenId> prompt = tokens(150);
  both({RunnerHarness::append(tree, tree.root(), prompt)});
  const std::vector<NodeId> leaves = *tree.branch(tree.root(), 3);
  const std::vector<TokenId> extension = tokens(90), one = tokens(1), two = tokens(1);
  TreeStep mixed{.tree = &tree};
  for (const TreeStep& part : {RunnerHarness::append(tree, leaves[0], one),
                               RunnerHarness::append(tree, leaves[1], extension),
                               RunnerHarness::append(tree, leaves[2], two)}) {
    mixed.queries.insert(mixed.queries.end(), part.queries.begin(), part.queries.end());
    mixed.tokens.insert(mixed.tokens.end(), part.tokens.begin(), part.tokens.end());
  }
  both({mixed});
  TreeStep decode{.tree = &tree};
  for (NodeId leaf : leaves) {
    const std::vector<TokenId> next = tokens(1);
    const TreeStep part = RunnerHarness::append(tree, leaf, next);
    decode.queries.push_back(part.queries[0]);
    decode.tokens.push_back(next[0]);
  }
  both({decode});
  EXPECT_LE(worst, kBf16LogitBound) << name;
  std::printf("[prefill runs vs tasks] %s: max relative logit difference %.3g\n", name, worst);
}

TEST(LlamaCuda, PrefillRunsMatchTaskPlans) {
  DEFT_SKIP_WITHOUT_GPU();
  for (int head_dim : {64, 128}) {
    const testing::TinyLlama model =
        testing::make_tiny_deft_llama(head_dim, static_cast<uint64_t>(head_dim + 1));
    absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> cuda = LlamaCudaRunner::create(
        model.config, model.checkpoint, {.num_kv_slots = 1024, .max_batch_rows = 256}, "tiny");
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    compare_prefill_runs(**cuda, head_dim == 64 ? "tiny head_dim 64" : "tiny head_dim 128");
  }
  std::unique_ptr<LlamaCudaRunner> generic = load_cuda(source_path("models/default"), 1024);
  ASSERT_NE(generic, nullptr);
  EXPECT_FALSE(generic->uses_deft_kernels());
  compare_prefill_runs(*generic, "default model (generic kernel)");
}

// ---- Random weights, memory planned from free memory ------------------------------------------

absl::StatusOr<ModelConfig> llama3_shaped_config() {
  return parse_model_config(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": false})");
}

// The runner's default runs gate/up on the skinny GEMM in decode steps of more than 32 rows
// (SkinnyGemmUse::kLmHeadAndWide): the logits of a 40-branch step are cuBLAS's (kOff) to
// rounding, on a Llama-3-8B-shaped model (2 layers); the greedy agreement is printed (random
// weights give near-ties).
TEST(LlamaCuda, SkinnyGateUpMatchesCublas) {
  DEFT_SKIP_WITHOUT_GPU();
  absl::StatusOr<ModelConfig> config = llama3_shaped_config();
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> runner =
      LlamaCudaRunner::create_random(*config, {.kv_memory_fraction = 0.5, .max_batch_rows = 256});
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::vector<TokenId> prompt(100);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>((i * 7919) % 128000);
  std::vector<TokenId> firsts(40);
  for (size_t i = 0; i < firsts.size(); ++i) firsts[i] = static_cast<TokenId>(1000 + 37 * i);
  using SkinnyGemmUse = LlamaCudaRunner::SkinnyGemmUse;
  std::vector<std::vector<std::vector<float>>> logits[2];
  const SkinnyGemmUse modes[2] = {SkinnyGemmUse::kOff, SkinnyGemmUse::kLmHeadAndWide};
  for (int m = 0; m < 2; ++m) {
    (*runner)->set_skinny_gemm(modes[m]);
    engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 64});
    decode_tree(**runner, kv, 1, prompt, firsts, 1, &logits[m]);
  }
  double diff = 0.0, norm = 0.0;
  for (size_t b = 0; b < firsts.size(); ++b) {
    for (size_t s = 0; s < logits[0][b].size(); ++s) {
      for (size_t v = 0; v < logits[0][b][s].size(); ++v) {
        const double d = double{logits[1][b][s][v]} - logits[0][b][s][v];
        diff += d * d;
        norm += double{logits[0][b][s][v]} * logits[0][b][s][v];
      }
    }
  }
  const double relative = std::sqrt(diff / norm);
  EXPECT_LT(relative, 1e-2);
  int same = 0, total = 0;
  for (size_t b = 0; b < firsts.size(); ++b) {
    const TokenId a = argmax(logits[0][b][0]), c = argmax(logits[1][b][0]);
    same += a == c;
    ++total;
  }
  std::printf(
      "[cuda random] skinny gate/up vs cuBLAS, 40 rows: logits rel err %.2e, tokens %d / %d\n",
      relative, same, total);
}

TEST(LlamaCuda, RandomLlama3ShapedModelRuns) {
  DEFT_SKIP_WITHOUT_GPU();
  absl::StatusOr<ModelConfig> config = llama3_shaped_config();
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<LlamaCudaRunner>> runner =
      LlamaCudaRunner::create_random(*config, {.kv_memory_fraction = 0.5, .max_batch_rows = 1024});
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_TRUE((*runner)->uses_deft_kernels());
  const int64_t slots = (*runner)->info().num_kv_slots;
  ASSERT_GE(slots, 4096);
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 256});
  std::vector<TokenId> prompt(600);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>((i * 7919) % 128000);
  std::vector<std::vector<std::vector<float>>> logits;
  const std::vector<TokenId> firsts = {1, 2, 3, 4, 5, 6, 7, 8};
  decode_tree(**runner, kv, 1, prompt, firsts, 4, &logits);
  int64_t non_finite = 0;
  for (const auto& branch : logits) {
    for (const auto& row : branch) {
      for (float value : row) non_finite += !std::isfinite(value);
    }
  }
  EXPECT_EQ(non_finite, 0);
  std::printf(
      "[cuda random] Llama-3-8B-shaped (2 layers): %.0f MiB weights, %.0f MiB "
      "activations, %.0f MiB KV (%lld slots); 600-token prefill + 8 branches x 4 steps, "
      "%lld non-finite logits\n",
      (*runner)->weight_bytes() / 1048576.0, (*runner)->activation_bytes() / 1048576.0,
      (*runner)->kv_cache_bytes() / 1048576.0, static_cast<long long>(slots),
      static_cast<long long>(non_finite));
}

// A plan that names a KV slot outside the pool (negative, at the pool's end, or far past it; early
// in the slot list or in its tail after the last block of 8) is refused with INVALID_ARGUMENT
// naming the slot, before anything runs: the same decode step afterwards gives the same logits.
TEST(LlamaCuda, RefusesPlansThatReadOutsideTheKvPool) {
  DEFT_SKIP_WITHOUT_GPU();
  engine::KvCacheManager kv({.page_tokens = 16, .num_pages = 8});
  std::unique_ptr<LlamaCudaRunner> runner =
      load_cuda(source_path("models/default"), kv.num_slots());
  ASSERT_NE(runner, nullptr);
  SequenceTree tree(1, &kv);
  const NodeId root = tree.root();
  std::vector<TokenId> prompt;
  for (int i = 0; i < 37; ++i) prompt.push_back(3 + static_cast<TokenId>((i * 7) % 500));
  ASSERT_TRUE(tree.append(root, prompt).ok());
  engine::AttentionPlanner planner({.chunk_tokens = 16});
  const size_t vocab = static_cast<size_t>(runner->vocab_size());
  const auto run = [&](const engine::AttentionPlan& plan, std::span<const TokenId> tokens,
                       std::vector<float>& logits) {
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    logits.assign(rows.size() * vocab, 0.0f);
    return runner->forward({.plan = &plan, .tokens = tokens, .logit_rows = rows}, logits);
  };
  const auto plan_of = [&](std::vector<engine::QueryToken> queries) {
    engine::AttentionPlan plan;
    const std::vector<engine::TreeQueries> input = {{&tree, queries}};
    EXPECT_TRUE(planner.plan(input, plan).ok());
    return plan;
  };
  std::vector<engine::QueryToken> prefill_queries;
  for (int i = 0; i < 37; ++i) prefill_queries.push_back({root, i});
  std::vector<float> logits;
  ASSERT_TRUE(run(plan_of(prefill_queries), prompt, logits).ok());

  const std::vector<TokenId> next = {42};
  ASSERT_TRUE(tree.append(root, next).ok());
  const engine::AttentionPlan decode = plan_of({{root, 37}});
  ASSERT_EQ(decode.kv_slots.size(), 38u);  // 4 blocks of 8 and a tail of 6
  std::vector<float> before, after;
  ASSERT_TRUE(run(decode, next, before).ok());

  const int32_t pool = static_cast<int32_t>(kv.num_slots());
  for (int32_t bad : {-1, pool, pool + 1000, std::numeric_limits<int32_t>::min(),
                      std::numeric_limits<int32_t>::max()}) {
    for (size_t at : {size_t{5}, decode.kv_slots.size() - 1}) {
      engine::AttentionPlan broken = decode;
      broken.kv_slots[at] = bad;
      const absl::Status status = run(broken, next, logits);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad << " at " << at;
      EXPECT_NE(status.message().find(absl::StrCat("reads KV slot ", bad, " (index ", at, ")")),
                std::string::npos)
          << status;
    }
  }
  ASSERT_TRUE(run(decode, next, after).ok());
  EXPECT_EQ(max_abs_error(after, before), 0.0);
}

}  // namespace
}  // namespace deft::models
