// Test support (header only): batch invariance of a ModelRunner driven with deterministic plans
// (engine::PlannerOptions::deterministic). A probe request (a random prompt, then branches: branch
// 0 wants its logits, the others sample seeded with top-k / top-p) runs alone, the prompt
// prefilled in one step and every decode step holding only its rows; then the same request runs
// again in fresh KV slots inside random concurrent mixes: its prompt prefilled in random chunks,
// its steps shared with other requests' prefill chunks and decode rows (some wanting logits, some
// sampling, some neither), now and then other branches hung under its own prompt (requests that
// share a cached prefix), its part at a random place among the step's rows, and now and then a
// step it sits out. Each probe row's logits and each sampled token and log-probability must be
// the same bits as alone. Used by the CPU runner's test (tests/models/) and the CUDA runner's
// (tests/gpu/).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/sequence_tree.h"

namespace deft::test {

struct BatchInvarianceOptions {
  int32_t page_tokens = 16;
  int32_t num_pages = 1024;
  int32_t max_prompt_tokens = 300;
  int32_t decode_steps = 10;
  int32_t max_branches = 3;
  int32_t max_step_rows = 600;  // rows of a mixed step at most (the runner's max_batch_rows)
  int32_t mixes = 3;            // mixed runs of each probe
  engine::PlannerOptions planner = {.chunk_tokens = 64, .deterministic = true};
};

struct BatchInvarianceReport {
  int64_t steps = 0;           // mixed steps run
  int64_t max_step_rows = 0;   // the largest mixed step
  int64_t max_step_sampled = 0;  // the most sampled rows of a mixed step
  int64_t logit_rows = 0;      // probe logit rows compared
  int64_t sampled_rows = 0;    // probe sampled rows compared
  int64_t mismatches = 0;      // rows whose bits differ
  std::string first_mismatch;  // where

  // "N mixed steps (largest R rows, at most S sampled), L logit rows and M sampled rows
  // compared, D differ[: first ...]", for the tests' output.
  std::string summary() const {
    std::ostringstream out;
    out << steps << " mixed steps (largest " << max_step_rows << " rows, at most "
        << max_step_sampled << " sampled), " << logit_rows << " logit rows and " << sampled_rows
        << " sampled rows compared, " << mismatches << " differ";
    if (mismatches > 0) out << ": first " << first_mismatch;
    return out.str();
  }
};

// Drives `runner` (whose KV holds options.num_pages * page_tokens slots) with random probes and
// mixes from `seed`.
class BatchInvarianceHarness {
 public:
  BatchInvarianceHarness(engine::ModelRunner& runner, const BatchInvarianceOptions& options,
                         uint64_t seed)
      : runner_(runner),
        options_(options),
        kv_({.page_tokens = options.page_tokens, .num_pages = options.num_pages}),
        planner_(options.planner),
        rng_(seed) {}

  // One probe alone, then in options.mixes mixes; adds to `report`.
  void run_probe(BatchInvarianceReport& report) {
    Probe probe = random_probe();
    Outputs alone;
    ASSERT_NO_FATAL_FAILURE(run(probe, /*mixed=*/false, alone, report));
    for (int32_t m = 0; m < options_.mixes; ++m) {
      Outputs mixed;
      ASSERT_NO_FATAL_FAILURE(run(probe, /*mixed=*/true, mixed, report));
      compare(alone, mixed, report, m);
    }
  }

 private:
  using TokenId = engine::TokenId;
  using NodeId = engine::NodeId;

  struct Probe {
    std::vector<TokenId> prompt;
    int32_t branches = 1;
    std::vector<engine::SamplingParams> params;  // per branch; branch 0's is unused (logits)
  };
  // Per probe logit row in order: the prompt's last row, then per decode step branch 0's logits
  // and the other branches' sampled tokens.
  struct Outputs {
    std::vector<std::vector<float>> logits;
    std::vector<engine::SampledToken> sampled;
    std::vector<std::vector<TokenId>> tokens;  // per branch, fed after the prompt
  };

