// Calls to the core, through this site's /api proxy; refusals become ApiErrors.
import { h, select } from "./dom.js";
export class ApiError extends Error {
  constructor(status, body) {
    const err = body && body.error;
    super(err ? `${err.code}: ${err.message}` : `HTTP ${status}`);
    this.status = status;
    this.code = err ? err.code : "internal";
    this.retryable = err ? Boolean(err.retryable) : false;
    this.field = err ? err.field : undefined;
  }

  static async from(response) {
    let body = null;
    try { body = await response.json(); } catch { body = null; }
    return new ApiError(response.status, body);
  }
}

/** The core's answer to METHOD /api+path: parsed JSON, null for 204, else the Response. */
export async function api(path, { method = "GET", json, body, signal, raw = false, accept } = {}) {
  const init = { method, headers: {}, signal };
  if (accept) init.headers.Accept = accept;
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (body !== undefined) {
    init.body = body;
  }
  const response = await fetch(`/api${path}`, init);
  if (!response.ok) throw await ApiError.from(response);
  if (raw) return response;
  if (response.status === 204) return null;
  const type = response.headers.get("Content-Type") || "";
  return type.includes("json") ? response.json() : response.text();
}

export const enc = encodeURIComponent;

/** The variant a request would get: the named one, else the resident one, else the default. */
export function effectiveVariant(caps, named) {
  if (named && caps.variants[named]) return named;
  if (caps.current && caps.current.variant) return caps.current.variant;
  return caps.defaultVariant || Object.keys(caps.variants)[0];
}

// A select of the server's engines, the first chosen; none installed: a note in
// `main` saying where to install one, and null.
export async function engineSelect(main) {
  const engines = await api("/engines");
  if (!engines.length) {
    main.append(h("p", { text: "This server has no engines yet. Install one on the Engines page." }));
    return null;
  }
  return select(engines.map((e) => [e.id, e.displayName || e.id]), engines[0].id);
}
