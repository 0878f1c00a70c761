// Drives the escrow proxy with the official OpenAI JavaScript SDK (openai) against a key with a
// requests-per-minute limit of ESCROW_REQUESTS (N), and prints, as one JSON line, every call the
// client made: its final status, its usage, and each HTTP attempt the SDK made for it (status,
// error code and type, Retry-After, retry-after-ms, x-should-retry and the x-ratelimit-*
// headers of requests). server/sdk_ratelimit_test.go runs it.
//
// The client is the SDK's default one (maxRetries 2, its own retry policy). Once it is built the
// script prints {"event":"ready"} and waits for a line on its standard input: the test lets it go
// a few seconds before the limit's minute ends. It then makes N + 1 chat completions one after
// another; the last one is refused rate_limit_exceeded and the SDK retries it after the pause
// the refusal asked for, when the next minute has begun.
//
// env: ESCROW_BASE_URL, ESCROW_KEY, ESCROW_MODEL, ESCROW_REQUESTS.
import readline from 'node:readline';
import OpenAI from 'openai';

const { ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_MODEL: model, ESCROW_REQUESTS: requests } = process.env;
const n = Number.parseInt(requests ?? '', 10);
if (!base || !key || !model || !(n > 0)) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_MODEL and ESCROW_REQUESTS (> 0) are required');
  process.exit(2);
}

// attempts are the HTTP attempts of the call under way (the fetch below appends to it).
let attempts = [];
const recording = async (url, init) => {
  const res = await fetch(url, init);
  const h = (name) => res.headers.get(name);
  const a = {
    status: res.status,
    retryAfter: h('retry-after'),
    retryAfterMs: h('retry-after-ms'),
    shouldRetry: h('x-should-retry'),
    limit: h('x-ratelimit-limit-requests'),
    remaining: h('x-ratelimit-remaining-requests'),
    reset: h('x-ratelimit-reset-requests'),
    code: null,
    type: null,
  };
  if (res.status !== 200) {
    const body = await res.clone().json().catch(() => null);
    a.code = body?.error?.code ?? null;
    a.type = body?.error?.type ?? null;
  }
  attempts.push(a);
  return res;
};
const client = new OpenAI({ baseURL: base + '/v1', apiKey: key, fetch: recording });

console.log(JSON.stringify({ event: 'ready' }));
const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
if ((await lines.next()).done) throw new Error('standard input closed before the test said go');
lines.return?.();
process.stdin.destroy();

const calls = [];
for (let i = 0; i <= n; i++) {
  attempts = [];
  const params = { model, messages: [{ role: 'user', content: `request ${i + 1} of ${n + 1}` }] };
  try {
    const { data, response } = await client.chat.completions.create(params).withResponse();
    calls.push({ status: response.status, completionTokens: data.usage.completion_tokens, attempts });
  } catch (err) {
    calls.push({ status: err.status ?? 0, error: err.message, attempts });
  }
}
console.log(JSON.stringify({ calls }));
