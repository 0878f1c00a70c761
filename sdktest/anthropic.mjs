// Drives the escrow proxy with the official Anthropic TypeScript SDK (@anthropic-ai/sdk) and
// prints, as one JSON line, what the SDK reported: the usage of a Messages request as JSON, as
// a stream (cache writes and reads included) and through the beta client (with betas), and how
// an insufficient balance surfaced
// (status, error class, HTTP attempts made: 1 means no retry). server/sdk_test.go runs it and
// checks the ledger against these numbers.
//
// With ESCROW_SMALL_KEY and ESCROW_SMALL_STREAM_KEY (keys of two orgs whose balances do not cover
// the bound of a request with max_tokens 8192), it also sends such a request, as JSON (the first
// key) and as a stream (the second), and reports what the SDK saw of the fit: the status, the
// x-escrow-output-cap header, the body bytes it sent (the bound is priced on them), the usage and
// the stop reason. The first key also sends it with x-escrow-fit: off (the refusal, with the
// numbers, not retried), and the poor key sends it too (fit cannot help a balance below the
// smallest fitted bound: billing_error, no retry).
//
// With ESCROW_HELD_KEY (a key whose org's balance is held by a request in flight, so that a
// small request is refused as held), the SDK sends that request with retries allowed. Before
// each retry the script prints {"event":"retry","attempt":N} and waits for a line on its
// standard input: the test lets it go on once the request in flight has finished. It reports
// the first attempt's answer, the HTTP attempts made and the final status.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_POOR_KEY (a key whose balance does not
// cover a request), ESCROW_MODEL; optional ESCROW_SMALL_KEY, ESCROW_SMALL_STREAM_KEY,
// ESCROW_HELD_KEY.
import Anthropic from '@anthropic-ai/sdk';
import { counting, heldFetcher } from './fetch.mjs';

const {
  ESCROW_BASE_URL: baseURL, ESCROW_KEY: key, ESCROW_POOR_KEY: poorKey, ESCROW_MODEL: model,
  ESCROW_SMALL_KEY: smallKey, ESCROW_SMALL_STREAM_KEY: smallStreamKey, ESCROW_HELD_KEY: heldKey,
} = process.env;
if (!baseURL || !key || !poorKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_POOR_KEY and ESCROW_MODEL are required');
  process.exit(2);
}

const params = {
  model,
  max_tokens: 9,
  system: [{ type: 'text', text: 'you are terse', cache_control: { type: 'ephemeral' } }],
  messages: [{
    role: 'user',
    content: [{ type: 'text', text: 'one two three four five six [cache_write:4] [cached:3]', cache_control: { type: 'ephemeral' } }],
  }],
};

const usageOf = (u) => ({
  input_tokens: u.input_tokens,
  cache_creation_input_tokens: u.cache_creation_input_tokens ?? 0,
  cache_read_input_tokens: u.cache_read_input_tokens ?? 0,
  output_tokens: u.output_tokens,
});
const words = (s) => (s ?? '').split(/\s+/).filter(Boolean).length;
const textOf = (m) => m.content.map((b) => b.text).join('');

const client = new Anthropic({ baseURL, apiKey: key, maxRetries: 2 });
const msg = await client.messages.create(params);
const stream = client.messages.stream(params);
let text = '';
stream.on('text', (t) => { text += t; });
const final = await stream.finalMessage();
// The beta client: POST /v1/messages?beta=true with the betas in anthropic-beta.
const betaMsg = await client.beta.messages.create({ ...params, betas: ['prompt-caching-2024-07-31', 'interleaved-thinking-2025-05-14'] });

// refusal sends a request (with request options opts) with apiKey, retries allowed, and reports
// how it failed.
const refusal = async (apiKey, p, opts) => {
  const c = counting();
  const cl = new Anthropic({ baseURL, apiKey, maxRetries: 3, fetch: c.fetch });
  try {
    await cl.messages.create(p, opts);
    return { status: 200, attempts: c.attempts };
  } catch (err) {
    return {
      status: err.status,
      class: err.constructor.name,
      isAPIError: err instanceof Anthropic.APIError,
      isPaymentRequired: err instanceof Anthropic.PaymentRequiredError,
      type: err.error?.error?.type ?? null,
      message: err.error?.error?.message ?? err.message,
      attempts: c.attempts,
      bodyBytes: c.bodyBytes[0],
    };
  }
};
const refused = await refusal(poorKey, params);

// Fit: max_tokens above what the balance covers is served with a lower cap, as JSON
// (ESCROW_SMALL_KEY) and as a stream (ESCROW_SMALL_STREAM_KEY, another org: the upstream bills
// every token the cap allows, so one fitted answer spends a small balance).
let fit = null;
let refusedLarge = null;
let fitOff = null;
if (smallKey && smallStreamKey) {
  const large = { model, max_tokens: 8192, messages: [{ role: 'user', content: 'fit me in [fill]' }] }; // [fill]: the fake fills the fitted cap
  // Asked for the refusal instead (x-escrow-fit: off): billing_error with the numbers.
  fitOff = await refusal(smallKey, large, { headers: { 'x-escrow-fit': 'off' } });
  const cj = counting();
  const small = new Anthropic({ baseURL, apiKey: smallKey, maxRetries: 0, fetch: cj.fetch });
  const { data, response } = await small.messages.create(large).withResponse();
  const cs = counting();
  const smallStream = new Anthropic({ baseURL, apiKey: smallStreamKey, maxRetries: 0, fetch: cs.fetch });
  const s = await smallStream.messages.stream(large).withResponse();
  let streamed = '';
  s.data.on('text', (t) => { streamed += t; });
  const sFinal = await s.data.finalMessage();
  fit = {
    json: {
      status: response.status,
      outputCap: response.headers.get('x-escrow-output-cap'),
      bodyBytes: cj.bodyBytes[0],
      attempts: cj.attempts,
      usage: usageOf(data.usage),
      stopReason: data.stop_reason,
      words: words(textOf(data)),
    },
    stream: {
      status: s.response.status,
      outputCap: s.response.headers.get('x-escrow-output-cap'),
      bodyBytes: cs.bodyBytes[0],
      attempts: cs.attempts,
      usage: usageOf(sFinal.usage),
      stopReason: sFinal.stop_reason,
      words: words(streamed),
    },
  };
  refusedLarge = await refusal(poorKey, large);
}

// Held is not gone: a 429 for money held by the org's requests in flight is retried after
// Retry-After and then served.
let held = null;
if (heldKey) {
  const hf = heldFetcher();
  const c = new Anthropic({ baseURL, apiKey: heldKey, maxRetries: 2, fetch: hf.fetch });
  const { data, response } = await c.messages.create({
    model, max_tokens: 9, messages: [{ role: 'user', content: 'held then served' }],
  }).withResponse();
  held = hf.done(response, usageOf(data.usage));
}

console.log(JSON.stringify({
  json: { id: msg.id, usage: usageOf(msg.usage), text: textOf(msg) },
  stream: { id: final.id, usage: usageOf(final.usage), text },
  beta: { id: betaMsg.id, usage: usageOf(betaMsg.usage), text: betaMsg.content.map((b) => b.text).join('') },
  refused,
  fit,
  refusedLarge,
  fitOff,
  held,
}));
