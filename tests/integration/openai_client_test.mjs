// The official `openai` npm package against the real deft-server's HTTP API: completions, chat,
// streaming, n > 1 (one prompt prefill), logprobs, stop, seed, the tree extension, errors and
// API keys. Run by openai_client_test.sh (ctest integration.openai_node), which installs the
// package and passes its folder in OPENAI_NPM_PREFIX, the server binary in DEFT_SERVER_BINARY.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';

const require = createRequire(path.join(process.env.OPENAI_NPM_PREFIX, 'package.json'));
const OpenAI = require('openai');
const SERVER = process.env.DEFT_SERVER_BINARY;
const MODEL = 'default';
const API_KEY = 'openai-test-key-0123456789abcdef';

// Starts deft-server on free loopback ports and waits for GET /health = 200.
async function startServer(extra = []) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'deft-openai-'));
  const portFile = path.join(dir, 'ports.txt');
  const log = fs.openSync(path.join(dir, 'server.log'), 'w');
  const child = spawn(SERVER, ['--listen', '127.0.0.1:0', '--metrics-listen', '127.0.0.1:0',
    '--http-listen', '127.0.0.1:0', '--port-file', portFile, '--kv-pages', '512',
    '--no-prefix-cache', ...extra], { stdio: ['ignore', log, log] });
  const deadline = Date.now() + 60_000;
  let ports = null;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) break;
    if (fs.existsSync(portFile)) {
      ports = Object.fromEntries(fs.readFileSync(portFile, 'utf8').trim().split('\n')
        .map((line) => line.split('=')).map(([k, v]) => [k, Number(v)]));
      try {
        if ((await fetch(`http://127.0.0.1:${ports.http}/health`)).status === 200) break;
      } catch { /* not yet */ }
    }
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  const logText = () => fs.readFileSync(path.join(dir, 'server.log'), 'utf8');
  assert.ok(ports && ports.http > 0, `deft-server did not serve HTTP:\n${logText()}`);
  return {
    child, ports, logText,
    baseURL: `http://127.0.0.1:${ports.http}/v1`,
    async metric(name) {
      const text = await (await fetch(`http://127.0.0.1:${ports.metrics}/metrics`)).text();
      const line = text.split('\n').find((l) => l.startsWith(`${name} `));
      return line ? Number(line.split(' ')[1]) : NaN;
    },
    stop() { child.kill('SIGTERM'); fs.rmSync(dir, { recursive: true, force: true }); },
  };
}