  // One tree's rows of a step and what to do with their outputs.
  struct Part {
    engine::SequenceTree* tree = nullptr;
    std::vector<engine::QueryToken> queries;
    std::vector<TokenId> tokens;
    // Per row: -1 no logits; 0 logits; 1 sampled with `params`.
    std::vector<int32_t> want;
    std::vector<const engine::SamplingParams*> params;
    std::vector<uint64_t> draw_step;
    std::vector<uint8_t> probe;  // per row: the probe's (foreign branches share its tree)
  };

  // A request of the noise: a tree, its prompt node and branches; tokens are random.
  struct Noise {
    std::unique_ptr<engine::SequenceTree> tree;
    NodeId prompt_node = -1;
    int32_t prompt_tokens = 0, prompt_done = 0;
    std::vector<NodeId> branches;
    int32_t steps_left = 0;
    engine::SamplingParams params;
  };

  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool coin(double p) { return std::bernoulli_distribution(p)(rng_); }
  std::vector<TokenId> random_tokens(int64_t count) {
    std::vector<TokenId> tokens(static_cast<size_t>(count));
    for (TokenId& t : tokens) t = static_cast<TokenId>(uniform(0, runner_.vocab_size() - 1));
    return tokens;
  }
  engine::SamplingParams random_params() {
    engine::SamplingParams p;
    // One in five greedy: such rows' log-probabilities come from the device sampler too.
    p.temperature =
        coin(0.2) ? 0.0f
                  : static_cast<float>(0.5 + 0.7 * std::uniform_real_distribution<>(0, 1)(rng_));
    p.top_k = coin(0.5) ? static_cast<int32_t>(uniform(2, 50)) : 0;
    p.top_p = coin(0.5) ? 0.9f : 1.0f;
    p.seed = rng_();
    return p;
  }

  Probe random_probe() {
    Probe probe;
    probe.prompt = random_tokens(uniform(1, options_.max_prompt_tokens));
    probe.branches = static_cast<int32_t>(uniform(1, options_.max_branches));
    for (int32_t b = 0; b < probe.branches; ++b) probe.params.push_back(random_params());
    return probe;
  }

  std::unique_ptr<engine::SequenceTree> new_tree() {
    return std::make_unique<engine::SequenceTree>(next_tree_id_++, &kv_);
  }

  // Appends `tokens` to `node` as rows of `part`.
  static void add_rows(Part& part, NodeId node, std::span<const TokenId> tokens, int32_t want,
                       const engine::SamplingParams* params, uint64_t draw_step,
                       bool probe = false) {
    const auto first = static_cast<int32_t>(part.tree->node(node).tokens.size());
    ASSERT_TRUE(part.tree->append(node, tokens).ok());
    for (size_t i = 0; i < tokens.size(); ++i) {
      part.queries.push_back({node, first + static_cast<int32_t>(i)});
      part.tokens.push_back(tokens[i]);
      const bool last = i + 1 == tokens.size();
      part.want.push_back(last ? want : -1);
      part.params.push_back(last ? params : nullptr);
      part.draw_step.push_back(draw_step);
      part.probe.push_back(probe ? 1 : 0);
    }
  }

