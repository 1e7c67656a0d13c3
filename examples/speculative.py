#!/usr/bin/env python3
"""Speculative decoding served by the server: the same Generate with and without it.

    build/server/deft-server --draft-model models/default-draft &
    python3 examples/speculative.py [--server 127.0.0.1:50051] [--prompt TEXT]
        [--policy static|dynamic|ngram] [--max-tokens 128] [--temperature 0] [--seed 1]

Runs the prompt plainly, then speculatively (the server drafts a token tree per step with its
draft model, or by prompt lookup for "ngram", and verifies it in the same step), and prints both
outputs, whether they are the same tokens (they must be, greedy or seeded), the time each took,
and the speculative stats the server returned: drafted and accepted tokens, tokens per step.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_import import import_client  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051", help="deft-server HOST:PORT")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--policy", default="static", choices=["static", "dynamic", "ngram"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    deft_client = import_client()
    client = deft_client.DeftClient(args.server)
    info = client.model_info()
    if args.policy != "ngram" and not info.draft_model:
        sys.exit(f"the server at {args.server} has no draft model: start it with --draft-model "
                 "DIR, or use --policy ngram")
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.monotonic()
    [plain] = client.generate(args.prompt, **sampling)
    plain_s = time.monotonic() - start
    start = time.monotonic()
    [spec] = client.generate(args.prompt, speculative=args.policy, **sampling)
    spec_s = time.monotonic() - start

    print(f"plain       ({len(plain.ids)} tokens, {plain_s * 1e3:.0f} ms): {plain.text!r}")
    print(f"speculative ({len(spec.ids)} tokens, {spec_s * 1e3:.0f} ms): {spec.text!r}")
    print("same tokens:", spec.ids == plain.ids)
    stats = spec.speculative
    if stats and stats["steps"]:
        print(f"draft model {info.draft_model or '(none: prompt lookup)'}: "
              f"{stats['accepted']} of {stats['drafted']} drafted tokens accepted in "
              f"{stats['steps']} steps, {1 + stats['accepted'] / stats['steps']:.2f} tokens a step")
    return 0 if spec.ids == plain.ids else 1


if __name__ == "__main__":
    sys.exit(main())
