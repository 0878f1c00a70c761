// Drives the escrow proxy with the official OpenAI JavaScript SDK (openai) and prints, as one
// JSON line, what the SDK reported: the usage of a chat completion as JSON and as a stream (with
// stream_options.include_usage), the models it may list, and how an insufficient balance surfaced
// (status, error class, code, HTTP attempts made: 1 means no retry). server/sdk_test.go runs it
// and checks the ledger against these numbers.
//
// With ESCROW_FIT_MODEL, ESCROW_SMALL_KEY and ESCROW_SMALL_STREAM_KEY (keys of two orgs whose
// balances do not cover the bound of an uncapped request to that model), it also sends that
// model a chat completion without max_tokens, as JSON (the first key) and as a stream (the
// second), and reports what the SDK saw of the fit: the status, the x-escrow-output-cap header,
// the body bytes it sent (the bound is priced on them), the usage and the finish reason. The
// first key also sends it with x-escrow-fit: off (the refusal, with the numbers, not retried),
// and the poor key sends it too (fit cannot help a balance below the smallest fitted bound:
// insufficient_quota, no retry).
//
// With ESCROW_HELD_KEY (a key whose org's balance is held by a request in flight, so that the
// chat completion is refused balance_held), the SDK sends that chat completion with retries
// allowed. Before each retry the script prints {"event":"retry","attempt":N} and waits for a
// line on its standard input: the test lets it go on once the request in flight has finished.
// It reports the first attempt's answer, the HTTP attempts made and the final status.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_POOR_KEY (a key whose balance does not
// cover a request), ESCROW_MODEL; optional ESCROW_FIT_MODEL, ESCROW_SMALL_KEY,
// ESCROW_SMALL_STREAM_KEY, ESCROW_HELD_KEY.
import OpenAI from 'openai';
import { counting, heldFetcher } from './fetch.mjs';

const {
  ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_POOR_KEY: poorKey, ESCROW_MODEL: model,
  ESCROW_FIT_MODEL: fitModel, ESCROW_SMALL_KEY: smallKey, ESCROW_SMALL_STREAM_KEY: smallStreamKey,
  ESCROW_HELD_KEY: heldKey,
} = process.env;
if (!base || !key || !poorKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_POOR_KEY and ESCROW_MODEL are required');
  process.exit(2);
}
const baseURL = base + '/v1';

const params = { model, max_tokens: 12, messages: [{ role: 'user', content: 'hello from the openai node sdk' }] };
const usageOf = (u) => ({ prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens });
const words = (s) => (s ?? '').split(/\s+/).filter(Boolean).length;

const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 2 });
const chat = await client.chat.completions.create(params);

const stream = await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
let text = '';
let streamUsage = null;
for await (const chunk of stream) {
  text += chunk.choices[0]?.delta?.content ?? '';
  if (chunk.usage) streamUsage = usageOf(chunk.usage);
}

const models = [];
for await (const m of client.models.list()) models.push(m.id);

// refusal sends a request (with request options opts) with apiKey, retries allowed, and reports
// how it failed.
const refusal = async (apiKey, p, opts) => {
  const c = counting();
  const cl = new OpenAI({ baseURL, apiKey, maxRetries: 3, fetch: c.fetch });
  try {
    await cl.chat.completions.create(p, opts);
    return { status: 200, attempts: c.attempts };
  } catch (err) {
    return {
      status: err.status,
      class: err.constructor.name,
      isRateLimit: err instanceof OpenAI.RateLimitError,
      code: err.code ?? null,
      type: err.type ?? null,
      message: err.error?.message ?? err.message,
      attempts: c.attempts,
      bodyBytes: c.bodyBytes[0],
    };
  }
};
const refused = await refusal(poorKey, params);

// Fit: an uncapped chat completion on a balance below its bound is served with a lower cap, as
// JSON (ESCROW_SMALL_KEY) and as a stream (ESCROW_SMALL_STREAM_KEY, another org: the upstream
// bills every token the cap allows, so one fitted answer spends a small balance).
let fit = null;
let refusedUncapped = null;
let fitOff = null;
if (fitModel && smallKey && smallStreamKey) {
  const uncapped = { model: fitModel, messages: [{ role: 'user', content: 'hi [fill]' }] }; // [fill]: the fake fills the fitted cap
  // Asked for the refusal instead (x-escrow-fit: off): insufficient_quota with the numbers.
  fitOff = await refusal(smallKey, uncapped, { headers: { 'x-escrow-fit': 'off' } });
  const cj = counting();
  const small = new OpenAI({ baseURL, apiKey: smallKey, maxRetries: 0, fetch: cj.fetch });
  const { data, response } = await small.chat.completions.create(uncapped).withResponse();
  const cs = counting();
  const smallStream = new OpenAI({ baseURL, apiKey: smallStreamKey, maxRetries: 0, fetch: cs.fetch });
  const s = await smallStream.chat.completions.create({ ...uncapped, stream: true, stream_options: { include_usage: true } }).withResponse();
  let streamed = '';
  let sUsage = null;
  let sFinish = null;
  for await (const chunk of s.data) {
    streamed += chunk.choices[0]?.delta?.content ?? '';
    sFinish = chunk.choices[0]?.finish_reason ?? sFinish;
    if (chunk.usage) sUsage = usageOf(chunk.usage);
  }
  fit = {
    json: {
      status: response.status,
      outputCap: response.headers.get('x-escrow-output-cap'),
      bodyBytes: cj.bodyBytes[0],
      attempts: cj.attempts,
      usage: usageOf(data.usage),
      finishReason: data.choices[0].finish_reason,
      words: words(data.choices[0].message.content),
    },
    stream: {
      status: s.response.status,
      outputCap: s.response.headers.get('x-escrow-output-cap'),
      bodyBytes: cs.bodyBytes[0],
      attempts: cs.attempts,
      usage: sUsage,
      finishReason: sFinish,
      words: words(streamed),
    },
  };
  refusedUncapped = await refusal(poorKey, uncapped);
}

// Held is not gone: balance_held is retried after Retry-After and then served.
let held = null;
if (heldKey) {
  const hf = heldFetcher();
  const c = new OpenAI({ baseURL, apiKey: heldKey, maxRetries: 2, fetch: hf.fetch });
  const { data, response } = await c.chat.completions.create(params).withResponse();
  held = hf.done(response, usageOf(data.usage));
}

console.log(JSON.stringify({
  json: { id: chat.id, usage: usageOf(chat.usage), text: chat.choices[0].message.content },
  stream: { usage: streamUsage, text },
  models,
  refused,
  fit,
  refusedUncapped,
  fitOff,
  held,
}));
