#!/usr/bin/env python3
"""Trains the embedded default model (models/default/) so that its output reads as language,
and, with smaller size flags, its draft model (models/default-draft/).

The default architecture is the one tools/make_default_model.cc writes (LlamaForCausalLM,
hidden 128, 4 layers, 4 query heads on 2 KV heads, MLP 352, vocab 512); --hidden, --layers,
--heads, --kv-heads and --intermediate change it (head_dim = hidden / heads). The data is
models/default/corpus.txt
(a short public-domain text written for the project), tokenized with models/default/
tokenizer.model, one paragraph per sequence as <s> paragraph </s>. A model this small on 2,000
tokens of text learns it nearly by heart: its greedy output recites and recombines the corpus.
That is the point: a demo model whose tree branches are readable, not a useful language model.

Run on the GPU machine (torch + transformers), from the repository root:

    python3 tools/train_default_model.py --ids IDS.json --out models/default

IDS.json: a list of token-id lists, one per paragraph, made here with

    python3 tools/train_default_model.py --tokenize models/default --ids IDS.json

(spm_encode from Debian's sentencepiece-tools). The draft model of models/default-draft/ (same
tokenizer and data, see its README.md):

    python3 tools/train_default_model.py --ids IDS.json --out models/default-draft \
        --hidden 64 --layers 2 --heads 2 --kv-heads 1 --intermediate 176

Training is seeded (--seed: weights and batches); GPU kernels make the last bits of the weights
differ between runs, so the committed weights are the record.
"""

import argparse
import json
import math
import os
import re
import subprocess


def paragraphs(corpus_path):
    text = open(corpus_path, encoding="utf-8").read()
    paras = [" ".join(p.split("\n")).strip() for p in text.split("\n\n") if p.strip()]
    return [re.sub(r" +", " ", p) for p in paras]


def tokenize(model_dir, ids_path):
    paras = paragraphs(os.path.join(model_dir, "corpus.txt"))
    out = subprocess.run(["spm_encode", f"--model={os.path.join(model_dir, 'tokenizer.model')}",
                          "--output_format=id"], input="\n".join(paras) + "\n",
                         capture_output=True, text=True, check=True).stdout
    ids = [[int(x) for x in line.split()] for line in out.strip().split("\n")]
    with open(ids_path, "w") as f:
        json.dump(ids, f)
    print(f"{len(ids)} paragraphs, {sum(map(len, ids))} tokens -> {ids_path}")


def train(ids_path, out_dir, steps, seed, size):
    import torch
    import transformers

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    paras = json.load(open(ids_path))
    bos, eos = 1, 2
    stream = []
    for p in paras:
        stream += [bos] + p + [eos]
    data = torch.tensor(stream, dtype=torch.long)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    major = int(transformers.__version__.split(".")[0])
    rope = (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)) if major >= 5
            else dict(rope_theta=10000.0))
    config = transformers.LlamaConfig(
        hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.hidden // size.heads, vocab_size=512, max_position_embeddings=4096,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
        bos_token_id=bos, eos_token_id=eos, **rope)
    model = transformers.LlamaForCausalLM(config).to(device)
    print(f"{sum(p.numel() for p in model.parameters())} parameters: hidden {size.hidden}, "
          f"{size.layers} layers, {size.heads} heads on {size.kv_heads} KV heads, "
          f"MLP {size.intermediate}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    window, batch = 128, 32
    for step in range(steps):
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - window - 1, (batch,))
        x = torch.stack([data[s:s + window] for s in starts]).to(device)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e}", flush=True)

    model.eval()
    with torch.no_grad():
        prompt = torch.tensor([[bos] + paras[0][:6]], device=device)
        out = model.generate(prompt, max_new_tokens=40, do_sample=False)
        print("greedy ids:", out[0].tolist())
    model = model.to(torch.bfloat16).cpu()
    model.save_pretrained(out_dir, safe_serialization=True)
    print("saved", out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenize", metavar="MODEL_DIR",
                        help="write --ids from MODEL_DIR/corpus.txt and exit")
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=20261123)
    # The model's size; the defaults are the embedded default model's.
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=352)
    args = parser.parse_args()
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"--hidden {args.hidden} must split over --heads {args.heads}, and "
                     f"--heads over --kv-heads {args.kv_heads}")
    if args.tokenize:
        tokenize(args.tokenize, args.ids)
    else:
        train(args.ids, args.out, args.steps, args.seed, args)


if __name__ == "__main__":
    main()
