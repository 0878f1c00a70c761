// Drives the escrow proxy with the official OpenAI JavaScript SDK (openai) and prints, as one
// JSON line, what the SDK reported: the usage of a chat completion as JSON and as a stream (with
// stream_options.include_usage), the models it may list, and how an insufficient balance surfaced
// (status, error class, code, HTTP attempts made: 1 means no retry). server/sdk_test.go runs it
// and checks the ledger against these numbers.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_POOR_KEY (a key whose balance does not
// cover a request), ESCROW_MODEL.
import OpenAI from 'openai';

const { ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_POOR_KEY: poorKey, ESCROW_MODEL: model } = process.env;
if (!base || !key || !poorKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_POOR_KEY and ESCROW_MODEL are required');
  process.exit(2);
}
const baseURL = base + '/v1';

let attempts = 0;
const countingFetch = (url, init) => {
  attempts++;
  return fetch(url, init);
};

const params = { model, max_tokens: 12, messages: [{ role: 'user', content: 'hello from the openai node sdk' }] };
const usageOf = (u) => ({ prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens });

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

const poor = new OpenAI({ baseURL, apiKey: poorKey, maxRetries: 3, fetch: countingFetch });
let refused = null;
try {
  await poor.chat.completions.create(params);
} catch (err) {
  refused = {
    status: err.status,
    class: err.constructor.name,
    isRateLimit: err instanceof OpenAI.RateLimitError,
    code: err.code ?? null,
    type: err.type ?? null,
    attempts,
  };
}

console.log(JSON.stringify({
  json: { id: chat.id, usage: usageOf(chat.usage), text: chat.choices[0].message.content },
  stream: { usage: streamUsage, text },
  models,
  refused,
}));
