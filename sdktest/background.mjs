// Drives a background response end to end with the official OpenAI JavaScript SDK (openai):
// created with background: true, retrieved until it ends, its input items listed, read by
// another org's key (which must fail with 404), and a second one cancelled. Prints one JSON line
// with what the SDK saw; server/jobs_sdk_test.go checks the ledger against it.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_OTHER_KEY (another org's key),
// ESCROW_MODEL.
import OpenAI from 'openai';

const { ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_OTHER_KEY: otherKey, ESCROW_MODEL: model } = process.env;
if (!base || !key || !otherKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_OTHER_KEY and ESCROW_MODEL are required');
  process.exit(2);
}
const baseURL = base + '/v1';
const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 0 });

const created = await client.responses.create({ model, input: 'background from the openai node sdk', background: true });
const statuses = [created.status];
let r = created;
const deadline = Date.now() + 60_000;
while ((r.status === 'queued' || r.status === 'in_progress') && Date.now() < deadline) {
  await new Promise((done) => setTimeout(done, 50));
  r = await client.responses.retrieve(created.id);
  if (statuses[statuses.length - 1] !== r.status) statuses.push(r.status);
}

const items = [];
for await (const item of client.responses.inputItems.list(created.id)) items.push(item.type);

let other = null;
try {
  await new OpenAI({ baseURL, apiKey: otherKey, maxRetries: 0 }).responses.retrieve(created.id);
  other = { status: 200 };
} catch (e) {
  other = { status: e.status, notFound: e instanceof OpenAI.NotFoundError };
}

// [hold]: the fake upstream keeps this one running until it is cancelled
const second = await client.responses.create({ model, input: '[hold] cancel me', background: true });
const cancelled = await client.responses.cancel(second.id);

console.log(JSON.stringify({
  id: created.id, statuses, text: r.output_text, usage: r.usage, items, other,
  cancelled: { id: second.id, status: cancelled.status, usage: cancelled.usage },
}));
