// Voices: an engine's voices, with previews; create one from a reference clip or a
// voicepack, blend two, delete one (protocol.md section 7).
import { api, effectiveVariant, enc, engineSelect } from "./api.js";
import { announce, field, h, select, table } from "./dom.js";

export async function render(main) {
  const engine = await engineSelect(main);
  if (!engine) return null;
  const listing = h("section", { "aria-labelledby": "voices-heading" });
  const forms = h("div");
  main.append(h("div", { class: "card" }, field("Engine", engine)), listing, forms);

  async function draw() {
    const id = engine.value;
    const [caps, voices] = await Promise.all([
      api(`/engines/${enc(id)}/capabilities`),
      api(`/engines/${enc(id)}/voices`),
    ]);
    const doc = caps.variants[effectiveVariant(caps)] || {};
    const cloning = doc.cloning || {};
    const blending = doc.blending || {};
    const rows = voices.map((v) => {
      const audio = h("audio", { controls: true, preload: "none", src: v.previewUrl ? `/api${v.previewUrl}` : undefined,
        "aria-label": `Preview of ${v.label || v.id}` });
      const remove = v.builtin ? h("span", { class: "hint", text: "built in" }) : h("button", {
        type: "button", class: "danger", text: "Delete", "aria-label": `Delete voice ${v.id}`,
        onclick: async () => {
          if (!window.confirm(`Delete the voice ${v.id} from ${id}? This cannot be undone.`)) return;
          try {
            await api(`/engines/${enc(id)}/voices/${enc(v.id)}`, { method: "DELETE" });
            announce(`Deleted ${v.id}`);
            await draw();
          } catch (error) { announce(error.message); }
        },
      });
      return [h("span", { class: "mono", text: v.id }), v.label || "", v.description || "",
        (v.tags || []).join(", "), v.previewUrl ? audio : "-", remove];
    });
    listing.replaceChildren(h("h2", { id: "voices-heading", text: `Voices of ${id}` }),
      table(["Id", "Label", "Description", "Tags", "Preview", ""], rows, `Voices of ${id}`));
    forms.replaceChildren();
    if (cloning.supported) forms.append(createForm(id, cloning));
    else forms.append(h("p", { class: "hint", text: `${id} does not make voices from a reference.` }));
    if (blending.supported) forms.append(blendForm(id, voices));
    else forms.append(h("p", { class: "hint", text: `${id} does not blend voices.` }));
  }

  function createForm(id, cloning) {
    const formats = cloning.formats || [];
    const name = h("input", { type: "text", name: "id", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9_\\-]{0,63}",
      autocomplete: "off" });
    const label = h("input", { type: "text", name: "label", autocomplete: "off" });
    const reference = h("input", { type: "file", name: "reference", required: true,
      accept: formats.map((f) => `.${f}`).join(",") });
    const transcript = h("input", { type: "text", name: "transcript", autocomplete: "off" });
    const seconds = cloning.referenceSeconds ? ` of ${cloning.referenceSeconds[0]} to ${cloning.referenceSeconds[1]} seconds` : "";
    const form = h("form", { class: "card", "aria-labelledby": "create-heading" },
      h("h2", { id: "create-heading", text: "Create a voice from a reference" }),
      h("div", { class: "grid" },
        field("New voice id", name, "Letters, digits, - and _, up to 64."),
        field("Label", label),
        field("Reference", reference, `A clip or voicepack${seconds}: ${formats.join(", ") || "any type the engine reads"}.`),
        field("Transcript", transcript, "What the clip says (optional; some engines need it).")),
      h("div", { class: "actions" }, h("button", { type: "submit", text: "Create voice" })));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const data = new FormData();
      data.append("id", name.value);
      if (label.value) data.append("label", label.value);
      if (transcript.value) data.append("transcript", transcript.value);
      data.append("reference", reference.files[0]);
      try {
        const made = await api(`/engines/${enc(id)}/voices`, { method: "POST", body: data });
        announce(`Created ${made.id}`);
        await draw();
      } catch (error) { announce(error.message); }
    });
    return form;
  }

  function blendForm(id, voices) {
    const ids = voices.map((v) => v.id);
    const name = h("input", { type: "text", name: "id", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9_\\-]{0,63}",
      autocomplete: "off" });
    const label = h("input", { type: "text", name: "label", autocomplete: "off" });
    const first = select(ids, ids[0]);
    const second = select(ids, ids[1] || ids[0]);
    const w1 = h("input", { type: "number", min: "0.01", step: "any", value: "1", required: true });
    const w2 = h("input", { type: "number", min: "0.01", step: "any", value: "1", required: true });
    const form = h("form", { class: "card", "aria-labelledby": "blend-heading" },
      h("h2", { id: "blend-heading", text: "Blend two voices" }),
      h("div", { class: "grid" },
        field("New voice id", name), field("Label", label),
        field("First voice", first), field("Weight of the first", w1),
        field("Second voice", second), field("Weight of the second", w2)),
      h("p", { class: "hint", text: "Weights are normalised to sum to 1; the blend is made once, now." }),
      h("div", { class: "actions" }, h("button", { type: "submit", text: "Blend" })));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const data = new FormData();
      data.append("id", name.value);
      if (label.value) data.append("label", label.value);
      data.append("blend", `${first.value}(${w1.value})+${second.value}(${w2.value})`);
      try {
        const made = await api(`/engines/${enc(id)}/voices`, { method: "POST", body: data });
        announce(`Blended ${made.id}`);
        await draw();
      } catch (error) { announce(error.message); }
    });
    return form;
  }

  engine.addEventListener("change", () => draw().catch((e) => announce(e.message)));
  await draw();
  return null;
}
