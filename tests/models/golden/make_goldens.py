#!/usr/bin/env python3
"""Golden outputs of Hugging Face transformers for the CPU runner's parity test.

Builds small random-weight models of each supported family with `transformers`, saves them in
Hugging Face format (config.json + fp32 model.safetensors), and records reference logits for

  (a) prompts: every position of a few random prompts;
  (b) a token tree hung under a prompt: each root-to-leaf branch run as its own sequence, the
      logits of every tree token (and of the last prompt token) recorded;
  (c) a greedy continuation of --greedy-steps tokens from every branch (argmax of each step's
      logits), with the full logits at a few steps and the top-1/top-2 margin at every step.

The reference forward runs in float64 (the fp32 weights widened exactly) with eager attention,
so the goldens are the exact answer to ~1e-12, not one more fp32 rounding; the C++ test
(tests/models/llama_parity_test.cc) holds our fp32 runner to a relative error < 1e-4.

Run on the GPU machine (torch + transformers; the GPU is not needed, everything runs on the
CPU in float64):

    python3 make_goldens.py --out OUTDIR

Layout written: OUTDIR/<case>/{config.json, model.safetensors, golden.json,
golden.safetensors} for each case in CASES, plus OUTDIR/manifest.json.
"""

import argparse
import json
import os
import random
import traceback

import torch
import transformers
from safetensors.torch import save_file

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

