// Drives an OpenAI batch through the escrow proxy end to end with the official OpenAI
// JavaScript SDK (openai): uploads a batch input file (files.create, purpose "batch"), creates
// the batch, polls it until it ends, reads its output and error files, and asks for the batch
// and the file with another org's key (which must not see them). Prints one JSON line: the ids,
// the final status and counts, each output line's custom_id and usage, the error lines'
// custom_ids, the batch ids the org lists, and the statuses the other org got.
// server/batches_test.go (TestOpenAINodeSDKBatch) runs it and checks the ledger against it.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key), ESCROW_OTHER_KEY (another org's key),
// ESCROW_MODEL.
import OpenAI, { toFile } from 'openai';

const { ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_OTHER_KEY: otherKey, ESCROW_MODEL: model } = process.env;
if (!base || !key || !otherKey || !model) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_OTHER_KEY and ESCROW_MODEL are required');
  process.exit(2);
}
const baseURL = base + '/v1';
const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 0 });

const line = (id, text, maxTokens) => JSON.stringify({
  custom_id: id, method: 'POST', url: '/v1/chat/completions',
  body: { model, max_tokens: maxTokens, messages: [{ role: 'user', content: text }] },
});
const input = [line('first', 'one two three', 8), line('second', 'this one fails [fail]', 8), line('third', 'four five', 5)].join('\n') + '\n';

const file = await client.files.create({ file: await toFile(Buffer.from(input), 'batch.jsonl'), purpose: 'batch' });
const created = await client.batches.create({ input_file_id: file.id, endpoint: '/v1/chat/completions', completion_window: '24h' });

const terminal = ['completed', 'failed', 'expired', 'cancelled'];
let batch = created;
const deadline = Date.now() + 60_000;
while (!terminal.includes(batch.status)) {
  if (Date.now() > deadline) {
    console.error('the batch did not end in time: ' + JSON.stringify(batch));
    process.exit(1);
  }
  await new Promise((r) => setTimeout(r, 25));
  batch = await client.batches.retrieve(created.id);
}

const jsonl = async (id) => {
  if (!id) return [];
  const res = await client.files.content(id);
  return (await res.text()).trim().split('\n').filter(Boolean).map((l) => JSON.parse(l));
};
const output = (await jsonl(batch.output_file_id)).map((l) => ({ custom_id: l.custom_id, usage: l.response.body.usage }));
const errors = (await jsonl(batch.error_file_id)).map((l) => l.custom_id);

const listed = [];
for await (const b of client.batches.list()) listed.push(b.id);

const other = new OpenAI({ baseURL, apiKey: otherKey, maxRetries: 0 });
const statusOf = async (f) => {
  try {
    await f();
    return 200;
  } catch (e) {
    return e.status ?? -1;
  }
};
const otherSaw = {
  batch: await statusOf(() => other.batches.retrieve(created.id)),
  file: await statusOf(() => other.files.retrieve(file.id)),
  output: await statusOf(() => other.files.content(batch.output_file_id)),
  cancel: await statusOf(() => other.batches.cancel(created.id)),
};

console.log(JSON.stringify({ file: file.id, batch: created.id, status: batch.status, counts: batch.request_counts, output, errors, listed, otherSaw }));
