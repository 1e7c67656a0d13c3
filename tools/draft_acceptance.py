#!/usr/bin/env python3
"""Measures how often a draft model agrees with its target under greedy speculative decoding.

For each prompt, the target's greedy continuation (--new-tokens) is the text a lossless greedy
speculative decoder must produce. One teacher-forced forward pass of the draft over prompt +
continuation gives, at every position, the rank of the target's token among the draft's logits
(0 = the draft's own greedy token). Along an accepted path the draft sees exactly the target's
text, so these ranks decide every draft tree:
  - chain of depth d: a step accepts the run of rank-0 positions from where it starts, at most d;
  - top-k tree of depth d (every node expanded to its draft top-k): the run of ranks < k;
  - a rank-path tree (Medusa notation, as in ../shared/workloads/speculative_decoding): the
    longest prefix of the ranks that is a path of the tree.
A step then yields accepted + 1 tokens (the target's own token after the accepted path), and the
continuation is walked step by step from its start; the figure is tokens per step = tokens /
steps over all prompts of a set (the APPS records' Accept_length counts the same way).

The prompts, made here (spm_encode from Debian's sentencepiece-tools): the first 8 tokens of
every corpus paragraph, 8 tokens from the middle of every paragraph of 40 tokens or more, and six
sentences written for this measurement, not from the corpus (NOT_IN_CORPUS below):

    python3 tools/draft_acceptance.py --make-prompts models/default --prompts PROMPTS.json

Then where torch and transformers are (the GPU machine), from the repository root:

    python3 tools/draft_acceptance.py --target models/default --draft models/default-draft \\
        --prompts PROMPTS.json [--tree NAME=FILE ...] [--out RESULT.json]

PROMPTS.json: {"set name": [[token ids of a prompt, without <s>], ...], ...}.
"""

import argparse
import json
import os
import subprocess

NOT_IN_CORPUS = [
    "The train left the station late in the evening, and the passengers watched the city "
    "lights fade behind them.",
    "To bake bread you need flour, water, salt and yeast, and a warm place where the dough can "
    "rise.",
    "Our meeting on Tuesday will cover the budget for next year and the plans for the new "
    "office.",
    "A compiler turns source code into machine instructions that a processor can execute "
    "directly.",
    "The mountain village had one road, one school and a market that opened every Saturday.",
    "She opened the letter slowly, read the first line twice, and then sat down by the window.",
]


