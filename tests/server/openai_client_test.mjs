// kvserve serve through the official OpenAI Node.js client: completions and
// chat, streamed and not, at temperature 0 equal `kvserve generate`; a bad
// request surfaces as the client's BadRequestError with OpenAI's error fields;
// SIGTERM drains and exits 0.
//
// usage: node openai_client_test.mjs KVSERVE_BINARY MODEL.gguf
// The `openai` package comes from `npm ci` in this folder (scripts/install_deps.sh).
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';

const [kvserve, model] = process.argv.slice(2);
if (!kvserve || !model) {
  console.error('usage: node openai_client_test.mjs KVSERVE_BINARY MODEL.gguf');
  process.exit(2);
}

let OpenAI;
try {
  ({ default: OpenAI } = await import('openai'));
} catch (e) {
  console.error(`the openai package is not installed: run \`npm ci --prefix tests/server\` ` +
                `(scripts/install_deps.sh does) (${e.message})`);
  process.exit(1);
}

const prompt = 'Once upon a time';
// kvserve generate --max-tokens 256 runs 256 positions; the prompt is 5 tokens
// with BOS, so it generates 252; it prints the prompt first and a newline last.
const generated = execFileSync(kvserve, ['generate', '--model', model, '--prompt', prompt, '--max-tokens', '256',
                                         '--temperature', '0', '--threads', '1'],
                                  { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
assert.ok(generated.startsWith(prompt) && generated.endsWith('\n'));
const want = generated.slice(prompt.length, -1);

const server = spawn(kvserve, ['serve', '--model', model, '--port', '0', '--threads', '1', '--max-num-seqs', '4',
                               '--served-model-name', 'stories'], { stdio: ['ignore', 'ignore', 'pipe'] });
let log = '';
const exited = new Promise((resolve) => server.on('exit', (code, signal) => resolve({ code, signal })));
const url = await new Promise((resolve, reject) => {
  const timer = setTimeout(() => reject(new Error(`no "listening on" line within 30 s:\n${log}`)), 30000);
  server.stderr.on('data', (d) => {
    log += d;
    const m = log.match(/listening on (http:\/\/\S+)/);
    if (m) {
      clearTimeout(timer);
      resolve(m[1]);
    }
  });
  exited.then(({ code }) => reject(new Error(`kvserve serve exited (${code}) before listening:\n${log}`)));
});

try {
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'sk-any', maxRetries: 0, timeout: 60000 });

  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ['stories']);

  const whole = await client.completions.create({ model: 'stories', prompt, max_tokens: 252, temperature: 0 });
  assert.equal(whole.object, 'text_completion');
  assert.equal(whole.choices[0].text, want);
  assert.equal(whole.choices[0].finish_reason, 'length');
  assert.deepEqual(whole.usage, { prompt_tokens: 5, completion_tokens: 252, total_tokens: 257,
                                  prompt_tokens_details: { cached_tokens: 0 } });

  const stream = await client.completions.create({ model: 'stories', prompt, max_tokens: 252, temperature: 0,
                                                   stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) {
      text += chunk.choices[0].text;
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, want);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 252);

  const messages = [{ role: 'system', content: 'You tell stories.' }, { role: 'user', content: 'A cat and a dog' }];
  const chat = await client.chat.completions.create({ model: 'stories', messages, max_completion_tokens: 40,
                                                      temperature: 0 });
  assert.equal(chat.object, 'chat.completion');
  assert.equal(chat.choices[0].message.role, 'assistant');
  assert.ok(chat.choices[0].message.content.length > 0);
  let streamed = '';
  let role = null;
  for await (const chunk of await client.chat.completions.create({ model: 'stories', messages,
                                                                   max_completion_tokens: 40, temperature: 0,
                                                                   stream: true })) {
    role = chunk.choices[0]?.delta?.role ?? role;
    streamed += chunk.choices[0]?.delta?.content ?? '';
  }
  assert.equal(role, 'assistant');
  assert.equal(streamed, chat.choices[0].message.content);
  assert.equal(chat.usage.completion_tokens, 40);

  await assert.rejects(client.completions.create({ model: 'stories', prompt, temperature: 5 }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.equal(e.status, 400);
    assert.equal(e.param, 'temperature');
    assert.equal(e.type, 'invalid_request_error');
    return true;
  });
  await assert.rejects(client.completions.create({ model: 'gpt-4', prompt }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.code, 'model_not_found');
    return true;
  });
} finally {
  server.kill('SIGTERM');
}
const { code, signal } = await exited;
assert.equal(signal, null, `kvserve serve died of ${signal}:\n${log}`);
assert.equal(code, 0, `kvserve serve exited ${code}:\n${log}`);
assert.match(log, /stopped after \d+ requests \(0 cancelled\)/);
console.log('openai client test: ok');
