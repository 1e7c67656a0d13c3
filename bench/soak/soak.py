#!/usr/bin/env python3
"""Soak: a bounded, mixed, concurrent load against the real deft-server for N minutes, then a
verdict on what must not drift under a steady load.

It starts deft-server (the embedded default model unless --server-args says otherwise), runs
closed-loop clients that each repeat jobs of four kinds in a seeded random order:
  generate  Generate, n 1-4 samples of 16-48 tokens; one in ten cancelled after a few messages
  runtree   RunTree, branch 2 ways every 8 tokens, depth 2, keep the best 2
  session   TreeSession: create, branch, decode both, score, prune one, extend, decode, close
  verify    a TreeSession holding a prompt, three unary Verify calls of a drafted token tree
and samples the server every --sample-seconds: RSS (/proc/PID/status), deft_kv_pages_used,
deft_kv_pages_cached, deft_live_jobs and the deft_step_latency_seconds histogram. After the load
it waits for the engine to go idle, stops the server with SIGTERM and reads its log.

Verdict (exit 1 when a check fails):
  errors    no client call failed other than the cancels it made itself, no error or critical
            line in the server log, and the server exited 0 on SIGTERM;
  kv        deft_kv_pages_used back to its baseline (0) once the load ends;
  rss       plateau: the peak RSS of the second half of the load is within 5 % (at least 8 MB)
            of the first half's peak;
  p99       the step latency p99 of the last minute is within 2x the first minute's (from the
            histogram's buckets, interpolated; noisy on a shared machine); one level only.
--smoke keeps only `errors` and `kv` (a short run proves nothing about plateaus or p99).

--concurrency takes a list (e.g. 16,32,64,64): the run is split into equal phases at those
client counts, with RSS reported per phase; that is how a high-water mark (RSS grows with the
peak concurrency, then holds at a repeated level) is told from a leak (it keeps growing).
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from deft.v1 import deft_pb2
from deft_client import DeftClient, SessionError

# Clients' words: prompts the tiny default model has seen (its corpus is children's stories).
WORDS = ("once upon a time there was a little tree in the forest and the sun was warm "
         "the girl saw a big dog who liked to play with his ball").split()

STEP_HISTOGRAM = "deft_step_latency_seconds_bucket"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the deft-server binary")
    parser.add_argument("--server-args", default="",
                        help="more server flags, split at whitespace")
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the load")
    parser.add_argument("--concurrency", default="4",
                        help="clients; a comma list runs equal phases in that order")
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mix", default="generate,runtree,session,verify",
                        help="job kinds, comma-separated")
    parser.add_argument("--json", help="write the figures here as JSON")
    parser.add_argument("--out", help="write bench/results-style soak-<hardware>-<date>.json "
                        "into this folder (../shared/BENCH_RESULTS.md)")
    parser.add_argument("--smoke", action="store_true",
                        help="check errors and KV only (a short run in CI)")
    parser.add_argument("--keep-log", help="copy the server log here")
    parser.add_argument("--hold-seconds", type=float, default=0,
                        help="keep the idle server this long after the load before stopping "
                        "it, to inspect it (its pid is printed at the start)")
    return parser.parse_args()


# ---- the server -------------------------------------------------------------------------

class Server:
    def __init__(self, binary, extra_args):
        self.dir = tempfile.mkdtemp(prefix="deft-soak-")
        self.log_path = os.path.join(self.dir, "server.log")
        port_file = os.path.join(self.dir, "ports")
        args = [binary, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--port-file", port_file, "--log-level", "info"] + extra_args
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"deft-server did not start:\n{self.read_log()}")
            time.sleep(0.05)
        ports = dict(line.split("=") for line in open(port_file).read().split())
        self.address = f"127.0.0.1:{ports['grpc']}"
        self.metrics_port = int(ports["metrics"])

    def rss_mb(self):
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        return float("nan")

    def metrics(self):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        values, buckets = {}, {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            if name.startswith(STEP_HISTOGRAM):
                bound = re.search(r'le="([^"]+)"', name).group(1)
                buckets[float("inf") if bound == "+Inf" else float(bound)] = float(value)
            elif "{" not in name:
                values[name] = float(value)
        values["buckets"] = buckets
        return values

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = "killed after 60 s"
        self.log.close()
        return code

    def read_log(self):
        with open(self.log_path, errors="replace") as log:
            return log.read()


def quantile_of(before, after, q):
    """The interpolated q-quantile (ms) of the steps between two cumulative bucket snapshots."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    target = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= target:
            if bound == float("inf"):
                return lower_bound * 1e3
            share = (target - lower_count) / max(count - lower_count, 1e-9)
            return (lower_bound + share * (bound - lower_bound)) * 1e3
        lower_bound, lower_count = bound, count
    return None