# hidden <= 64, 2 layers, vocab <= 512: small enough to commit (about 0.5 MB each).
CASES = {
    # Llama 3.x shape: GQA (4 query heads on 2 KV heads), head_dim set explicitly and larger
    # than hidden / heads, llama3 RoPE scaling with a short original context so that every
    # band of the scaling (kept, interpolated, divided) is hit, tied embeddings (3.2).
    "llama3": dict(
        arch="llama", hidden_size=64, intermediate_size=160, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    # Llama 2 shape: multi-head attention, theta 10000, untied LM head.
    "llama2": dict(
        arch="llama", hidden_size=64, intermediate_size=172, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=384, rope_theta=10000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    # Qwen2: bias on q/k/v (not o), GQA 8:2, theta 1e6.
    "qwen2": dict(
        arch="qwen2", hidden_size=64, intermediate_size=144, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=448, rope_theta=1000000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    # Mistral 7B v0.2 shape: GQA 4:1, theta 1e6, no sliding window.
    "mistral": dict(
        arch="mistral", hidden_size=64, intermediate_size=192, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=320, rope_theta=1000000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
}

NUM_LAYERS = 2
MAX_POSITIONS = 2048
# Steps of the greedy continuation whose full logits are stored (all steps store tokens and
# margins); a few rows keep the files small.
GREEDY_LOGIT_STEPS = [0, 1, 15, 31, 47, 63]


def make_config(case):
    spec = dict(CASES[case])
    arch = spec.pop("arch")
    rope_theta = spec.pop("rope_theta")
    rope_scaling = spec.pop("rope_scaling", None)
    common = dict(num_hidden_layers=NUM_LAYERS, max_position_embeddings=MAX_POSITIONS,
                  hidden_act="silu", attention_dropout=0.0, **spec)
    if TRANSFORMERS_MAJOR >= 5:
        rope = dict(rope_type="default", rope_theta=rope_theta)
        if rope_scaling:
            rope.update(rope_scaling)
        common["rope_parameters"] = rope
    else:
        common["rope_theta"] = rope_theta
        if rope_scaling:
            common["rope_scaling"] = rope_scaling
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    raise ValueError(arch)


def make_model(case, seed):
    config = make_config(case)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.to(torch.float32)
    # Weights of unit-scale activations (std 1/sqrt(fan_in)) rather than transformers' 0.02,
    # so logits spread over a few units and greedy choices are far from ties; norm weights and
    # biases random too, so the test sees every one of them used.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            elif "lm_head" in name:
                # Logits a few units apart: ties (which fp32 could flip) become rare.
                param.normal_(0.0, 4.0 * param.shape[1] ** -0.5)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.eval()
    return model


def logits_of(model64, tokens):
    with torch.no_grad():
        ids = torch.tensor([tokens], dtype=torch.long)
        return model64(input_ids=ids).logits[0]  # [len, vocab] float64


def random_tree(rng, vocab):
    """A token tree under the prompt: nodes (parent, tokens); parent -1 = the prompt."""
    # Shape: the prompt branches 3 ways; one child branches 2 ways, one of those 2 ways again.
    shape = [(-1, 4), (-1, 3), (-1, 1), (0, 5), (0, 2), (4, 3), (4, 1), (1, 6)]
    return [dict(parent=p, tokens=[rng.randrange(3, vocab) for _ in range(n)]) for p, n in shape]


def leaf_paths(nodes):
    children = {i: [] for i in range(-1, len(nodes))}
    for i, node in enumerate(nodes):
        children[node["parent"]].append(i)
    paths = []

    def walk(i, path):
        if not children[i]:
            paths.append(path)
            return
        for c in children[i]:
            walk(c, path + [c])

    walk(-1, [])
    return paths


def make_case(case, out_dir, greedy_steps, seed):
    model = make_model(case, seed)
    case_dir = os.path.join(out_dir, case)
    os.makedirs(case_dir, exist_ok=True)
    model.save_pretrained(case_dir, safe_serialization=True)
    for extra in ("generation_config.json",):
        path = os.path.join(case_dir, extra)
        if os.path.exists(path):
            os.remove(path)
    model64 = model.to(torch.float64)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    tensors = {}
    golden = dict(case=case, seed=seed, transformers_version=transformers.__version__,
                  torch_version=torch.__version__, reference_dtype="float64", prompts=[])

    # (a) prompts.
    for i, length in enumerate([7, 19]):
        tokens = [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]
        name = f"prompt{i}"
        tensors[name] = logits_of(model64, tokens).to(torch.float32).contiguous()
        golden["prompts"].append(dict(tokens=tokens, logits=name))

    # (b) + (c) a token tree under a prompt, and greedy continuations of every branch.
    prompt = [1] + [rng.randrange(3, vocab) for _ in range(11)]
    nodes = random_tree(rng, vocab)
    branches = []
    min_margin = float("inf")
    for b, path in enumerate(leaf_paths(nodes)):
        path_tokens = [t for n in path for t in nodes[n]["tokens"]]
        sequence = prompt + path_tokens
        full = logits_of(model64, sequence)
        # Rows from the last prompt token on: the logits at every tree token's position.
        name = f"branch{b}"
        tensors[name] = full[len(prompt) - 1:].to(torch.float32).contiguous()
        greedy, margins, greedy_rows = [], [], []
        for step in range(greedy_steps):
            row = logits_of(model64, sequence + greedy)[-1]
            top2 = torch.topk(row, 2)
            greedy.append(int(top2.indices[0]))
            margin = float(top2.values[0] - top2.values[1])
            margins.append(margin)
            min_margin = min(min_margin, margin)
            if step in GREEDY_LOGIT_STEPS:
                greedy_rows.append(row.to(torch.float32))
        gname = f"branch{b}_greedy"
        tensors[gname] = torch.stack(greedy_rows).contiguous()
        branches.append(dict(path=path, logits=name, logits_first_position=len(prompt) - 1,
                             greedy_tokens=greedy, greedy_margins=margins,
                             greedy_logit_steps=[s for s in GREEDY_LOGIT_STEPS
                                                 if s < greedy_steps],
                             greedy_logits=gname))
    golden["tree"] = dict(prompt=prompt, nodes=nodes, branches=branches)
    golden["min_greedy_margin"] = min_margin
    save_file(tensors, os.path.join(case_dir, "golden.safetensors"))
    with open(os.path.join(case_dir, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    return min_margin


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--greedy-steps", type=int, default=64)
    parser.add_argument("--cases", default=",".join(CASES))
    # Greedy parity needs the reference's top two logits apart by much more than fp32 noise;
    # a seed whose continuation comes closer than this is skipped for the next one.
    parser.add_argument("--min-margin", type=float, default=2e-4)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    failed = []
    manifest = dict(transformers_version=transformers.__version__,
                    torch_version=torch.__version__, cases={})
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    for case in args.cases.split(","):
        for seed in range(1000, 1020):
            try:
                margin = make_case(case, args.out, args.greedy_steps, seed)
            except Exception:  # report every case's failure in one run, then fail
                traceback.print_exc()
                failed.append(case)
                break
            print(f"{case}: seed {seed}, min greedy margin {margin:.3g}", flush=True)
            if margin >= args.min_margin:
                break
        if case not in failed:
            manifest["cases"][case] = dict(seed=seed, min_greedy_margin=margin)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
