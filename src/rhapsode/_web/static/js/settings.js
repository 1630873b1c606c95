// Settings: GET /settings drawn as a form, saying which values apply now and which
// wait for a restart; PATCH /settings with only what changed (protocol.md section 10).
import { api } from "./api.js";
import { announce, field, h } from "./dom.js";

function valueAt(values, key) {
  return key.split(".").reduce((node, part) => (node && typeof node === "object" ? node[part] : undefined), values);
}

function patchFor(key, value) {
  const parts = key.split(".");
  const patch = {};
  let node = patch;
  parts.slice(0, -1).forEach((part) => { node = node[part] = {}; });
  node[parts[parts.length - 1]] = value;
  return patch;
}

function merge(into, from) {
  for (const [k, v] of Object.entries(from)) {
    if (v && typeof v === "object" && !Array.isArray(v) && into[k] && typeof into[k] === "object") merge(into[k], v);
    else into[k] = v;
  }
  return into;
}

export async function render(main) {
  const holder = h("div");
  main.append(h("p", { class: "hint", text: "Values marked “applies now” take effect as soon as they are saved; the rest are saved and wait for the server's next start." }), holder);

  function draw(doc) {
    const controls = [];
    const sections = new Map();
    for (const f of doc.fields) {
      const section = f.key.split(".")[0];
      if (!sections.has(section)) sections.set(section, []);
      sections.get(section).push(f);
    }
    const form = h("form", { "aria-label": "Settings" });
    for (const [section, fields] of sections) {
      const grid = h("div", { class: "grid" });
      for (const f of fields) {
        const current = f.key === "management.token" ? undefined : valueAt(doc.values, f.key);
        let input;
        if (f.key === "management.token") {
          input = h("input", { type: "password", autocomplete: "new-password",
            placeholder: doc.values.management && doc.values.management.tokenSet ? "set (hidden); type to replace" : "not set" });
        } else if (typeof current === "boolean") {
          input = h("input", { type: "checkbox", checked: current });
        } else if (typeof current === "number") {
          input = h("input", { type: "number", step: "any", value: String(current) });
        } else if (Array.isArray(current)) {
          input = h("input", { type: "text", value: current.join(", ") });
        } else if (current !== null && typeof current === "object") {
          // An object of its own (voices.aliases): edited as JSON, replaced whole.
          input = h("input", { type: "text", value: JSON.stringify(current) });
          input.dataset.json = "1";
        } else {
          input = h("input", { type: "text", value: current === null || current === undefined ? "" : String(current),
            placeholder: current === null ? "not set" : "" });
        }
        input.name = f.key;
        input.dataset.key = f.key;
        const note = h("p", { class: "hint" },
          h("span", { class: `badge ${f.applies}`, text: f.applies === "live" ? "applies now" : "after a restart" }),
          ` from ${f.source}`,
          "saved" in f ? [" · ", h("strong", { text: `saved ${JSON.stringify(f.saved)}, waits for a restart` })] : "");
        controls.push({ f, input, current });
        grid.append(field(f.key.split(".").slice(1).join("."), input, note));
      }
      form.append(h("fieldset", { class: "card" }, h("legend", { text: section }), grid));
    }
    const save = h("button", { type: "submit", text: "Save changes" });
    const reset = h("button", { type: "button", class: "secondary", text: "Discard changes", onclick: () => draw(doc) });
    form.append(h("div", { class: "actions" }, save, reset));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const patch = {};
      const changed = [];
      for (const { f, input, current } of controls) {
        let value;
        if (input.type === "checkbox") value = input.checked;
        else if (input.type === "password") { if (!input.value) continue; value = input.value; }
        else if (Array.isArray(current)) value = input.value.split(",").map((s) => s.trim()).filter(Boolean);
        else if (input.dataset.json) {
          try { value = input.value.trim() === "" ? null : JSON.parse(input.value); }
          catch { announce(`${f.key}: not JSON`); return; }
        }
        else if (input.type === "number") value = input.value === "" ? null : Number(input.value);
        // The server coerces numbers written as text, so a value it has no type for yet goes as typed.
        else value = input.value === "" ? null : input.value;
        if (JSON.stringify(value) === JSON.stringify(current ?? null)) continue;
        merge(patch, patchFor(f.key, value));
        changed.push(f);
      }
      if (!changed.length) { announce("Nothing has changed"); return; }
      try {
        const next = await api("/settings", { method: "PATCH", json: patch });
        const live = changed.filter((f) => f.applies === "live").length;
        announce(`Saved: ${live} applied now, ${changed.length - live} wait for a restart`);
        draw(next);
      } catch (error) {
        announce(error.message);
        const bad = error.field && form.querySelector(`[data-key="${CSS.escape(error.field)}"]`);
        if (bad) { bad.setAttribute("aria-invalid", "true"); bad.focus(); }
      }
    });
    holder.replaceChildren(form);
  }

  draw(await api("/settings"));
  return null;
}