# ---- the clients ------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = {}
        self.cancelled = 0
        self.errors = []

    def ok(self, kind):
        with self.lock:
            self.done[kind] = self.done.get(kind, 0) + 1

    def error(self, kind, failure):
        with self.lock:
            self.errors.append(f"{kind}: {failure}")


def prompt(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def job_generate(client, rng, tally):
    stream = client.generate_stream(prompt(rng), n=rng.randint(1, 4),
                                    max_tokens=rng.randint(16, 48), temperature=0.8,
                                    seed=rng.randrange(1 << 30))
    cancel_after = rng.randint(2, 6) if rng.random() < 0.1 else None
    messages = 0
    try:
        for _ in stream:
            messages += 1
            if cancel_after is not None and messages >= cancel_after:
                stream.cancel()
    except grpc.RpcError as failure:
        if cancel_after is not None and failure.code() == grpc.StatusCode.CANCELLED:
            with tally.lock:
                tally.cancelled += 1
            return
        raise


def job_runtree(client, rng, tally):
    client.run_tree(prompt(rng), branch_factor=2, every_tokens=8, max_depth=2, keep_best=2,
                    max_tokens=24, temperature=0.8, seed=rng.randrange(1 << 30))


def job_session(client, rng, tally):
    with client.session() as session:
        root = session.create(prompt(rng))
        left, right = session.branch(root, 2)
        session.decode([left, right], max_tokens=16, temperature=0.8,
                       seed=rng.randrange(1 << 30))
        session.score(left, " the end")
        session.prune(right)
        session.extend(left, " and then")
        session.decode(left, max_tokens=8)
        session.close()


def job_verify(client, rng, tally):
    vocab = 512  # the default model's; ids only need to be inside it
    with client.session() as session:
        node = session.create(prompt(rng))
        for _ in range(3):
            size = rng.randint(2, 8)
            parents = [-1] + [rng.randrange(i) for i in range(1, size)]
            tokens = [rng.randrange(3, vocab) for _ in range(size)]
            verified = client.verify(session, node=node, tokens=tokens, parents=parents)
            node = verified.node
        session.close()


JOBS = {"generate": job_generate, "runtree": job_runtree, "session": job_session,
        "verify": job_verify}


def client_loop(address, seed, kinds, stop, tally):
    rng = random.Random(seed)
    with DeftClient(address, timeout=120.0) as client:
        while not stop.is_set():
            kind = rng.choice(kinds)
            try:
                JOBS[kind](client, rng, tally)
                tally.ok(kind)
            except (grpc.RpcError, SessionError) as failure:
                code = failure.code() if hasattr(failure, "code") else ""
                details = failure.details() if hasattr(failure, "details") else str(failure)
                tally.error(kind, f"{code} {details}")
            except Exception as failure:  # a client bug or a broken stream: counted, not fatal
                tally.error(kind, repr(failure))


# ---- the run ----------------------------------------------------------------------------

def cpu_name():
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def write_result(args, figures, samples, backend):
    """The run as a bench/results file: one row, the whole load's step latency quantiles (from
    the server's histogram) and every figure of the verdict in extra."""
    if backend == "cuda":
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
        hardware = gpu[0] if gpu else "unknown NVIDIA GPU"
        tag = "h200" if "H200" in hardware else "h100" if "H100" in hardware else "gpu"
    else:
        hardware, tag = cpu_name(), "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first, last = samples[0][5], samples[-1][5]
    row = {
        "case": f"mixed_c{args.concurrency.replace(',', '-')}_{args.minutes:g}min",
        "method": "deft_flatten",
        "median_us": round((quantile_of(first, last, 0.5) or 0) * 1e3, 1),
        "p10_us": round((quantile_of(first, last, 0.1) or 0) * 1e3, 1),
        "p90_us": round((quantile_of(first, last, 0.9) or 0) * 1e3, 1),
        "repetitions": figures["steps"],
        "extra": figures,
    }
    result = {
        "benchmark": "soak",
        "hardware": hardware,
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join([os.path.relpath(sys.argv[0], root)] + sys.argv[1:]),
        "floor": {},
        "rows": [row],
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"soak-{tag}-{time.strftime('%Y%m%d', time.gmtime())}.json")
    with open(path, "w") as out:
        json.dump(result, out, indent=2)
        out.write("\n")
    print(f"soak: wrote {path}")


def main():
    args = parse_args()
    # The checkout's commit when the run starts (the server binary should be built from it);
    # DEFT_COMMIT names it where the checkout is a copy without git (a GPU machine).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args.commit = os.environ.get("DEFT_COMMIT") or subprocess.run(
        ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    levels = [int(level) for level in args.concurrency.split(",")]
    kinds = args.mix.split(",")
    for kind in kinds:
        if kind not in JOBS:
            sys.exit(f"soak: unknown job kind '{kind}' (known: {', '.join(JOBS)})")
    server = Server(args.server, args.server_args.split())
    with DeftClient(server.address) as probe:
        probe.wait_until_serving(120)
        backend = probe.model_info().backend
    print(f"soak: deft-server pid {server.process.pid} on {server.address}; "
          f"{args.minutes:g} min at {args.concurrency} clients; mix {args.mix}", flush=True)

    tally = Tally()
    samples = []  # (t, rss_mb, kv_used, kv_cached, live_jobs, buckets)
    start = time.monotonic()
    baseline = server.metrics()
    samples.append((0.0, server.rss_mb(), baseline.get("deft_kv_pages_used", 0),
                    baseline.get("deft_kv_pages_cached", 0), baseline.get("deft_live_jobs", 0),
                    baseline["buckets"]))
    phase_seconds = args.minutes * 60.0 / len(levels)
    phases = []
    next_print = 60.0
    for phase, level in enumerate(levels):
        stop = threading.Event()
        clients = [threading.Thread(target=client_loop,
                                    args=(server.address, args.seed * 1000 + phase * 100 + i,
                                          kinds, stop, tally), daemon=True)
                   for i in range(level)]
        for client in clients:
            client.start()
        phase_end = start + (phase + 1) * phase_seconds
        while time.monotonic() < phase_end:
            time.sleep(min(args.sample_seconds, max(phase_end - time.monotonic(), 0.01)))
            now = time.monotonic() - start
            m = server.metrics()
            samples.append((now, server.rss_mb(), m.get("deft_kv_pages_used", 0),
                            m.get("deft_kv_pages_cached", 0), m.get("deft_live_jobs", 0),
                            m["buckets"]))
            if now >= next_print:
                next_print += 60.0
                with tally.lock:
                    done = sum(tally.done.values())
                    errors = len(tally.errors)
                print(f"  {now / 60:5.1f} min  RSS {samples[-1][1]:7.1f} MB  "
                      f"KV used {samples[-1][2]:5.0f} cached {samples[-1][3]:5.0f}  "
                      f"jobs {done}  errors {errors}", flush=True)
        stop.set()
        for client in clients:
            client.join(180)
        phase_samples = [s for s in samples if s[0] > phase * phase_seconds]
        phases.append({"clients": level, "rss_end_mb": round(server.rss_mb(), 1),
                       "rss_peak_mb": round(max(s[1] for s in phase_samples), 1)})
    load_end = time.monotonic() - start

    # Idle: every job answered; KV referenced by live work must be back to the baseline.
    deadline = time.monotonic() + 30
    final = server.metrics()
    while (final.get("deft_kv_pages_used", 0) != baseline.get("deft_kv_pages_used", 0)
           or final.get("deft_live_jobs", 0) != 0) and time.monotonic() < deadline:
        time.sleep(0.2)
        final = server.metrics()
    # The server hands free heap back to the OS after a second without work
    # (server/engine_thread.cc): the idle RSS is read after that.
    time.sleep(3)
    rss_end = server.rss_mb()
    if args.hold_seconds > 0:
        print(f"soak: idle, RSS {rss_end:.1f} MB; holding the server {args.hold_seconds:g} s",
              flush=True)
        time.sleep(args.hold_seconds)
        figures_hold_rss = server.rss_mb()
        print(f"soak: RSS after the hold {figures_hold_rss:.1f} MB", flush=True)
    exit_code = server.stop()
    log = server.read_log()
    shutil.rmtree(server.dir, ignore_errors=True)
    if args.keep_log:
        with open(args.keep_log, "w") as out:
            out.write(log)
    error_lines = [line for line in log.splitlines()
                   if re.search(r'\b(error|critical)\b', line.split(" ", 2)[1] if " " in line
                                else "") or '"level":"error"' in line
                   or '"level":"critical"' in line]
    warn_lines = [line for line in log.splitlines()
                  if " warning " in line or '"level":"warning"' in line]

    # Figures.
    rss = [(t, r) for t, r, *_ in samples]
    half = load_end / 2
    first_half_peak = max(r for t, r in rss if t <= half)
    second_half_peak = max((r for t, r in rss if t > half), default=first_half_peak)

    def bucket_at(t):
        return min(samples, key=lambda s: abs(s[0] - t))[5]

    minute = min(60.0, load_end / 2)
    p99_first = quantile_of(bucket_at(0.0), bucket_at(minute), 0.99)
    p99_last = quantile_of(bucket_at(load_end - minute), samples[-1][5], 0.99)
    steps = samples[-1][5].get(float("inf"), 0) - samples[0][5].get(float("inf"), 0)
    figures = {
        "minutes": round(load_end / 60, 2),
        "concurrency": args.concurrency,
        "mix": args.mix,
        "jobs": dict(tally.done),
        "client_cancels": tally.cancelled,
        "client_errors": len(tally.errors),
        "steps": int(steps),
        "rss_mb": {"start": round(samples[0][1], 1), "peak": round(max(r for _, r in rss), 1),
                   "first_half_peak": round(first_half_peak, 1),
                   "second_half_peak": round(second_half_peak, 1), "end_idle": round(rss_end, 1)},
        "phases": phases,
        "kv_pages_used": {"baseline": baseline.get("deft_kv_pages_used", 0),
                          "peak": max(s[2] for s in samples),
                          "end": final.get("deft_kv_pages_used", 0),
                          "cached_end": final.get("deft_kv_pages_cached", 0)},
        "step_p99_ms": {"first_minute": p99_first and round(p99_first, 2),
                        "last_minute": p99_last and round(p99_last, 2), "window_s": minute},
        "server_exit": exit_code,
        "server_error_lines": len(error_lines),
        "server_warning_lines": len(warn_lines),
    }
    checks = {
        "errors": not tally.errors and not error_lines and exit_code == 0,
        "kv": final.get("deft_kv_pages_used", 0) == baseline.get("deft_kv_pages_used", 0),
    }
    if not args.smoke:
        checks["rss"] = second_half_peak <= first_half_peak + max(0.05 * first_half_peak, 8.0)
        if len(levels) == 1:  # phases of different loads have different step times
            checks["p99"] = (p99_first is not None and p99_last is not None
                             and p99_last <= 2.0 * p99_first)
    figures["verdict"] = {name: "pass" if ok else "FAIL" for name, ok in checks.items()}

    print(json.dumps(figures, indent=2))
    for failure in tally.errors[:20]:
        print(f"client error: {failure}")
    for line in error_lines[:20]:
        print(f"server error line: {line}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    if args.out:
        write_result(args, figures, samples, backend)
    verdict = all(checks.values())
    print(f"soak verdict: {'PASS' if verdict else 'FAIL'} "
          f"({', '.join(f'{k} {v}' for k, v in figures['verdict'].items())})")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