def make_prompts(model_dir, prompts_path):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_default_model import paragraphs

    def encode(lines):
        out = subprocess.run(["spm_encode", f"--model={os.path.join(model_dir, 'tokenizer.model')}",
                              "--output_format=id"], input="\n".join(lines) + "\n",
                             capture_output=True, text=True, check=True).stdout
        return [[int(x) for x in line.split()] for line in out.strip().split("\n")]

    paras = encode(paragraphs(os.path.join(model_dir, "corpus.txt")))
    prompts = {"corpus_paragraph_starts": [p[:8] for p in paras if len(p) >= 8],
               "corpus_mid_paragraph": [p[len(p) // 2:len(p) // 2 + 8] for p in paras
                                        if len(p) >= 40],
               "not_in_corpus": encode(NOT_IN_CORPUS)}
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    print({name: len(v) for name, v in prompts.items()}, "->", prompts_path)


def target_ranks(target, draft, prompt_ids, new_tokens, device):
    import torch

    text = torch.tensor([1] + prompt_ids, device=device)
    n = text.shape[0]
    with torch.no_grad():
        # Plain greedy, </s> included like any token (the model continues with the next
        # paragraph, as in its training stream).
        for _ in range(new_tokens):
            next_token = target(input_ids=text[None, :]).logits[0, -1].argmax()
            text = torch.cat([text, next_token[None]])
        continuation = text[n:]
        # Draft logits at positions n-1 ... n+L-2 predict continuation[0 ... L-1].
        logits = draft(input_ids=text[None, :]).logits[0, n - 1:-1].float()
        target_logit = logits.gather(1, continuation[:, None])
        ranks = (logits > target_logit).sum(dim=1)
        # Check the target's tokens against its own greedy choice (teacher-forced, one pass).
        tlogits = target(input_ids=text[None, :]).logits[0, n - 1:-1].float()
        agree = (tlogits.argmax(dim=1) == continuation).float().mean().item()
    return ranks.tolist(), continuation.tolist(), agree


def walk(ranks, accepts):
    """Tokens and steps to produce len(ranks) tokens when accepts(ranks, i) drafts are
    accepted from position i."""
    i, steps = 0, 0
    histogram = {}
    while i < len(ranks):
        a = min(accepts(ranks, i), len(ranks) - i - 1)
        histogram[a + 1] = histogram.get(a + 1, 0) + 1
        i += a + 1
        steps += 1
    return len(ranks), steps, histogram


def chain(depth):
    def accepts(ranks, i):
        a = 0
        while a < depth and i + a < len(ranks) and ranks[i + a] == 0:
            a += 1
        return a
    return accepts


def topk_tree(k, depth):
    def accepts(ranks, i):
        a = 0
        while a < depth and i + a < len(ranks) and ranks[i + a] < k:
            a += 1
        return a
    return accepts


def rank_path_tree(paths):
    path_set = {tuple(p) for p in paths}

    def accepts(ranks, i):
        a = 0
        while i + a < len(ranks) and tuple(ranks[i:i + a + 1]) in path_set:
            a += 1
        return a
    return accepts


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-prompts", metavar="MODEL_DIR",
                        help="write --prompts from MODEL_DIR/corpus.txt and NOT_IN_CORPUS, exit")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=FILE: a workload file's Tree_Structure (rank paths)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.make_prompts:
        make_prompts(args.make_prompts, args.prompts)
        return
    if not args.target or not args.draft:
        parser.error("--target and --draft are needed to measure")

    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = transformers.LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    draft = transformers.LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32)
    target, draft = target.to(device).eval(), draft.to(device).eval()
    policies = {f"chain_d{d}": (d, chain(d)) for d in range(1, 7)}
    for k in (2, 3):
        policies[f"top{k}_d3"] = (sum(k ** level for level in range(1, 4)), topk_tree(k, 3))
    for spec in args.tree:
        name, path = spec.split("=", 1)
        paths = json.load(open(path))["Tree_Structure"]
        policies[name] = (len(paths), rank_path_tree(paths))

    prompt_sets = json.load(open(args.prompts))
    result = {"target": args.target, "draft": args.draft, "new_tokens": args.new_tokens,
              "sets": {}}
    for set_name, prompts in prompt_sets.items():
        all_ranks = []
        agree = []
        for p in prompts:
            ranks, _, a = target_ranks(target, draft, p, args.new_tokens, device)
            all_ranks.append(ranks)
            agree.append(a)
        flat = [r for ranks in all_ranks for r in ranks]
        row = {"prompts": len(prompts), "tokens": len(flat),
               "draft_top1_agreement": sum(r == 0 for r in flat) / len(flat),
               "draft_top3_agreement": sum(r < 3 for r in flat) / len(flat),
               "target_teacher_forced_self_agreement": sum(agree) / len(agree),
               "tokens_per_step": {}, "draft_tokens": {}, "histogram": {}}
        for name, (size, accepts) in policies.items():
            tokens = steps = 0
            hist = {}
            for ranks in all_ranks:
                t, s, h = walk(ranks, accepts)
                tokens += t
                steps += s
                for key, v in h.items():
                    hist[key] = hist.get(key, 0) + v
            row["tokens_per_step"][name] = tokens / steps
            row["draft_tokens"][name] = size
            row["histogram"][name] = dict(sorted(hist.items()))
        result["sets"][set_name] = row
        print(f"{set_name}: {len(prompts)} prompts, {len(flat)} tokens, draft top-1 agreement "
              f"{row['draft_top1_agreement']:.3f}, top-3 {row['draft_top3_agreement']:.3f}")
        for name, v in row["tokens_per_step"].items():
            print(f"  {name:<14} ({row['draft_tokens'][name]:>3} draft tokens) "
                  f"{v:.2f} tokens/step  {row['histogram'][name]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
