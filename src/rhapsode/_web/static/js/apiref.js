// API: a reference drawn from the core's own GET /openapi.json (protocol.md section 13).
import { api } from "./api.js";
import { field, h } from "./dom.js";

const METHODS = ["get", "post", "put", "patch", "delete"];

function resolve(doc, schema) {
  if (schema && schema.$ref && schema.$ref.startsWith("#/")) {
    return schema.$ref.slice(2).split("/").reduce((node, part) => (node ? node[part] : undefined), doc) || schema;
  }
  return schema;
}

function schemaView(doc, schema) {
  const resolved = resolve(doc, schema);
  if (!resolved) return h("p", { class: "hint", text: "no schema" });
  const name = schema && schema.$ref ? schema.$ref.split("/").pop() : null;
  const props = resolved.properties || {};
  const required = new Set(resolved.required || []);
  const rows = Object.entries(props).map(([key, p]) => {
    const r = resolve(doc, p) || {};
    const type = p.$ref ? p.$ref.split("/").pop() : r.type || (r.enum ? "enum" : "");
    return h("li", {}, h("code", { text: key }), required.has(key) ? " (required)" : "",
      type ? ` ${Array.isArray(type) ? type.join(" | ") : type}` : "",
      r.enum ? ` one of ${r.enum.join(", ")}` : "", r.description ? ` — ${r.description}` : "");
  });
  return h("div", {}, name ? h("p", {}, h("code", { text: name })) : "",
    resolved.description ? h("p", { class: "hint", text: resolved.description }) : "",
    rows.length ? h("ul", {}, rows) : "");
}

export async function render(main) {
  const doc = await api("/openapi.json");
  const filter = h("input", { type: "search", placeholder: "speak, voices, install…" });
  const list = h("div", { id: "operations" });
  main.append(
    h("div", { class: "card" },
      h("p", {}, h("strong", { text: `${doc.info.title} ${doc.info.version}` }), ` (OpenAPI ${doc.openapi})`),
      doc.info.description ? h("p", { class: "hint", text: doc.info.description }) : "",
      field("Filter operations", filter)),
    list);
  const operations = [];
  for (const [path, item] of Object.entries(doc.paths || {})) {
    for (const method of METHODS) {
      if (!item[method]) continue;
      const op = item[method];
      const params = [...(item.parameters || []), ...(op.parameters || [])].map((p) => resolve(doc, p));
      const body = op.requestBody ? resolve(doc, op.requestBody) : null;
      const responses = Object.entries(op.responses || {}).map(([code, r]) => {
        const resolved = resolve(doc, r) || {};
        const types = Object.keys(resolved.content || {});
        return h("li", {}, h("code", { text: code }), ` ${resolved.description || ""}`, types.length ? ` (${types.join(", ")})` : "");
      });
      const details = h("details", {},
        h("summary", {}, h("span", { class: "method", text: method.toUpperCase() }), h("code", { text: path }),
          op.summary ? ` — ${op.summary}` : ""),
        op.description ? h("p", { text: op.description }) : "",
        params.length ? [h("h3", { text: "Parameters" }), h("ul", {}, params.map((p) =>
          h("li", {}, h("code", { text: p.name }), ` in ${p.in}${p.required ? ", required" : ""}`,
            p.description ? ` — ${p.description}` : "")))] : "",
        body ? [h("h3", { text: "Request body" }), ...Object.entries(body.content || {}).map(([type, media]) =>
          h("div", {}, h("p", {}, h("code", { text: type })), schemaView(doc, media.schema)))] : "",
        h("h3", { text: "Responses" }), h("ul", {}, responses));
      const text = `${method} ${path} ${op.summary || ""} ${(op.tags || []).join(" ")}`.toLowerCase();
      operations.push({ details, text });
      list.append(details);
    }
  }
  filter.addEventListener("input", () => {
    const want = filter.value.trim().toLowerCase();
    for (const { details, text } of operations) details.hidden = Boolean(want) && !text.includes(want);
  });
  return null;
}
