#!/usr/bin/env python3
"""Tree-of-thought breadth-first search over a TreeSession, with the model as its own evaluator.

    python3 examples/tot_bfs.py --server 127.0.0.1:50051 [--prompt TEXT] [--depth 3]
        [--branch 3] [--keep 2] [--step-tokens 16] [--delimiter .] [--temperature 0.8]

The server keeps the whole search tree's KV; this client only sends commands. Per depth:
  1. branch: every frontier node gets k empty children;
  2. decode: all children decode one step in a single command (same engine steps), until the
     delimiter or --step-tokens tokens; sampled, each node with its own seed;
  3. evaluate: the model scores, after each child, an evaluation suffix (" This step is
     correct.") against a contrast suffix (" This step is wrong."); the value of the child is
     the difference of the two log-probabilities (score commands keep nothing);
  4. keep the best w children as the next frontier (a path whose text repeats a better one's
     counts once) and prune the rest (their KV is freed).
The best path's text is printed at the end. The default model (models/default) is a tiny
Llama trained on one short story: its steps read like text, its judgement is not smart.

Needs grpcio and the deft.v1 stubs (examples/client_import.py says where they are looked for).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_import import import_client  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051", help="deft-server HOST:PORT")
    parser.add_argument("--prompt", default="The child asked the tree a question.",
                        help="the problem / story start")
    parser.add_argument("--depth", type=int, default=3, help="search depth (steps)")
    parser.add_argument("--branch", type=int, default=3, help="children per frontier node (k)")
    parser.add_argument("--keep", type=int, default=2, help="nodes kept per depth (w)")
    parser.add_argument("--step-tokens", type=int, default=16, help="max tokens per step")
    parser.add_argument("--delimiter", default=".", help="a step ends with this text")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--evaluation", default=" This step is correct.",
                        help="the suffix whose log-probability rates a step")
    parser.add_argument("--contrast", default=" This step is wrong.",
                        help="subtracted from the evaluation (empty: none)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per command")
    args = parser.parse_args()
    if args.depth < 1 or args.branch < 1 or args.keep < 1 or args.step_tokens < 1:
        parser.error("--depth, --branch, --keep and --step-tokens must be >= 1")
    delimiter = args.delimiter.encode().decode("unicode_escape")  # "\\n" -> newline

    deft_client = import_client()
    pb = deft_client.deft_pb2
    suffixes = [args.evaluation] + ([args.contrast] if args.contrast else [])
    with deft_client.DeftClient(args.server, timeout=args.timeout) as client:
        deft_client.grpc.channel_ready_future(client.channel).result(timeout=args.timeout)
        with client.session() as session:
            root = session.create(args.prompt)
            print(f"session {session.session_id}: root node {root}: {args.prompt!r}")
            parent = {root: None}
            step_of = {root: args.prompt}
            value_of = {root: 0.0}
            ended = set()  # nodes whose step ended with EOS: not expanded again

            def path_text(node):
                steps_back = []
                while node is not None:
                    steps_back.append(step_of[node])
                    node = parent[node]
                return "".join(reversed(steps_back))
            frontier = [root]
            for depth in range(1, args.depth + 1):
                open_nodes = [node for node in frontier if node not in ended]
                if not open_nodes:
                    print(f"depth {depth}: every path has ended")
                    break
                children = []
                for node in open_nodes:
                    for child in session.branch(node, args.branch):
                        parent[child] = node
                        children.append(child)
                steps = session.decode(children, max_tokens=args.step_tokens,
                                       temperature=args.temperature, seed=args.seed,
                                       stop=[delimiter] if delimiter else [])
                # Every evaluation in flight at once: commands of one session run in order.
                pending = {child: [session.send(score=pb.ScoreCommand(
                                       node=child, continuation=pb.Prompt(text=suffix)))
                                   for suffix in suffixes]
                           for child in children}
                for child in children:
                    logprobs = [p.wait(args.timeout)[-1].scored.logprob for p in pending[child]]
                    value_of[child] = logprobs[0] - sum(logprobs[1:])
                    step = steps[child]
                    # A step cut by its stop string streams the text before it.
                    step_of[child] = step.text + (delimiter if step.finish_reason == "stop"
                                                  else "")
                    if step.finish_reason == "eos":
                        ended.add(child)
                # Best first; a path whose text repeats a better one's is a duplicate (a
                # confident model samples the same step often): kept once.
                ranked = sorted(children, key=lambda node: -value_of[node])
                frontier, seen = [], set()
                for node in ranked:
                    text = path_text(node)
                    if len(frontier) < args.keep and text not in seen:
                        frontier.append(node)
                    seen.add(text)
                print(f"depth {depth}: {len(ranked)} candidates, keeping {len(frontier)}")
                for node in ranked:
                    mark = "keep " if node in frontier else "prune"
                    print(f"  {mark} node {node:3d} (parent {parent[node]:3d}) value "
                          f"{value_of[node]:+8.3f} [{steps[node].finish_reason}] "
                          f"{step_of[node]!r}")
                for node in ranked:
                    if node not in frontier:
                        session.prune(node)
            best = max(frontier, key=lambda node: value_of[node])
            path = [best]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])
            path.reverse()
            print("best path: " + " ".join(str(node) for node in path))
            print("best text: " + path_text(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
