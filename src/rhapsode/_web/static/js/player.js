// Plays raw PCM as it arrives: each chunk becomes an AudioBuffer scheduled right
// after the one before on one AudioContext.
export class StreamPlayer {
  constructor(context, rate, channels, littleEndian) {
    this.context = context;
    this.rate = rate;
    this.channels = channels;
    this.little = littleEndian;
    this.carry = new Uint8Array(0);
    this.next = 0;
    this.firstAt = null;
    // Where the stream ran dry: [from, to] stretches with nothing scheduled, which are
    // no audio played however long they last.
    this.gaps = [];
    this.sources = new Set();
    // Where each buffer's audio starts in the stream (seconds) and on the context's
    // clock: a buffer that arrives late starts later than the one before ended.
    this.schedule = [];
    this.total = 0;
  }

  /** Schedule the whole frames in `bytes`; an odd tail waits for the next chunk. */
  push(bytes) {
    let data = bytes;
    if (this.carry.length) {
      data = new Uint8Array(this.carry.length + bytes.length);
      data.set(this.carry);
      data.set(bytes, this.carry.length);
    }
    const frameBytes = 2 * this.channels;
    const frames = Math.floor(data.length / frameBytes);
    this.carry = data.slice(frames * frameBytes);
    if (!frames) return;
    const view = new DataView(data.buffer, data.byteOffset, frames * frameBytes);
    const buffer = this.context.createBuffer(this.channels, frames, this.rate);
    for (let c = 0; c < this.channels; c += 1) {
      const out = buffer.getChannelData(c);
      for (let i = 0; i < frames; i += 1) out[i] = view.getInt16((i * this.channels + c) * 2, this.little) / 32768;
    }
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const at = Math.max(this.next, this.context.currentTime + 0.05);
    if (this.firstAt !== null && at > this.next) this.gaps.push([this.next, at]);
    source.start(at);
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
    this.next = at + buffer.duration;
    if (this.firstAt === null) this.firstAt = at;
    this.schedule.push({ from: this.total, at, duration: buffer.duration });
    this.total += buffer.duration;
  }

  /** How far into the stream's audio playback has got, in seconds. */
  position() {
    const now = this.context.currentTime;
    let reached = 0;
    for (const { from, at, duration } of this.schedule) {
      if (now < at) break;
      reached = from + Math.min(now - at, duration);
    }
    return reached;
  }

  /** Seconds scheduled but not yet played. */
  ahead() {
    return Math.max(0, this.next - this.context.currentTime);
  }

  /** Seconds of audio played so far: the clock since the first sound, less every gap. */
  played() {
    if (this.firstAt === null) return 0;
    const now = Math.min(this.context.currentTime, this.next);
    let silent = 0;
    for (const [from, to] of this.gaps) silent += Math.max(0, Math.min(now, to) - from);
    return Math.max(0, now - this.firstAt - silent);
  }

  stop() {
    for (const source of this.sources) {
      try { source.stop(); } catch { /* already ended */ }
    }
    this.sources.clear();
  }
}

/** A WAV file of 16-bit little-endian PCM chunks, for the download link. */
export function wavBlob(chunks, rate, channels, littleEndian) {
  const length = chunks.reduce((n, c) => n + c.length, 0) & ~1;
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => { for (let i = 0; i < s.length; i += 1) header.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); header.setUint32(4, 36 + length, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true);
  header.setUint16(22, channels, true); header.setUint32(24, rate, true);
  header.setUint32(28, rate * channels * 2, true); header.setUint16(32, channels * 2, true);
  header.setUint16(34, 16, true); text(36, "data"); header.setUint32(40, length, true);
  let body = chunks;
  if (!littleEndian) {
    const joined = new Uint8Array(length);
    let at = 0;
    for (const c of chunks) { joined.set(c.subarray(0, Math.min(c.length, length - at)), at); at += c.length; }
    for (let i = 0; i + 1 < length; i += 2) { const t = joined[i]; joined[i] = joined[i + 1]; joined[i + 1] = t; }
    body = [joined];
  }
  return new Blob([header.buffer, ...body], { type: "audio/wav" });
}

/** rate and channels from `audio/L16; rate=24000; channels=1`, or null. */
export function parsePcmType(value) {
  const [type, ...params] = (value || "").split(";").map((s) => s.trim());
  if (type.toLowerCase() !== "audio/l16") return null;
  const found = Object.fromEntries(params.map((p) => p.split("=").map((s) => s.trim().toLowerCase())));
  const rate = Number(found.rate);
  const channels = Number(found.channels || 1);
  return rate > 0 && channels > 0 ? { rate, channels } : null;
}
