#!/usr/bin/env python3
"""Writes a random-weight Llama checkpoint in Hugging Face layout (config.json,
generation_config.json, model.safetensors in bf16) of a named shape, for benchmarks that need a
real model directory (deft-server --model DIR) of a production shape without the weights.

  make_random_checkpoint.py --shape llama-3.2-1b --tokenizer DIR --out DIR [--layers N] [--seed N]

--tokenizer names a directory holding tokenizer.json (+ tokenizer_config.json), e.g. the Llama 3
files scripts/fetch_tokenizers.sh leaves in .cache/tokenizers/llama3; they are copied. Weights
are drawn on the GPU when torch sees one (seconds for 8B), with transformers' initializer range
(normal, std 0.02; norms 1). Needs torch and safetensors (both come with transformers).
"""
import argparse
import json
import os
import shutil
import sys

SHAPES = {
    # Llama-3.2-1B: GQA 32/8, head_dim 64, tied embeddings.
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True),
    # Llama-3-8B: GQA 32/8, head_dim 128.
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=128256, tie_word_embeddings=False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer", required=True, help="dir with tokenizer.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--seed", type=int, default=20261128)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    shape = dict(SHAPES[args.shape])
    if args.layers > 0:
        shape["num_hidden_layers"] = args.layers
    tokenizer_json = os.path.join(args.tokenizer, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        print(f"make_random_checkpoint: no tokenizer.json in {args.tokenizer}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(args.seed)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = (shape["num_attention_heads"], shape["num_key_value_heads"],
                                 shape["head_dim"])
    vocab = shape["vocab_size"]

    def normal(*size):
        t = torch.empty(*size, device=device, dtype=torch.float32)
        t.normal_(0.0, 0.02, generator=generator)
        return t.to(torch.bfloat16).cpu()

    def ones(size):
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        print(f"\rlayer {layer + 1}/{shape['num_hidden_layers']}", end="", file=sys.stderr)
    print(file=sys.stderr)
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(vocab, hidden)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16", **shape,
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 128000, "eos_token_id": 128001}, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = os.path.join(args.tokenizer, name)
        if os.path.isfile(source):
            shutil.copy(source, os.path.join(args.out, name))
    params = sum(t.numel() for t in tensors.values())
    print(f"wrote {args.out}: {args.shape}, {shape['num_hidden_layers']} layers, "
          f"{params / 1e9:.2f} B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
