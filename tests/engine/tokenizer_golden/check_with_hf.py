#!/usr/bin/env python3
"""Checks the golden file against Hugging Face `tokenizers` (the Rust library, from Python).

The golden ids were made with a JavaScript port (make_golden.mjs); this confirms they are what
the reference library gives, on a machine that has `tokenizers` installed:

    python3 tests/engine/tokenizer_golden/check_with_hf.py \
        --llama3 .cache/tokenizers/llama3/tokenizer.json \
        --llama2 .cache/tokenizers/llama2/tokenizer.json \
        [--golden tests/engine/tokenizer_golden/golden.jsonl]

(scripts/fetch_tokenizers.sh fetches both tokenizer.json files; copy them to that machine.)
Checks, per string: encode(text, add_special_tokens=False).ids, and decode(ids) against the text
(or "llama2_decoded"); per chat row: the Llama 3 chat template rendered as text and encoded with
special tokens parsed. Exits 1 on any mismatch and prints the first few.
"""
import argparse
import json
import pathlib
import sys

from tokenizers import Tokenizer


def render_llama3_chat(messages):
    # The chat_template of the Llama 3 tokenizer_config.json, with add_generation_prompt.
    text = "<|begin_of_text|>"
    for message in messages:
        text += ("<|start_header_id|>" + message["role"] + "<|end_header_id|>\n\n" +
                 message["content"].strip() + "<|eot_id|>")
    return text + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def main():
    here = pathlib.Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama3", required=True, help="Llama 3 tokenizer.json")
    parser.add_argument("--llama2", required=True, help="Llama 2 tokenizer.json")
    parser.add_argument("--golden", default=str(here / "golden.jsonl"))
    args = parser.parse_args()

    tokenizers = {"llama3": Tokenizer.from_file(args.llama3),
                  "llama2": Tokenizer.from_file(args.llama2)}
    strings = chats = 0
    failures = {"llama3": 0, "llama2": 0, "decode": 0, "chat": 0}

    def report(kind, message):
        failures[kind] += 1
        if failures[kind] <= 5:
            print(f"MISMATCH {kind}: {message}")

    with open(args.golden, encoding="utf-8") as golden:
        rows = [json.loads(line) for line in golden if line.strip()][1:]  # skip the header
    for row in rows:
        if "chat" in row:
            chats += 1
            text = render_llama3_chat(row["chat"])
            ids = tokenizers["llama3"].encode(text, add_special_tokens=False).ids
            if ids != row["llama3"]:
                report("chat", f"{row['chat']!r}: hf {ids} golden {row['llama3']}")
            continue
        strings += 1
        text = row["text"]
        for model, tokenizer in tokenizers.items():
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if ids != row[model]:
                report(model, f"{text[:80]!r}: hf {ids[:20]} golden {row[model][:20]}")
            expected = row.get("llama2_decoded", text) if model == "llama2" else text
            decoded = tokenizer.decode(row[model], skip_special_tokens=False)
            if row[model] and decoded != expected:
                report("decode", f"{model} {text[:80]!r}: hf {decoded[:80]!r}")
    print(f"{strings} strings, {chats} chats; mismatches: {failures}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
