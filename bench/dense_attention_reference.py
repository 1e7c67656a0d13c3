#!/usr/bin/env python3
"""Dense attention kernels of PyTorch on the kernel bench's largest token trees: a reference for
what the best fused attention kernels reach on the same shapes, without a tree, pages or masks.

For the speculative-decoding snapshots specdec_p6000_t{32,64,128,256} each of the t queries
attends to the whole 6000 + t tokens (Llama-3-8B's 32 query heads over 8 KV heads, head_dim 128,
bf16): q [1, 32, t, 128], k and v [1, 8, 6000 + t, 128], no mask. That is a little more work
than the tree (the token tree's mask hides part of its last t tokens), so it bounds from below
what a tree kernel can do on these shapes. The few-shot snapshot fewshot_p4000_b20_s200 is timed
as its two dense halves: the 20 queries over the 4000-token prompt and each query over its own
200-token suffix (a batch of 20), without the merge.

Each backend of torch.nn.functional.scaled_dot_product_attention that takes the shape (cuDNN,
flash, memory-efficient; GQA through enable_gqa, and for cuDNN and flash also with K and V
repeated to all 32 heads beforehand, rows *_kv_repeated; the memory-efficient backend always with
them repeated, as it has no GQA kernel for these shapes) is checked against the math backend in fp32
(a row that misses 1e-2 relative L2 error is not written), then timed as CUDA-graph replays of
20 calls over KV copies rotated past the L2 (> 200 MB), median of the replays. Floor as in
../shared/BENCH_RESULTS.md: max(KV bytes / 3.0e12, 4 * 128 * 32 * t * kv_tokens / 7.0e14).

  bench/dense_attention_reference.py [--out DIR] [--reps N] [--commit SHA]

Writes DIR/dense_attention_reference-<gpu>-<yyyymmdd>.json.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
HBM, FLOPS = 3.0e12, 7.0e14
CALLS_PER_GRAPH = 20
ROTATE_BYTES = 200 << 20
# (method, backend, KV heads stored): with 32, K and V are repeated to every query head before
# timing (4x the KV bytes read; the floor keeps the 8 heads' bytes), for backends whose GQA path
# copies them inside the timed call.
BACKENDS = [("torch_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, KV_HEADS),
            ("torch_sdpa_cudnn_kv_repeated", SDPBackend.CUDNN_ATTENTION, HEADS),
            ("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION, KV_HEADS),
            ("torch_sdpa_flash_kv_repeated", SDPBackend.FLASH_ATTENTION, HEADS),
            ("torch_sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION, HEADS)]


def parts_of(case):
    """[(batch, queries, kv_tokens)] of a case: dense attentions timed one after the other."""
    if case.startswith("specdec_p6000_t"):
        t = int(case.rsplit("t", 1)[1])
        return [(1, t, 6000 + t)]
    if case == "fewshot_p4000_b20_s200":
        return [(1, 20, 4000), (20, 1, 200)]
    raise ValueError(case)


def make_inputs(batch, queries, kv_tokens, kv_heads, copies, gen):
    q = torch.randn(batch, HEADS, queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                    generator=gen)

    def kv():
        x = torch.randn(batch, KV_HEADS, kv_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                        generator=gen)
        return x.repeat_interleave(kv_heads // KV_HEADS, dim=1).contiguous()

    return q, [(kv(), kv()) for _ in range(copies)]


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def reference(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)


def time_case(case, backend, kv_heads, reps, gen):
    parts = parts_of(case)
    kv_bytes = sum(2 * b * KV_HEADS * n * HEAD_DIM * 2 for b, _, n in parts)
    copies = max(2, math.ceil(ROTATE_BYTES / (kv_bytes * kv_heads // KV_HEADS)))
    inputs = [make_inputs(b, m, n, kv_heads, copies, gen) for b, m, n in parts]
    worst = 0.0
    with sdpa_kernel(backend):
        for q, kvs in inputs:
            k, v = kvs[0]
            out = attend(q, k, v).float()
            ref = reference(q, k, v)
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
        if not worst < 1e-2:
            return None, worst, kv_bytes
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the capture (workspace, plans)
                for q, kvs in inputs:
                    attend(q, *kvs[0])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(CALLS_PER_GRAPH):
                for q, kvs in inputs:
                    attend(q, *kvs[i % copies])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return times, worst, kv_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--commit", default=os.environ.get("DEFT_COMMIT", "unknown"))
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in gpu else "h100"
    gen = torch.Generator(device="cuda").manual_seed(1234)
    rows = []
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {gpu}")
    print(f"{'case':24s} {'method':22s} {'median_us':>9s} {'floor_us':>9s} {'ratio':>6s} "
          f"{'TFLOP/s':>8s} {'rel_err':>8s}")
    cases = ["fewshot_p4000_b20_s200"] + [f"specdec_p6000_t{t}" for t in (32, 64, 128, 256)]
    for case in cases:
        parts = parts_of(case)
        flops = sum(4 * HEAD_DIM * HEADS * b * m * n for b, m, n in parts)
        for method, backend, kv_heads in BACKENDS:
            try:
                times, err, kv_bytes = time_case(case, backend, kv_heads, args.reps, gen)
            except RuntimeError as error:  # the backend does not take this shape
                print(f"{case:24s} {method:22s} not run: {str(error).splitlines()[0][:90]}")
                continue
            if times is None:
                print(f"{case:24s} {method:22s} FAILED CHECK (rel err {err:.2e}, row not written)")
                continue
            floor_us = max(kv_bytes / HBM, flops / FLOPS) * 1e6
            median = statistics.median(times)
            deciles = statistics.quantiles(times, n=10)
            print(f"{case:24s} {method:22s} {median:9.1f} {floor_us:9.1f} {median / floor_us:6.2f} "
                  f"{flops / median / 1e6:8.0f} {err:8.1e}")
            rows.append({"case": case, "method": method, "median_us": median,
                         "p10_us": deciles[0], "p90_us": deciles[-1], "repetitions": args.reps,
                         "kv_bytes": kv_bytes, "floor_us": floor_us,
                         "ratio_to_floor": median / floor_us,
                         "extra": {"dense_parts_batch_queries_kv_tokens": parts, "flops": flops,
                                   "achieved_tflop_per_s": flops / median / 1e6,
                                   "rel_err_vs_math_fp32": err,
                                   "kv_heads_stored": kv_heads,
                                   "torch": torch.__version__,
                                   "cudnn": torch.backends.cudnn.version()}})
    date = datetime.date.today()
    result = {"benchmark": "dense_attention_reference", "hardware": gpu, "commit": args.commit,
              "date": date.isoformat(), "command": " ".join(["bench/dense_attention_reference.py"]
                                                            + sys.argv[1:]),
              "floor": {"hbm_bytes_per_s": HBM, "flops_per_s": FLOPS}, "rows": rows}
    path = os.path.join(args.out, f"dense_attention_reference-{tag}-{date:%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