  // Runs the probe (alone: its rows only, prompt in one step; mixed: among noise) into `out`.
  // Alone, branch 0's next token is its logits' argmax and a sampled branch's its draw; mixed,
  // the probe is fed the tokens of the alone run (so that a difference shows as one row, not a
  // diverging run).
  void run(const Probe& probe, bool mixed, Outputs& out, BatchInvarianceReport& report) {
    const Outputs* replay = mixed ? &reference_ : nullptr;
    std::unique_ptr<engine::SequenceTree> tree = new_tree();
    const NodeId prompt_node = tree->branch(tree->root(), 1).value().front();
    std::vector<NodeId> branches, foreign;
    std::vector<Noise> noise;
    int32_t prompt_done = 0;
    int32_t decode_step = 0;
    out.tokens.assign(static_cast<size_t>(probe.branches), {});
    // Per branch, the token its next row feeds.
    std::vector<TokenId> next(static_cast<size_t>(probe.branches), 0);
    while (decode_step < options_.decode_steps) {
      std::vector<Part> parts;
      const bool sit_out = mixed && coin(0.15);
      if (!sit_out) {
        Part part{.tree = tree.get()};
        if (prompt_done < static_cast<int32_t>(probe.prompt.size())) {
          const auto remaining = static_cast<int32_t>(probe.prompt.size()) - prompt_done;
          const int32_t count =
              mixed && coin(0.7) ? static_cast<int32_t>(uniform(1, remaining)) : remaining;
          const bool last = count == remaining;
          ASSERT_NO_FATAL_FAILURE(add_rows(
              part, prompt_node, std::span<const TokenId>(probe.prompt).subspan(prompt_done, count),
              last ? 0 : -1, nullptr, 0, /*probe=*/true));
          prompt_done += count;
        } else {
          for (int32_t b = 0; b < probe.branches; ++b) {
            const TokenId token = next[b];
            out.tokens[b].push_back(token);
            ASSERT_NO_FATAL_FAILURE(add_rows(part, branches[b], {&token, 1}, b == 0 ? 0 : 1,
                                             &probe.params[b], static_cast<uint64_t>(decode_step),
                                             /*probe=*/true));
          }
          ++decode_step;
        }
        parts.push_back(std::move(part));
      }
      if (mixed) {
        ASSERT_NO_FATAL_FAILURE(add_noise(noise, parts, *tree, prompt_node,
                                          prompt_done == static_cast<int32_t>(probe.prompt.size()),
                                          foreign));
        std::shuffle(parts.begin(), parts.end(), rng_);
      }
      if (parts.empty()) continue;
      std::vector<engine::SampledToken> probe_sampled;
      std::vector<std::vector<float>> probe_logits;
      ASSERT_NO_FATAL_FAILURE(run_step(parts, probe_logits, probe_sampled, report, mixed));
      if (sit_out) continue;
      // The probe's outputs: a finished prompt's logits, or a decode step's rows.
      size_t logit_index = 0, sampled_index = 0;
      if (branches.empty()) {
        if (probe_logits.empty()) continue;  // a prompt chunk before the last
        out.logits.push_back(probe_logits[0]);
        branches = tree->branch(prompt_node, probe.branches).value();
        for (int32_t b = 0; b < probe.branches; ++b) {
          next[b] = replay != nullptr ? replay->tokens[b][0] : argmax(probe_logits[0]);
        }
        continue;
      }
      for (int32_t b = 0; b < probe.branches; ++b) {
        if (b == 0) {
          out.logits.push_back(probe_logits[logit_index++]);
          next[b] = argmax(out.logits.back());
        } else {
          out.sampled.push_back(probe_sampled[sampled_index++]);
          next[b] = out.sampled.back().token;
        }
        if (replay != nullptr && decode_step < static_cast<int32_t>(replay->tokens[b].size())) {
          next[b] = replay->tokens[b][decode_step];
        }
      }
    }
    if (!mixed) reference_ = out;
    for (Noise& n : noise) n.tree.reset();
  }

  static TokenId argmax(const std::vector<float>& row) {
    return static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
  }

