// Drives the escrow proxy with the official Anthropic TypeScript SDK (@anthropic-ai/sdk) and
// prints, as one JSON line, what the SDK reported: the usage of a Messages request as JSON, as
// a stream (cache writes and reads included) and through the beta client (with betas), and how
// an insufficient balance surfaced
// (status, error class, HTTP attempts made: 1 means no retry). server/sdk_test.go runs it and
// checks the ledger against these numbers.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_POOR_KEY (a key whose balance does not
// cover a request), ESCROW_MODEL.
import Anthropic from '@anthropic-ai/sdk';

const { ESCROW_BASE_URL: baseURL, ESCROW_KEY: key, ESCROW_POOR_KEY: poorKey, ESCROW_MODEL: model } = process.env;
if (!baseURL || !key || !poorKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_POOR_KEY and ESCROW_MODEL are required');
  process.exit(2);
}

let attempts = 0;
const countingFetch = (url, init) => {
  attempts++;
  return fetch(url, init);
};

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

const client = new Anthropic({ baseURL, apiKey: key, maxRetries: 2 });
const msg = await client.messages.create(params);
const stream = client.messages.stream(params);
let text = '';
stream.on('text', (t) => { text += t; });
const final = await stream.finalMessage();
// The beta client: POST /v1/messages?beta=true with the betas in anthropic-beta.
const betaMsg = await client.beta.messages.create({ ...params, betas: ['prompt-caching-2024-07-31', 'interleaved-thinking-2025-05-14'] });

const poor = new Anthropic({ baseURL, apiKey: poorKey, maxRetries: 3, fetch: countingFetch });
let refused = null;
try {
  await poor.messages.create(params);
} catch (err) {
  refused = {
    status: err.status,
    class: err.constructor.name,
    isAPIError: err instanceof Anthropic.APIError,
    isPaymentRequired: err instanceof Anthropic.PaymentRequiredError,
    type: err.error?.error?.type ?? null,
    attempts,
  };
}

console.log(JSON.stringify({
  json: { id: msg.id, usage: usageOf(msg.usage), text: msg.content.map((b) => b.text).join('') },
  stream: { id: final.id, usage: usageOf(final.usage), text },
  beta: { id: betaMsg.id, usage: usageOf(betaMsg.usage), text: betaMsg.content.map((b) => b.text).join('') },
  refused,
}));
