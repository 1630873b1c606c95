// Try it: pick an engine, variant, voice, language, delivery and dials from the
// capability document, and hear the text as it streams; where the variant times words,
// they light up as they are spoken.
import { api, effectiveVariant, enc, engineSelect } from "./api.js";
import { announce, field, h, select, sleep } from "./dom.js";
import { StreamPlayer, parsePcmType, wavBlob } from "./player.js";
import { EventStream, Words, decodeBase64 } from "./words.js";

// The most audio scheduled ahead of the playhead: the page reads the stream no faster
// than it plays, so a long text holds the server's stream open instead of this tab's memory.
const AHEAD_SECONDS = 3;

export async function render(main) {
  const engine = await engineSelect(main);
  if (!engine) return null;
  const variant = select([]);
  const voice = select([]);
  const language = select([]);
  const delivery = select([]);
  const preview = h("button", { type: "button", class: "secondary", text: "Preview voice" });
  const previewAudio = h("audio", { controls: true, preload: "none", class: "preview" });
  const dials = h("div", { class: "grid" });
  const cues = h("p", { class: "hint", id: "cues" });
  const text = h("textarea", { name: "text", required: true, spellcheck: true },
    "Right, that was a test of streaming speech. [laugh] It plays while the rest is still on its way.");
  const counter = h("p", { class: "hint counter", id: "counter" });
  const highlight = h("input", { type: "checkbox", id: "highlight", checked: true });
  const highlightField = field("Light up the words as they are spoken", highlight,
    "The variant times its words; the page asks for their timings beside the audio.");
  const words = h("p", { class: "words", id: "words", hidden: true, "aria-label": "Spoken words" });
  const speak = h("button", { type: "submit", text: "Speak" });
  const stop = h("button", { type: "button", class: "secondary", text: "Stop", disabled: true });
  const download = h("a", { hidden: true, text: "Download WAV", id: "download" });
  const ttfa = h("dd", { id: "ttfa", text: "-" });
  const rtf = h("dd", { id: "rtf", text: "-" });
  const played = h("dd", { id: "played", text: "-" });
  const playback = h("output", { id: "playback", dataset: { response: "idle", played: "0" } }, "Idle");
  const form = h("form", { class: "card", "aria-label": "Speak" },
    h("div", { class: "grid" },
      field("Engine", engine),
      field("Variant", variant),
      field("Voice", voice),
      field("Language", language),
      field("Delivery", delivery, "How the line is performed, where the variant claims any."),
    ),
    h("div", { class: "actions" }, preview, previewAudio),
    dials,
    field("Text", text, counter),
    cues,
    highlightField,
    h("div", { class: "actions" }, speak, stop, download),
    words,
    h("dl", { class: "stats", "aria-label": "Last run" },
      h("div", {}, h("dt", { text: "Time to first audio" }), ttfa),
      h("div", {}, h("dt", { text: "Realtime factor" }), rtf),
      h("div", {}, h("dt", { text: "Played" }), played)),
    playback,
  );
  main.append(form);

  let caps = null;
  let voices = [];
  let run = null;

  function variantDoc() {
    return caps.variants[variant.value] || {};
  }

  function drawVariant() {
    const doc = variantDoc();
    language.replaceChildren(...(doc.languages || []).map((l) => h("option", { value: l, text: l })));
    delivery.replaceChildren(h("option", { value: "", text: "ordinary" }),
      ...(doc.deliveries || []).map((d) => h("option", { value: d, text: d })));
    delivery.disabled = !(doc.deliveries || []).length;
    dials.replaceChildren(...Object.entries(doc.dials || {}).map(([name, dial]) => {
      const input = h("input", { type: "number", name: `dial-${name}`, min: dial.min, max: dial.max,
        step: "any", value: dial.default });
      input.dataset.dial = name;
      return field(`Dial: ${name}`, input, `${dial.min} to ${dial.max}, ${dial.default} by default`);
    }));
    const performed = doc.cues || [];
    cues.textContent = performed.length
      ? `This variant performs these cues in [brackets]: ${performed.join(", ")}. Others are dropped.`
      : "This variant performs no cues: anything in [brackets] is dropped before it speaks.";
    highlightField.hidden = !timesWords();
    count();
  }

  function timesWords() {
    return ((variantDoc().timestamps || {}).units || []).includes("word");
  }

  function count() {
    const max = variantDoc().maxCharacters;
    const n = [...text.value].length;
    counter.textContent = max ? `${n} of ${max} characters` : `${n} characters`;
    text.setAttribute("aria-invalid", max && n > max ? "true" : "false");
    speak.disabled = Boolean(run) || !n || Boolean(max && n > max);
  }

  async function drawEngine() {
    caps = await api(`/engines/${enc(engine.value)}/capabilities`);
    const names = Object.keys(caps.variants);
    const chosen = effectiveVariant(caps);
    variant.replaceChildren(...names.map((n) => h("option", { value: n, text: n, selected: n === chosen })));
    voices = await api(`/engines/${enc(engine.value)}/voices`);
    voice.replaceChildren(h("option", { value: "", text: "the engine's default" }),
      ...voices.map((v) => h("option", { value: v.id, text: v.label ? `${v.label} (${v.id})` : v.id })));
    preview.disabled = true;
    drawVariant();
  }

  engine.addEventListener("change", () => drawEngine().catch((e) => announce(e.message)));
  variant.addEventListener("change", drawVariant);
  text.addEventListener("input", count);
  voice.addEventListener("change", () => {
    preview.disabled = !voice.value;
  });
  preview.addEventListener("click", () => {
    const chosen = voices.find((v) => v.id === voice.value);
    if (!chosen || !chosen.previewUrl) return;
    // The URL the server gave, never one built here (protocol.md section 7).
    previewAudio.src = `/api${chosen.previewUrl}`;
    previewAudio.play().catch((e) => announce(`The preview could not play: ${e.message}`));
  });

  function request() {
    const body = { engine: engine.value, text: text.value, variant: variant.value, format: "pcm", stream: true };
    if (voice.value) body.voice = voice.value;
    if (language.value) body.language = language.value;
    if (delivery.value) body.delivery = delivery.value;
    const params = {};
    for (const input of dials.querySelectorAll("input[data-dial]")) {
      if (input.value !== "") params[input.dataset.dial] = Number(input.value);
    }
    if (Object.keys(params).length) body.params = params;
    if (timesWords() && highlight.checked) body.timestamps = "word";
    return body;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (run) return;
    // Made inside the click so the browser lets it play.
    const context = new AudioContext();
    run = new AbortController();
    speakNow(context, run.signal).finally(() => {
      run = null;
      stop.disabled = true;
      count();
    });
  });
  stop.addEventListener("click", () => run && run.abort(new DOMException("stopped", "AbortError")));

  async function speakNow(context, signal) {
    speak.disabled = true;
    stop.disabled = false;
    download.hidden = true;
    ttfa.textContent = rtf.textContent = played.textContent = "-";
    playback.dataset.response = "waiting";
    playback.dataset.played = "0";
    playback.textContent = "Waiting for the server";
    const started = performance.now();
    let waited = 0;
    let player = null;
    let ticker = null;
    const chunks = [];
    let bytes = 0;
    let spoken = null;
    let follow = null;
    try {
      context.resume();
      const body = request();
      const timed = Boolean(body.timestamps);
      // Timed, the answer is server-sent events: audio deltas and the timings before them.
      const response = await api("/speak", { method: "POST", json: body, signal, raw: true,
        accept: timed ? "text/event-stream" : undefined });
      waited += performance.now() - started;
      const audioType = timed ? response.headers.get("X-Rhapsode-Audio-Type") : response.headers.get("Content-Type");
      const type = parsePcmType(audioType);
      if (!type) throw new Error(`the server answered ${audioType}, not PCM`);
      const events = timed ? new EventStream() : null;
      if (timed) {
        spoken = new Words(words, body.text);
      } else {
        words.hidden = true;
      }
      const little = !String((caps.nativeFormat || {}).encoding || "").endsWith("be");
      player = new StreamPlayer(context, type.rate, type.channels, little);
      ticker = setInterval(() => {
        const seconds = player.played();
        playback.dataset.played = seconds.toFixed(3);
        played.textContent = `${seconds.toFixed(1)} s`;
      }, 100);
      if (spoken) {
        const frame = () => {
          spoken.update(player.position());
          follow = requestAnimationFrame(frame);
        };
        follow = requestAnimationFrame(frame);
      }
      playback.dataset.response = "streaming";
      playback.textContent = "Playing while the audio arrives";
      const reader = response.body.getReader();
      signal.addEventListener("abort", () => reader.cancel().catch(() => {}), { once: true });
      for (;;) {
        while (player.ahead() > AHEAD_SECONDS) await sleep(100, signal);
        const asked = performance.now();
        const { done, value } = await reader.read();
        waited += performance.now() - asked;
        if (done) break;
        const pieces = [];
        if (events) {
          for (const { event, data } of events.feed(value)) {
            if (event === "speech.audio.delta") pieces.push(decodeBase64(data.audio));
            else if (event === "speech.timestamps.delta") spoken.add(data.alignment);
            else if (event === "speech.audio.error") throw new Error(`${data.error.code}: ${data.error.message}`);
          }
        } else {
          pieces.push(value);
        }
        if (!pieces.length) continue;
        if (!chunks.length) ttfa.textContent = `${Math.round(performance.now() - started)} ms`;
        for (const piece of pieces) {
          chunks.push(piece);
          bytes += piece.length;
          player.push(piece);
        }
        const audioSeconds = bytes / (2 * type.channels * type.rate);
        rtf.textContent = `${(audioSeconds / Math.max(waited / 1000, 0.001)).toFixed(1)}×`;
      }
      playback.dataset.response = "ended";
      playback.textContent = "All the audio has arrived";
      download.href = URL.createObjectURL(wavBlob(chunks, type.rate, type.channels, little));
      download.download = `rhapsode-${engine.value}.wav`;
      download.hidden = false;
      announce("Speech received in full");
      while (player.ahead() > 0) await sleep(200, signal);
    } catch (error) {
      if (error && error.name === "AbortError") {
        playback.dataset.response = "stopped";
        playback.textContent = "Stopped";
      } else {
        playback.dataset.response = "failed";
        playback.textContent = `Failed: ${error.message}`;
        announce(error.message);
      }
    } finally {
      if (ticker) clearInterval(ticker);
      if (follow) cancelAnimationFrame(follow);
      if (spoken && player) spoken.update(player.position());
      if (player) {
        playback.dataset.played = player.played().toFixed(3);
        player.stop();
      }
      context.close().catch(() => {});
    }
  }

  await drawEngine();
  return () => { if (run) run.abort(new DOMException("left the page", "AbortError")); };
}