  // Adds noise parts to the step: new requests, prefill chunks, decode rows, and foreign branches
  // under the probe's prompt once it is in (requests sharing a cached prefix).
  void add_noise(std::vector<Noise>& noise, std::vector<Part>& parts,
                 engine::SequenceTree& probe_tree, NodeId probe_prompt, bool probe_prompt_done,
                 std::vector<NodeId>& foreign) {
    int64_t rows = 0;
    for (const Part& part : parts) rows += static_cast<int64_t>(part.queries.size());
    const int64_t budget = uniform(0, options_.max_step_rows) - rows;
    std::erase_if(noise, [](const Noise& n) { return n.steps_left <= 0; });
    while (static_cast<int64_t>(noise.size()) < uniform(0, 6) &&
           kv_.free_pages() > options_.num_pages / 2) {
      Noise& n = noise.emplace_back();
      n.tree = new_tree();
      n.prompt_node = n.tree->branch(n.tree->root(), 1).value().front();
      n.prompt_tokens = static_cast<int32_t>(uniform(1, 2 * options_.max_prompt_tokens));
      n.steps_left = static_cast<int32_t>(uniform(1, options_.decode_steps));
      n.params = random_params();
    }
    int64_t used = 0;
    for (Noise& n : noise) {
      if (used >= budget || coin(0.2)) continue;
      Part part{.tree = n.tree.get()};
      if (n.prompt_done < n.prompt_tokens) {
        const int64_t count =
            std::min<int64_t>({n.prompt_tokens - n.prompt_done, std::max<int64_t>(1, budget - used),
                               uniform(1, n.prompt_tokens)});
        const std::vector<TokenId> tokens = random_tokens(count);
        const bool last = n.prompt_done + count == n.prompt_tokens;
        ASSERT_NO_FATAL_FAILURE(add_rows(part, n.prompt_node, tokens,
                                         last ? static_cast<int32_t>(uniform(-1, 1)) : -1,
                                         &n.params, 0));
        n.prompt_done += static_cast<int32_t>(count);
        // Up to 40 branches, most of them sampling: a step's sampled rows then range past
        // what a GPU sampler launches in one wave, where its row split would change.
        if (last) n.branches = n.tree->branch(n.prompt_node, uniform(1, 40)).value();
      } else {
        for (NodeId branch : n.branches) {
          const std::vector<TokenId> token = random_tokens(1);
          const int32_t want = coin(0.6) ? 1 : static_cast<int32_t>(uniform(-1, 0));
          ASSERT_NO_FATAL_FAILURE(
              add_rows(part, branch, token, want, &n.params, static_cast<uint64_t>(n.steps_left)));
        }
        --n.steps_left;
      }
      used += static_cast<int64_t>(part.queries.size());
      parts.push_back(std::move(part));
    }
    // Foreign branches under the probe's prompt, decoding in the probe's own tree.
    if (probe_prompt_done && coin(0.5)) {
      if (foreign.empty()) foreign = probe_tree.branch(probe_prompt, uniform(1, 3)).value();
      Part* part = nullptr;
      for (Part& p : parts) {
        if (p.tree == &probe_tree) part = &p;
      }
      if (part == nullptr) part = &parts.emplace_back(Part{.tree = &probe_tree});
      for (NodeId branch : foreign) {
        const std::vector<TokenId> token = random_tokens(1);
        ASSERT_NO_FATAL_FAILURE(
            add_rows(*part, branch, token, static_cast<int32_t>(uniform(-1, 1)), nullptr, 0));
        if (part->want.back() == 1) part->want.back() = 0;  // no params: logits
      }
    }
  }

