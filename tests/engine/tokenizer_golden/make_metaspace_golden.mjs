// Writes golden_metaspace.jsonl: ids from Hugging Face `tokenizers` (Rust, through the npm
// package `tokenizers`) for the Llama 2 tokenizer.json rewritten to the Metaspace layout that
// newer sentencepiece-style files use (no normalizer; Metaspace pre-tokenizer and decoder), in
// two variants: prepend_scheme "first" without split, and "always" with split. The JavaScript
// reference is not used here: its Metaspace decoder differs from the Rust one.
//
//   scripts/fetch_tokenizers.sh --with-hf
//   node tests/engine/tokenizer_golden/make_metaspace_golden.mjs > tests/engine/tokenizer_golden/golden_metaspace.jsonl
//
// Line: {"text", "first": [ids], "first_decoded"?, "always": [ids], "always_decoded"?}, for the
// first 400 strings of golden.jsonl; *_decoded only where decoding does not give the text.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const cacheDir = process.env.DEFT_TOKENIZERS_DIR ?? path.resolve(here, "../../../.cache/tokenizers");
const require = createRequire(path.join(cacheDir, "package.json"));
const { Tokenizer } = require("tokenizers");

// Keep in step with metaspace_variant() in tests/engine/hf_tokenizer_test.cc.
export function metaspaceVariant(json, scheme, split) {
  const variant = structuredClone(json);
  const metaspace = { type: "Metaspace", replacement: "\u2581", prepend_scheme: scheme, split };
  variant.normalizer = null;
  variant.pre_tokenizer = metaspace;
  variant.decoder = { type: "Sequence", decoders: [{ type: "ByteFallback" }, metaspace] };
  return variant;
}

const llama2 = JSON.parse(fs.readFileSync(path.join(cacheDir, "llama2/tokenizer.json"), "utf8"));
const variants = {
  first: Tokenizer.fromString(JSON.stringify(metaspaceVariant(llama2, "first", false))),
  always: Tokenizer.fromString(JSON.stringify(metaspaceVariant(llama2, "always", true))),
};
const rows = fs.readFileSync(path.join(here, "golden.jsonl"), "utf8").split("\n").filter(Boolean)
  .slice(1).map(JSON.parse).filter((row) => "text" in row).slice(0, 400);
const lines = [JSON.stringify({ header: "Metaspace variants of the Llama 2 tokenizer.json (see make_metaspace_golden.mjs)",
  reference: "tokenizers 0.23.2 (npm, Rust)", count: rows.length })];
for (const { text } of rows) {
  const out = { text };
  for (const [name, tokenizer] of Object.entries(variants)) {
    const ids = (await tokenizer.encode(text, null, { addSpecialTokens: false })).getIds();
    out[name] = ids;
    const decoded = ids.length > 0 ? await tokenizer.decode(ids, false) : "";
    if (decoded !== text) out[`${name}_decoded`] = decoded;
  }
  lines.push(JSON.stringify(out));
}
process.stdout.write(lines.join("\n") + "\n");
