// Drives escrow's media endpoints with the official OpenAI JavaScript SDK (openai) and prints,
// as one JSON line, what the SDK saw of each call: the request id and x-escrow-cost it got back,
// and what the request or the answer proves of the price (images: how many came back and the
// size and quality asked; speech: the characters sent and the audio bytes received;
// transcriptions and translations: the usage the answer reported; moderations: the results).
// server/sdk_media_test.go runs it and checks every charge in the ledger against these numbers.
//
// env: ESCROW_BASE_URL, ESCROW_KEY (a funded key); ESCROW_IMAGE_MODEL (priced per image),
// ESCROW_SPEECH_MODEL (per character), ESCROW_AUDIO_MODEL (per second of audio); optional
// ESCROW_TOKEN_IMAGE_MODEL (a gpt-image model, by tokens), ESCROW_TRANSCRIBE_MODEL (a
// transcription model billed by tokens).
import OpenAI, { toFile } from 'openai';

const {
  ESCROW_BASE_URL: base, ESCROW_KEY: key, ESCROW_IMAGE_MODEL: imageModel,
  ESCROW_SPEECH_MODEL: speechModel, ESCROW_AUDIO_MODEL: audioModel, ESCROW_TOKEN_IMAGE_MODEL: tokenImageModel,
  ESCROW_TRANSCRIBE_MODEL: transcribeModel,
} = process.env;
if (!base || !key || !imageModel || !speechModel || !audioModel) {
  console.error('ESCROW_BASE_URL, ESCROW_KEY, ESCROW_IMAGE_MODEL, ESCROW_SPEECH_MODEL and ESCROW_AUDIO_MODEL are required');
  process.exit(2);
}
const client = new OpenAI({ baseURL: base + '/v1', apiKey: key, maxRetries: 0 });

// seen is what every call reports: its request id and the cost escrow answered with.
const seen = (response) => ({
  requestId: response.headers.get('x-request-id'),
  cost: response.headers.get('x-escrow-cost'),
  status: response.status,
});

// wav is a PCM WAV file of ms milliseconds of silence, 16 kHz mono 16-bit.
const wav = (ms) => {
  const rate = 16000;
  const data = Math.ceil((rate * ms) / 1000) * 2;
  const b = Buffer.alloc(44 + data);
  b.write('RIFF', 0); b.writeUInt32LE(36 + data, 4); b.write('WAVE', 8);
  b.write('fmt ', 12); b.writeUInt32LE(16, 16); b.writeUInt16LE(1, 20); b.writeUInt16LE(1, 22);
  b.writeUInt32LE(rate, 24); b.writeUInt32LE(rate * 2, 28); b.writeUInt16LE(2, 32); b.writeUInt16LE(16, 34);
  b.write('data', 36); b.writeUInt32LE(data, 40);
  return b;
};

const out = {};

// Images: dall-e style, priced per image by size and quality, n of them.
{
  const { data, response } = await client.images.generate({ model: imageModel, prompt: 'a cat in a hat', n: 3, quality: 'hd', size: '1024x1024' }).withResponse();
  out.generate = { ...seen(response), images: data.data.length, size: '1024x1024', quality: 'hd' };
}
{
  const { data, response } = await client.images.generate({ model: imageModel, prompt: 'a dog' }).withResponse();
  out.generateDefault = { ...seen(response), images: data.data.length, size: '1024x1024', quality: 'standard' }; // the upstream's defaults
}
{
  const image = await toFile(Buffer.from('\x89PNG fake image to edit'), 'in.png', { type: 'image/png' });
  const { data, response } = await client.images.edit({ model: imageModel, image, prompt: 'add a hat', n: 2, size: '1024x1024' }).withResponse();
  out.edit = { ...seen(response), images: data.data.length, size: '1024x1024', quality: 'standard' };
}

// Speech: the answer is audio bytes; the bill is the characters of the input.
{
  const input = 'Hello from the SDK — ünïcödé counts as characters.';
  const { data, response } = await client.audio.speech.create({ model: speechModel, voice: 'alloy', input }).withResponse();
  const audio = Buffer.from(await data.arrayBuffer());
  out.speech = { ...seen(response), chars: [...input].length, input, audioBytes: audio.length, audio: audio.toString('base64') };
}

// Transcriptions and translations of a WAV upload: billed per second, the answer reports them.
{
  const file = await toFile(wav(2500), 'speech.wav', { type: 'audio/wav' });
  const { data, response } = await client.audio.transcriptions.create({ model: audioModel, file }).withResponse();
  out.transcription = { ...seen(response), text: data.text, usage: data.usage ?? null };
}
{
  const file = await toFile(wav(1200), 'speech.wav', { type: 'audio/wav' });
  const { data, response } = await client.audio.translations.create({ model: audioModel, file }).withResponse();
  out.translation = { ...seen(response), text: data.text, usage: data.usage ?? null };
}

// mp3 is n MPEG-1 Layer III frames at 128 kbit/s, 44.1 kHz (417 bytes, 1,152 samples each).
const mp3 = (n) => {
  const frame = Buffer.alloc(417);
  frame.set([0xff, 0xfb, 0x90, 0x00]);
  return Buffer.concat(Array(n).fill(frame));
};
{
  const file = await toFile(mp3(150), 'speech.mp3', { type: 'audio/mpeg' });
  const { data, response } = await client.audio.transcriptions.create({ model: audioModel, file }).withResponse();
  out.transcriptionMp3 = { ...seen(response), text: data.text, usage: data.usage ?? null };
}
if (transcribeModel) {
  const file = await toFile(mp3(150), 'speech.mp3', { type: 'audio/mpeg' });
  const { data, response } = await client.audio.transcriptions.create({ model: transcribeModel, file, prompt: 'names: Ada' }).withResponse();
  out.transcriptionTokens = { ...seen(response), text: data.text, usage: data.usage ?? null };
}

// Moderations: free, but authenticated and recorded.
{
  const { data, response } = await client.moderations.create({ input: ['fine?', 'also fine?'] }).withResponse();
  out.moderation = { ...seen(response), results: data.results.length, model: data.model };
}

// Images of a token-billed model (gpt-image): the answer's usage is the bill.
if (tokenImageModel) {
  const { data, response } = await client.images.generate({ model: tokenImageModel, prompt: 'a cat in a hat', n: 2, quality: 'low', size: '1024x1024' }).withResponse();
  out.tokenGenerate = { ...seen(response), images: data.data.length, usage: data.usage ?? null };
  const image = await toFile(Buffer.from('\x89PNG fake image to edit'), 'in.png', { type: 'image/png' });
  const e = await client.images.edit({ model: tokenImageModel, image, prompt: 'add a hat', quality: 'medium', size: '1024x1024' }).withResponse();
  out.tokenEdit = { ...seen(e.response), images: e.data.data.length, usage: e.data.usage ?? null };
  // Streamed with partial images: the usage is on the completed event.
  const st = await client.images.generate({ model: tokenImageModel, prompt: 'a cat', size: '1024x1024', quality: 'low', stream: true, partial_images: 2 }).withResponse();
  let partials = 0;
  let usage = null;
  for await (const ev of st.data) {
    if (ev.type === 'image_generation.partial_image') partials++;
    if (ev.type === 'image_generation.completed') usage = ev.usage ?? null;
  }
  out.tokenStream = { ...seen(st.response), images: usage ? 1 : 0, partials, usage };
}

console.log(JSON.stringify(out));
