#!/usr/bin/env python3
"""Speculative vs plain decoding through the real server (HTTP API), with the trained pair.

Starts deft-server with the embedded default model and its trained draft (models/default-draft),
then, for each concurrency and each mode (plain, and the speculative policies), keeps that many
clients sending /v1/completions requests (prompts cut from the model's corpus, greedy unless
--temperature, max_tokens --tokens) for --seconds, and records completed tokens/s, request
latency and, from /metrics, the drafted and accepted tokens per verified tree. Writes a
bench/results JSON (../shared/BENCH_RESULTS.md). Python standard library only.

  python3 bench/spec_serve/spec_serve_bench.py --server build/server/deft-server --out DIR
"""
import argparse
import datetime
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def prompts_from_corpus(count, rng):
    text = open(os.path.join(ROOT, "models/default/corpus.txt"), encoding="utf-8").read()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 6]
    out = []
    for _ in range(count):
        words = rng.choice(sentences).split()
        out.append(" ".join(words[: rng.randint(3, min(10, len(words) - 1))]))
    return out


def complete(port, prompt, tokens, temperature, spec, seed):
    body = {"model": "default", "prompt": prompt, "max_tokens": tokens,
            "temperature": temperature, "seed": seed}
    if spec:
        body["deft"] = {"speculative": spec}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.loads(response.read())
    return reply["usage"]["completion_tokens"], reply["choices"][0]["text"]


def run_level(http_port, metrics_port, clients, seconds, tokens, temperature, spec, prompts):
    before = metrics(metrics_port)
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    done = {"tokens": 0, "requests": 0, "latencies": [], "errors": 0}

    def client(index):
        rng = random.Random(index)
        while time.monotonic() < stop:
            prompt = rng.choice(prompts)
            start = time.monotonic()
            try:
                got, _ = complete(http_port, prompt, tokens, temperature, spec, rng.randrange(1 << 30))
            except Exception as error:  # noqa: BLE001 - counted and reported
                with lock:
                    done["errors"] += 1
                print("request failed:", error, file=sys.stderr)
                continue
            with lock:
                done["tokens"] += got
                done["requests"] += 1
                done["latencies"].append(time.monotonic() - start)

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    after = metrics(metrics_port)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    verifies = delta.get("deft_speculative_accept_length_count", 0)
    accepted = delta.get("deft_speculative_accepted_tokens_total", 0)
    drafted = delta.get("deft_speculative_drafted_tokens_total", 0)
    steps = delta.get("deft_engine_steps_total", 0)
    lat = sorted(done["latencies"]) or [0.0]
    return {
        "tokens_per_s": done["tokens"] / wall,
        "requests": done["requests"],
        "errors": done["errors"],
        "tokens": done["tokens"],
        "wall_s": wall,
        "latency_median_s": statistics.median(lat),
        "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
        "engine_steps": steps,
        "step_seconds_per_step": delta.get("deft_step_seconds_total", 0) / max(steps, 1),
        "draft_seconds_share": delta.get("deft_draft_seconds_total", 0)
        / max(delta.get("deft_step_seconds_total", 0), 1e-9),
        "verified_trees": verifies,
        "drafted_per_tree": drafted / verifies if verifies else 0,
        "accepted_per_tree": accepted / verifies if verifies else 0,
        "tokens_per_branch_step": 1 + accepted / verifies if verifies else 1,
    }


def run_server(args, max_batch, modes, specs, prompts):
    """One server (--speculative-max-batch max_batch): every concurrency and mode; its rows."""
    http_port, metrics_port, grpc_port = free_port(), free_port(), free_port()
    server_args = [args.server, "--listen", f"127.0.0.1:{grpc_port}",
                   "--metrics-listen", f"127.0.0.1:{metrics_port}",
                   "--http-listen", f"127.0.0.1:{http_port}", "--backend", args.backend,
                   "--draft-model", os.path.join(ROOT, "models/default-draft"),
                   "--max-queued-jobs", "256", "--http-threads", "64", "--log-level", "warn",
                   "--speculative-max-batch", str(max_batch)]
    log = open(os.path.join(args.out, f"spec_serve_server_maxbatch{max_batch}.log"), "w")
    server = subprocess.Popen(server_args, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        # Warm up every mode (CUDA graphs of each shape, the prefix cache).
        for mode in modes:
            run_level(http_port, metrics_port, 4, 1.0, args.tokens, args.temperature, specs[mode],
                      prompts)
        for clients in [int(c) for c in args.concurrency.split(",")]:
            base = None
            for mode in modes:
                result = run_level(http_port, metrics_port, clients, args.seconds, args.tokens,
                                   args.temperature, specs[mode], prompts)
                if mode == "plain":
                    base = result["tokens_per_s"]
                result["speedup_vs_plain"] = result["tokens_per_s"] / base if base else None
                result["speculative_max_batch"] = max_batch
                method = mode if max_batch == 0 or mode == "plain" else f"{mode}_maxbatch{max_batch}"
                print(f"c{clients} {method:16s} {result['tokens_per_s']:9.0f} tok/s  "
                      f"x{result['speedup_vs_plain'] or 0:.2f}  tokens/step "
                      f"{result['tokens_per_branch_step']:.2f}  step "
                      f"{result['step_seconds_per_step'] * 1e6:.0f} us  draft share "
                      f"{result['draft_seconds_share']:.2f}  errors {result['errors']}",
                      flush=True)
                if mode == "plain" and max_batch != 0:
                    method = f"plain_server_maxbatch{max_batch}"
                rows.append({"case": f"trained_pair_c{clients}", "method": method,
                             "median_us": result["latency_median_s"] * 1e6,
                             "repetitions": result["requests"], "extra": result})
    finally:
        server.terminate()
        server.wait(timeout=30)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True, help="the deft-server binary")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default=".", help="folder of the result JSON")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--modes", default="plain,static,dynamic,ngram")
    parser.add_argument("--max-batch", default="0",
                        help="comma list of --speculative-max-batch values, one server each "
                        "(0: speculation never pauses)")
    parser.add_argument("--hardware", default="")
    parser.add_argument("--commit", default=os.environ.get("DEFT_COMMIT", ""))
    args = parser.parse_args()
    if not args.hardware and args.backend == "cpu":
        with open("/proc/cpuinfo") as cpuinfo:
            models = [l.split(":", 1)[1].strip() for l in cpuinfo if l.startswith("model name")]
        args.hardware = f"{models[0]} ({len(models)} cores)" if models else "cpu"

    prompts = prompts_from_corpus(64, random.Random(1))
    specs = {"plain": None, "static": {"policy": "static"}, "dynamic": {"policy": "dynamic"},
             "ngram": {"policy": "ngram"}}
    modes = args.modes.split(",")
    rows = []
    for max_batch in [int(v) for v in args.max_batch.split(",")]:
        rows += run_server(args, max_batch, modes, specs, prompts)
    out = {"benchmark": "spec_serve", "hardware": args.hardware, "commit": args.commit,
           "date": datetime.date.today().isoformat(),
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "floor": {}, "rows": rows}
    tag = "cpu" if args.backend == "cpu" or not args.hardware else args.hardware.split()[-1].lower()
    name = f"spec_serve-{tag}-{datetime.date.today().strftime('%Y%m%d')}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", name)

if __name__ == "__main__":
    main()
