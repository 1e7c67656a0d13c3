// Checks the golden file against Hugging Face `tokenizers` (the Rust library) through its
// official Node binding, the npm package `tokenizers` (prebuilt native code):
//
//   scripts/fetch_tokenizers.sh --with-hf
//   node tests/engine/tokenizer_golden/check_with_hf.mjs [GOLDEN_FILE]
//
// The same checks as check_with_hf.py (which needs Python `tokenizers`). Exits 1 on a mismatch.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const cacheDir = process.env.DEFT_TOKENIZERS_DIR ?? path.resolve(here, "../../../.cache/tokenizers");
const require = createRequire(path.join(cacheDir, "package.json"));
const { Tokenizer } = require("tokenizers");
const goldenPath = process.argv[2] ?? path.join(here, "golden.jsonl");

const tokenizers = {
  llama3: Tokenizer.fromFile(path.join(cacheDir, "llama3/tokenizer.json")),
  llama2: Tokenizer.fromFile(path.join(cacheDir, "llama2/tokenizer.json")),
};
const failures = { llama3: 0, llama2: 0, decode: 0, chat: 0 };
function report(kind, message) {
  if (failures[kind]++ < 5) console.log(`MISMATCH ${kind}: ${message}`);
}
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

const rows = fs.readFileSync(goldenPath, "utf8").split("\n").filter(Boolean).slice(1).map(JSON.parse);
let strings = 0, chats = 0;
for (const row of rows) {
  if ("chat" in row) {
    chats++;
    let text = "<|begin_of_text|>";
    for (const m of row.chat) {
      text += `<|start_header_id|>${m.role}<|end_header_id|>\n\n${m.content.trim()}<|eot_id|>`;
    }
    text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    const ids = (await tokenizers.llama3.encode(text, null, { addSpecialTokens: false })).getIds();
    if (!same(ids, row.llama3)) report("chat", JSON.stringify(row.chat));
    continue;
  }
  strings++;
  for (const [model, tokenizer] of Object.entries(tokenizers)) {
    const ids = (await tokenizer.encode(row.text, null, { addSpecialTokens: false })).getIds();
    if (!same(ids, row[model])) report(model, `${JSON.stringify(row.text).slice(0, 80)}: hf ${ids}`);
    const expected = model === "llama2" && "llama2_decoded" in row ? row.llama2_decoded : row.text;
    if (row[model].length > 0) {
      const decoded = await tokenizer.decode(row[model], false);
      if (decoded !== expected) report("decode", `${model} ${JSON.stringify(row.text).slice(0, 80)}`);
    }
  }
}
console.log(`${strings} strings, ${chats} chats; mismatches: ${JSON.stringify(failures)}`);
process.exit(Object.values(failures).some((n) => n > 0) ? 1 : 0);
