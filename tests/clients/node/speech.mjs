// The openai Node SDK against a Rhapsode core (tests/integration/test_clients.py): the
// client as its README makes one for another server (a baseURL and a key), speech
// buffered in its default mp3, streamed as pcm, and as server-sent events in mp3.
// Writes each answer's bytes to the folder it is given; the test judges them.
//
//     node speech.mjs BASE_URL MODEL VOICE OUT_DIR
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import OpenAI from "openai";

const [baseURL, model, voice, out] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "sk-not-a-real-key" });
const input = "The Node client hears Rhapsode, in every way it asks.";
const found = {};

const mp3 = await client.audio.speech.create({ model, voice, input });
writeFileSync(join(out, "node.mp3"), Buffer.from(await mp3.arrayBuffer()));
found.mp3 = { type: mp3.headers.get("content-type"), requestId: mp3.headers.get("x-request-id") };

const pcm = await client.audio.speech.create({ model, voice, input, response_format: "pcm" });
const chunks = [];
for await (const chunk of pcm.body) chunks.push(Buffer.from(chunk));
writeFileSync(join(out, "node.pcm"), Buffer.concat(chunks));
found.pcm = { type: pcm.headers.get("content-type"), pieces: chunks.length };

const sse = await client.audio.speech.create({ model, voice, input, stream_format: "sse" });
const text = await sse.text();
const audio = [];
for (const block of text.split("\n\n")) {
  const data = block.split("\n").find((line) => line.startsWith("data: "));
  if (!data) continue;
  const event = JSON.parse(data.slice(6));
  if (event.type === "speech.audio.delta") audio.push(Buffer.from(event.audio, "base64"));
  else found.last = event.type;
}
writeFileSync(join(out, "node-sse.mp3"), Buffer.concat(audio));
found.sse = { type: sse.headers.get("content-type"), deltas: audio.length };
writeFileSync(join(out, "found.json"), JSON.stringify(found));
