// Small DOM helpers: elements built from data, never from HTML strings.
let nextId = 0;

/** h("button", {class: "x", onclick: f}, "text", child) */
export function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key in node && !key.includes("-") && key !== "list") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function uid(prefix) {
  nextId += 1;
  return `${prefix}-${nextId}`;
}

/** A labelled control: the label names it for screen readers, the hint describes it. */
export function field(text, control, hint) {
  if (!control.id) control.id = uid("f");
  const parts = [h("label", { for: control.id, text }), control];
  if (hint !== undefined) {
    const note = hint instanceof Node ? hint : h("p", { class: "hint", text: hint });
    if (!note.id) note.id = uid("hint");
    control.setAttribute("aria-describedby", note.id);
    parts.push(note);
  }
  const inline = control.type === "checkbox";
  return h("div", { class: inline ? "field inline" : "field" }, inline ? [control, parts[0], ...parts.slice(2)] : parts);
}

export function select(options, value) {
  const node = h("select");
  for (const option of options) {
    const [v, label] = Array.isArray(option) ? option : [option, option];
    node.append(h("option", { value: v, text: label, selected: v === value }));
  }
  return node;
}

export function table(headers, rows, caption) {
  return h("div", { class: "table-wrap" },
    h("table", {},
      caption ? h("caption", { class: "visually-hidden", text: caption }) : null,
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", text: t })))),
      h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((c) => h("td", {}, c)))))));
}

let statusTimer = null;
/** Say something in the polite live region (and show it for a few seconds). */
export function announce(text) {
  const node = document.getElementById("status");
  node.textContent = text;
  clearTimeout(statusTimer);
  statusTimer = setTimeout(() => { node.textContent = ""; }, 6000);
}

export function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); reject(signal.reason); }, { once: true });
  });
}

export function fmtBytes(n) {
  if (typeof n !== "number") return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
