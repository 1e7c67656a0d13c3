# Cross-checks DeFT's config/safetensors code against transformers + safetensors (run on the
# device machine). Writes fixtures.tar into the output folder.
import json, os, sys, tarfile, traceback
import numpy as np
import torch

out, here = sys.argv[1], os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(out, "fixtures")
os.makedirs(fixtures, exist_ok=True)
import transformers, safetensors
print("transformers", transformers.__version__, "safetensors", safetensors.__version__, "torch", torch.__version__)

# 1. RoPE inverse frequencies as transformers computes them.
from transformers import LlamaConfig, Qwen2Config, MistralConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
rope = {}
for name, cfg in json.load(open(os.path.join(here, "rope_configs.json"))).items():
    try:
        arch = cfg["architectures"][0]
        if arch == "Qwen2ForCausalLM":
            emb = Qwen2RotaryEmbedding(config=Qwen2Config(**cfg))
        elif arch == "MistralForCausalLM":
            c = dict(cfg); c["sliding_window"] = None
            emb = MistralRotaryEmbedding(config=MistralConfig(**c))
        else:
            emb = LlamaRotaryEmbedding(config=LlamaConfig(**cfg))
        inv = emb.inv_freq.detach().float().cpu().numpy().astype(np.float32)
        rope[name] = {"inv_freq_bits": [int(x) for x in inv.view(np.uint32)],
                      "attention_scaling": float(emb.attention_scaling)}
        print(name, len(inv), inv[:2], inv[-2:], emb.attention_scaling)
    except Exception:
        traceback.print_exc()
json.dump(rope, open(os.path.join(fixtures, "rope_inv_freq.json"), "w"))

# 2. Our writer's file, read by the reference library.
from safetensors.torch import load_file, save_file
from safetensors import safe_open
ours = load_file(os.path.join(here, "ours.safetensors"))
for k, v in ours.items():
    print("ours", k, v.dtype, tuple(v.shape), v.float().flatten().tolist())
with safe_open(os.path.join(here, "ours.safetensors"), "pt") as f:
    print("ours metadata", f.metadata())

# 3. A file written by the reference library, with torch's own bf16/fp16 rounding.
g = torch.Generator().manual_seed(1234)
src = (torch.randn(257, generator=g) * torch.logspace(-9, 6, 257)).float()
special = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e-8, 3e-8, 6e-8, 1.0 + 2**-11,
                        float("inf"), float("-inf"), 1e30, -1e-40, 2**-24, 2**-25])
src = torch.cat([src, special])
theirs = {"src_f32": src.clone(), "as_bf16": src.to(torch.bfloat16), "as_f16": src.to(torch.float16),
          "matrix": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16),
          "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4, dtype=torch.float16)}
save_file(theirs, os.path.join(fixtures, "torch_written.safetensors"), metadata={"format": "pt", "origin": "torch"})

# 4. Tiny checkpoints saved by transformers itself (sharded Llama 3.1-style, tied Qwen2).
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
torch.manual_seed(0)
llama = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3], rms_norm_eps=1e-5)
m = LlamaForCausalLM(llama).to(torch.bfloat16)
d = os.path.join(fixtures, "hf_llama_tiny")
try:
    m.save_pretrained(d, max_shard_size="8KB")
except Exception:
    traceback.print_exc(); m.save_pretrained(d)
qwen = Qwen2Config(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, tie_word_embeddings=True,
                   use_sliding_window=False, bos_token_id=1, eos_token_id=2)
q = Qwen2ForCausalLM(qwen).to(torch.float16)
q.save_pretrained(os.path.join(fixtures, "hf_qwen2_tiny"))
for root, _, files in os.walk(fixtures):
    for f in files:
        p = os.path.join(root, f); print(p[len(fixtures):], os.path.getsize(p))
print(open(os.path.join(d, "config.json")).read())
print(open(os.path.join(fixtures, "hf_qwen2_tiny", "config.json")).read())
with tarfile.open(os.path.join(out, "fixtures.tar"), "w") as t:
    t.add(fixtures, arcname="fixtures")
