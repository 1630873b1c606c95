// Words lighting up as they are spoken (protocol.md section 4, "timestamps"): the
// entries of a timed stream drawn over the text, each marked while the audio plays it.
import { h } from "./dom.js";

/**
 * The server-sent events of a timed stream, parsed as they arrive: `feed` takes the
 * next piece of the body and returns the complete events in it, as {event, data}.
 */
export class EventStream {
  constructor() {
    this.decoder = new TextDecoder();
    this.pending = "";
  }

  feed(bytes) {
    this.pending += this.decoder.decode(bytes, { stream: true });
    const frames = this.pending.split("\n\n");
    this.pending = frames.pop();
    const events = [];
    for (const frame of frames) {
      let event = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        const at = line.indexOf(":");
        const name = at < 0 ? line : line.slice(0, at);
        const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (name === "event") event = value;
        else if (name === "data") data.push(value);
      }
      if (data.length) events.push({ event, data: JSON.parse(data.join("\n")) });
    }
    return events;
  }
}

/** Base64 to bytes. */
export function decodeBase64(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/**
 * The spoken words over `node`.  Entries with offsets mark the text where the caller
 * wrote it (the rest stays as written); entries without (an engine that knows its
 * phonemes, not where they stand in the text) are shown as what was timed.
 */
export class Words {
  constructor(node, text) {
    this.node = node;
    this.text = text;
    this.spans = [];
    this.cursor = 0;
    this.tail = document.createTextNode(text);
    node.replaceChildren(this.tail);
    node.hidden = false;
    node.dataset.current = "";
    node.dataset.spoken = "0";
  }

  add(entries) {
    for (const entry of entries) {
      if (entry.unit !== "word") continue;
      const span = h("span", { class: "word", text: entry.text });
      span.dataset.start = String(entry.start);
      span.dataset.end = String(entry.end);
      if (Number.isInteger(entry.textStart) && entry.textStart >= this.cursor) {
        this.node.insertBefore(document.createTextNode(this.text.slice(this.cursor, entry.textStart)), this.tail);
        this.cursor = entry.textEnd;
        this.tail.data = this.text.slice(this.cursor);
      } else if (!Number.isInteger(entry.textStart)) {
        if (this.spans.length === 0) this.tail.data = "";
        else this.node.insertBefore(document.createTextNode(" "), this.tail);
      } else {
        continue;
      }
      this.node.insertBefore(span, this.tail);
      this.spans.push({ span, start: entry.start, end: entry.end });
    }
  }

  /** Keep the word being spoken in view inside the box, without scrolling the page. */
  follow(span) {
    const box = this.node;
    if (span.offsetTop < box.scrollTop || span.offsetTop + span.offsetHeight > box.scrollTop + box.clientHeight) {
      box.scrollTop = Math.max(0, span.offsetTop - box.clientHeight / 3);
    }
  }

  /** Mark what `seconds` of audio have reached: spoken words, and the one being spoken. */
  update(seconds) {
    let current = "";
    let spoken = 0;
    for (const { span, start, end } of this.spans) {
      const now = start <= seconds && seconds < end;
      span.classList.toggle("spoken", start <= seconds);
      span.classList.toggle("current", now);
      if (now) {
        span.setAttribute("aria-current", "true");
        current = span.textContent;
        this.follow(span);
      } else {
        span.removeAttribute("aria-current");
      }
      if (start <= seconds) spoken += 1;
    }
    this.node.dataset.current = current;
    this.node.dataset.spoken = String(spoken);
    this.node.dataset.position = seconds.toFixed(3);
  }
}