  // Plans and runs one step; hands back the probe's logit rows and sampled rows in row order.
  void run_step(const std::vector<Part>& parts, std::vector<std::vector<float>>& probe_logits,
                std::vector<engine::SampledToken>& probe_sampled, BatchInvarianceReport& report,
                bool mixed) {
    std::vector<engine::TreeQueries> trees;
    std::vector<TokenId> tokens;
    std::vector<int32_t> logit_rows;
    std::vector<engine::RowSampling> sampling;
    std::vector<std::pair<bool, int32_t>> row_owner;  // per logit row: probe?, want
    int32_t row = 0;
    for (const Part& part : parts) {
      trees.push_back({part.tree, part.queries});
      tokens.insert(tokens.end(), part.tokens.begin(), part.tokens.end());
      for (size_t i = 0; i < part.queries.size(); ++i, ++row) {
        if (part.want[i] < 0) continue;
        logit_rows.push_back(row);
        sampling.push_back(
            {.params = part.want[i] == 1 ? part.params[i] : nullptr, .step = part.draw_step[i]});
        row_owner.emplace_back(part.probe[i] != 0, part.want[i]);
      }
    }
    const absl::Status planned = planner_.plan(trees, plan_);
    ASSERT_TRUE(planned.ok()) << planned;
    size_t wanted = 0;
    for (const engine::RowSampling& s : sampling) wanted += s.params == nullptr;
    const size_t vocab = static_cast<size_t>(runner_.vocab_size());
    std::vector<float> logits(wanted * vocab);
    std::vector<engine::SampledToken> sampled(sampling.size());
    const engine::StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows};
    const absl::Status ran = runner_.forward_sampled(batch, sampling, sampled, logits);
    ASSERT_TRUE(ran.ok()) << ran;
    if (mixed) {
      ++report.steps;
      report.max_step_rows = std::max<int64_t>(report.max_step_rows, row);
      report.max_step_sampled = std::max<int64_t>(report.max_step_sampled,
                                                  static_cast<int64_t>(sampling.size() - wanted));
    }
    size_t logit_index = 0;
    for (size_t i = 0; i < sampling.size(); ++i) {
      const bool has_logits = sampling[i].params == nullptr;
      if (row_owner[i].first) {
        if (has_logits) {
          probe_logits.emplace_back(logits.begin() + logit_index * vocab,
                                    logits.begin() + (logit_index + 1) * vocab);
        } else {
          probe_sampled.push_back(sampled[i]);
        }
      }
      logit_index += has_logits;
    }
  }

  static void compare(const Outputs& alone, const Outputs& mixed, BatchInvarianceReport& report,
                      int32_t mix) {
    const auto mismatch = [&](const std::string& where) {
      if (report.mismatches++ == 0) report.first_mismatch = where;
    };
    if (alone.logits.size() != mixed.logits.size() ||
        alone.sampled.size() != mixed.sampled.size()) {
      mismatch("mix " + std::to_string(mix) + ": a different number of rows");
      return;
    }
    for (size_t i = 0; i < alone.logits.size(); ++i) {
      ++report.logit_rows;
      if (std::memcmp(alone.logits[i].data(), mixed.logits[i].data(),
                      alone.logits[i].size() * sizeof(float)) != 0) {
        size_t at = 0;
        while (alone.logits[i][at] == mixed.logits[i][at]) ++at;
        std::ostringstream where;
        where << "mix " << mix << ": logit row " << i << " (0: the prompt's last) differs at token "
              << at << ": " << alone.logits[i][at] << " alone, " << mixed.logits[i][at] << " mixed";
        mismatch(where.str());
      }
    }
    for (size_t i = 0; i < alone.sampled.size(); ++i) {
      ++report.sampled_rows;
      if (alone.sampled[i].token != mixed.sampled[i].token ||
          std::memcmp(&alone.sampled[i].logprob, &mixed.sampled[i].logprob, sizeof(float)) != 0) {
        std::ostringstream where;
        where << "mix " << mix << ": sampled row " << i << ": token " << alone.sampled[i].token
              << " logprob " << alone.sampled[i].logprob << " alone, " << mixed.sampled[i].token
              << " " << mixed.sampled[i].logprob << " mixed";
        mismatch(where.str());
      }
    }
  }

  engine::ModelRunner& runner_;
  BatchInvarianceOptions options_;
  engine::KvCacheManager kv_;
  engine::AttentionPlanner planner_;
  engine::AttentionPlan plan_;
  std::mt19937_64 rng_;
  Outputs reference_;
  uint32_t next_tree_id_ = 1;
};

}  // namespace deft::test
