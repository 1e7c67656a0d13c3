#!/usr/bin/env python3
"""Summarises a kernel_timeline CSV (see kernel_timeline.cc): for each CUDA graph replayed at
least --min-replays times, the span of each replay, then per kernel (name, grid, block) its count
in one replay and its median duration over the last --last replays, and the kernels at positions
[--at, --at + --count) of the last replay with their start, duration and the gap to the kernel
before (negative: they overlap, e.g. a programmatic dependent launch waiting on its primary).

  python3 bench/kernel_timeline/kernel_timeline.py steps.csv [--graph ID] [--at 140 --count 10]
"""
import argparse
import collections
import csv
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--graph", type=int, help="only this graph id")
    ap.add_argument("--min-replays", type=int, default=3)
    ap.add_argument("--last", type=int, default=10, help="replays the medians cover")
    ap.add_argument("--at", type=int, default=0, help="first kernel of the listed window")
    ap.add_argument("--count", type=int, default=0, help="kernels listed (0: none)")
    args = ap.parse_args()

    by_graph = collections.defaultdict(list)
    with open(args.csv, newline="") as f:
        for start, end, graph, node, grid, block, name in csv.reader(f):
            if int(graph) != 0:
                by_graph[int(graph)].append(
                    (int(start), int(end), int(node), int(grid), int(block), name))
    for graph, kernels in sorted(by_graph.items()):
        if args.graph is not None and graph != args.graph:
            continue
        kernels.sort()
        nodes = len({k[2] for k in kernels})
        replays = [kernels[i:i + nodes] for i in range(0, len(kernels) - nodes + 1, nodes)]
        print(f"graph {graph}: {nodes} kernels a replay, {len(replays)} replays")
        if len(replays) < args.min_replays:
            continue
        last = replays[-args.last:]
        spans = [(r[-1][1] - r[0][0]) / 1e3 for r in last]
        print("  replay spans (us):", " ".join(f"{s:.0f}" for s in spans))
        durations = [statistics.median((r[i][1] - r[i][0]) / 1e3 for r in last)
                     for i in range(nodes)]
        totals = collections.OrderedDict()
        for i, k in enumerate(last[-1]):
            key = (k[5], k[3], k[4])
            count, total = totals.get(key, (0, 0.0))
            totals[key] = (count + 1, total + durations[i])
        print(f"  {'kernel':70s} {'grid':>6s} {'block':>5s} {'count':>5s} {'total us':>9s} {'each':>8s}")
        for (name, grid, block), (count, total) in sorted(totals.items(), key=lambda x: -x[1][1]):
            print(f"  {name[:70]:70s} {grid:6d} {block:5d} {count:5d} {total:9.1f} {total / count:8.2f}")
        replay = last[-1]
        t0 = replay[0][0]
        for i in range(args.at, min(nodes, args.at + args.count)):
            k = replay[i]
            gap = (k[0] - replay[i - 1][1]) / 1e3 if i > 0 else 0.0
            print(f"  {i:4d} {k[5][:60]:60s} grid {k[3]:5d} start {(k[0] - t0) / 1e3:9.2f} "
                  f"us, {durations[i]:7.2f} us, gap {gap:+6.2f}")


if __name__ == "__main__":
    main()