describe('openai npm client, no keys', () => {
  let server;
  let client;
  before(async () => {
    server = await startServer();
    client = new OpenAI({ baseURL: server.baseURL, apiKey: 'unused', maxRetries: 0 });
  });
  after(() => server.stop());

  test('models.list names the served model', async () => {
    const models = await client.models.list();
    assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
    assert.equal((await client.models.retrieve(MODEL)).id, MODEL);
  });

  test('completions: text, finish_reason, usage', async () => {
    const answer = await client.completions.create(
      { model: MODEL, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 });
    assert.equal(answer.object, 'text_completion');
    assert.equal(answer.choices.length, 1);
    assert.equal(typeof answer.choices[0].text, 'string');
    assert.ok(['length', 'stop'].includes(answer.choices[0].finish_reason));
    assert.ok(answer.usage.prompt_tokens > 0);
    assert.ok(answer.usage.completion_tokens > 0 && answer.usage.completion_tokens <= 8);
    assert.equal(answer.usage.total_tokens,
      answer.usage.prompt_tokens + answer.usage.completion_tokens);
    // Greedy twice: the same text.
    const again = await client.completions.create(
      { model: MODEL, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 });
    assert.equal(again.choices[0].text, answer.choices[0].text);
  });

  test('n > 1: n choices from one prompt prefill (the prompt KV is shared)', async () => {
    const prompt = 'The tree grew beside the river. '.repeat(20);
    const rowsBefore = await server.metric('deft_step_rows_total');
    const answer = await client.completions.create({
      model: MODEL, prompt, max_tokens: 6, n: 4, temperature: 1, seed: 7, ignore_eos: true,
    });
    assert.deepEqual(answer.choices.map((c) => c.index), [0, 1, 2, 3]);
    assert.equal(answer.usage.completion_tokens, 24);
    // Query rows the engine ran: the prompt once plus one row per generated token at most;
    // a prompt per sample would be 4 times the prompt.
    const rows = (await server.metric('deft_step_rows_total')) - rowsBefore;
    const promptTokens = answer.usage.prompt_tokens;
    assert.ok(promptTokens > 100, `prompt of ${promptTokens} tokens`);
    assert.ok(rows <= promptTokens + 24, `${rows} rows for a ${promptTokens}-token prompt, n 4`);
    // The same seed gives the same samples.
    const again = await client.completions.create({
      model: MODEL, prompt, max_tokens: 6, n: 4, temperature: 1, seed: 7, ignore_eos: true,
    });
    assert.deepEqual(again.choices.map((c) => c.text), answer.choices.map((c) => c.text));
  });

  test('completions logprobs and stop', async () => {
    const answer = await client.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 6, temperature: 0, logprobs: 2,
      ignore_eos: true,
    });
    const { logprobs } = answer.choices[0];
    assert.equal(logprobs.tokens.length, 6);
    assert.equal(logprobs.token_logprobs.length, 6);
    assert.ok(logprobs.token_logprobs.every((lp) => lp <= 0));
    assert.ok(logprobs.top_logprobs.every((top) => Object.keys(top).length >= 1));
    const stopped = await client.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 32, temperature: 0, stop: ['e', 'a'],
    });
    assert.ok(!/[ea]/.test(stopped.choices[0].text), stopped.choices[0].text);
  });

  test('chat.completions: the assistant message, logprobs', async () => {
    const answer = await client.chat.completions.create({
      model: MODEL, max_completion_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 2,
      messages: [{ role: 'system', content: 'You tell stories.' },
        { role: 'user', content: 'Tell me about a tree.' }],
    });
    assert.equal(answer.object, 'chat.completion');
    assert.equal(answer.choices[0].message.role, 'assistant');
    assert.equal(typeof answer.choices[0].message.content, 'string');
    const content = answer.choices[0].logprobs.content;
    assert.equal(content.length, answer.usage.completion_tokens);
    assert.ok(content.every((t) => Array.isArray(t.bytes) && t.top_logprobs.length <= 2));
  });

  test('streaming completions, n = 2, usage in the last chunk', async () => {
    const stream = await client.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 5, n: 2, stream: true,
      stream_options: { include_usage: true }, ignore_eos: true, seed: 3,
    });
    const texts = ['', ''];
    const finished = [null, null];
    let usage = null;
    for await (const chunk of stream) {
      for (const choice of chunk.choices) {
        texts[choice.index] += choice.text;
        if (choice.finish_reason) finished[choice.index] = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    assert.deepEqual(finished, ['length', 'length']);
    assert.equal(usage.completion_tokens, 10);
    // The streamed text is the text a non-streamed request with the same seed gets.
    const whole = await client.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 5, n: 2, ignore_eos: true, seed: 3,
    });
    assert.deepEqual(texts, whole.choices.map((c) => c.text));
  });

  test('streaming chat: role first, then content deltas', async () => {
    const stream = await client.chat.completions.create({
      model: MODEL, max_tokens: 6, temperature: 0, stream: true,
      messages: [{ role: 'user', content: 'Hello' }],
    });
    let first = true;
    let text = '';
    let finish = null;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      const [choice] = chunk.choices;
      if (first) assert.equal(choice.delta.role, 'assistant');
      first = false;
      text += choice.delta.content ?? '';
      finish = choice.finish_reason ?? finish;
    }
    assert.ok(['length', 'stop'].includes(finish));
    const whole = await client.chat.completions.create({
      model: MODEL, max_tokens: 6, temperature: 0, messages: [{ role: 'user', content: 'Hello' }],
    });
    assert.equal(text, whole.choices[0].message.content);
  });

  test('the tree extension: deft.tree runs a RunTree job', async () => {
    const answer = await client.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 12, ignore_eos: true,
      deft: { tree: { branch_factor: 2, every_tokens: 4, max_depth: 2, keep_best: 1 } },
    });
    const { nodes, best_path: bestPath } = answer.deft.tree;
    assert.ok(nodes.length >= 5, JSON.stringify(nodes));
    assert.equal(bestPath[0], 0);
    const bestText = bestPath.slice(1).map((id) => nodes.find((n) => n.id === id).text).join('');
    assert.equal(answer.choices[0].text, bestText);
  });

  test('the speculative extension: deft.speculative gives the plain tokens and its stats', async () => {
    const prompt = 'the girl saw a big dog and the big dog saw the girl and the';
    const plain = await client.completions.create({
      model: MODEL, prompt, max_tokens: 24, temperature: 0, ignore_eos: true,
    });
    assert.equal(plain.choices[0].deft, undefined);
    const speculative = { speculative: { policy: 'ngram' } };
    const answer = await client.completions.create({
      model: MODEL, prompt, max_tokens: 24, temperature: 0, ignore_eos: true, deft: speculative,
    });
    assert.equal(answer.choices[0].text, plain.choices[0].text);
    const stats = answer.choices[0].deft.speculative;
    assert.ok(stats.steps > 0 && stats.steps <= 24, JSON.stringify(stats));
    assert.ok(stats.accepted >= 0 && stats.accepted <= stats.drafted, JSON.stringify(stats));
    // Streamed: the chunk that finishes the choice carries its stats.
    const stream = await client.completions.create({
      model: MODEL, prompt, max_tokens: 24, temperature: 0, ignore_eos: true, deft: speculative,
      stream: true,
    });
    let text = '';
    let streamed;
    for await (const chunk of stream) {
      for (const choice of chunk.choices) {
        text += choice.text;
        if (choice.finish_reason) streamed = choice.deft?.speculative;
      }
    }
    assert.equal(text, plain.choices[0].text);
    assert.ok(streamed && streamed.steps > 0 && streamed.accepted <= streamed.drafted,
      JSON.stringify(streamed));
  });

  test('errors: OpenAI error classes with status, param and code', async () => {
    await assert.rejects(
      client.completions.create({ model: 'gpt-4', prompt: 'x' }),
      (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
    await assert.rejects(
      client.completions.create({ model: MODEL, prompt: 'x', n: 0 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'n' && /n = 0/.test(e.message));
    await assert.rejects(
      client.completions.create({ model: MODEL, prompt: 'x', echo: true }),
      (e) => e instanceof OpenAI.BadRequestError && e.code === 'unsupported_parameter');
    await assert.rejects(
      client.completions.create({ model: MODEL, prompt: 'x', max_tokens: 100000 }),
      (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded');
    await assert.rejects(
      client.chat.completions.create({ model: MODEL, messages: [{ role: 'assistant', content: 'x' }] }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'messages');
    await assert.rejects(
      client.completions.create({ model: MODEL, prompt: 'x', temperature: 5 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'temperature');
  });
});

describe('openai npm client, API keys', () => {
  let server;
  let dir;
  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'deft-openai-keys-'));
    fs.writeFileSync(path.join(dir, 'keys.txt'), `node:${API_KEY}\n`);
    server = await startServer(['--api-keys', path.join(dir, 'keys.txt'),
      '--max-concurrent-per-key', '1']);
  });
  after(() => { server.stop(); fs.rmSync(dir, { recursive: true, force: true }); });

  test('a missing or wrong key is 401; the right one is served', async () => {
    const wrong = new OpenAI({ baseURL: server.baseURL, apiKey: 'not-the-key-0123456789', maxRetries: 0 });
    await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
    await assert.rejects(
      wrong.completions.create({ model: MODEL, prompt: 'x', max_tokens: 2 }),
      (e) => e instanceof OpenAI.AuthenticationError && e.code === 'invalid_api_key');
    const right = new OpenAI({ baseURL: server.baseURL, apiKey: API_KEY, maxRetries: 0 });
    const answer = await right.completions.create({ model: MODEL, prompt: 'x', max_tokens: 2 });
    assert.equal(answer.choices.length, 1);
  });

  test('per-key limits apply to HTTP as to gRPC: 429', async () => {
    const right = new OpenAI({ baseURL: server.baseURL, apiKey: API_KEY, maxRetries: 0 });
    // One stream open (max_concurrent_per_key 1): a second request is refused.
    const stream = await right.completions.create({
      model: MODEL, prompt: 'Once', max_tokens: 200, ignore_eos: true, stream: true,
    });
    const iterator = stream[Symbol.asyncIterator]();
    await iterator.next();
    await assert.rejects(
      right.completions.create({ model: MODEL, prompt: 'x', max_tokens: 2 }),
      (e) => e instanceof OpenAI.RateLimitError && /max_concurrent_per_key/.test(e.message));
    stream.controller.abort();
  });
});
