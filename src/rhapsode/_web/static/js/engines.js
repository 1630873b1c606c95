// Engines: the catalog with both licences; install (asking the person to accept a
// weights licence, showing it), reinstall, uninstall and pull, each followed live from
// its job's events; what is resident and until when, and unload (protocol.md section 10).
import { api, enc } from "./api.js";
import { announce, fmtBytes, h, table } from "./dom.js";

export async function render(main) {
  const catalog = h("section", { "aria-labelledby": "catalog-heading" });
  const jobs = h("section", { "aria-labelledby": "jobs-heading" },
    h("h2", { id: "jobs-heading", text: "Jobs" }));
  const jobList = h("div", { id: "jobs" });
  jobs.append(jobList);
  const resident = h("section", { "aria-labelledby": "resident-heading" });
  const dialog = h("dialog", { id: "licence-dialog", "aria-labelledby": "licence-title" });
  main.append(catalog, jobs, resident, dialog);
  const streams = new Set();
  // The jobs whose cards follow them live: the table leaves them out until they end.
  const following = new Set();
  let timer = null;

  async function drawCatalog() {
    const entries = await api("/catalog");
    const rows = entries.map((e) => {
      const lic = e.license || {};
      const weights = h("span", {}, lic.weights || "-",
        lic.weightsCommercialUse === false ? [" ", h("span", { class: "badge warn", text: "not for commercial use" })] : "");
      const state = h("span", {}, e.installed,
        e.outdated ? [" ", h("span", { class: "badge warn", text: "outdated" })] : "",
        e.installed === "yes" && !e.managed ? [" ", h("span", { class: "badge", text: "configured by hand" })] : "");
      const actions = h("div", { class: "actions" });
      if (e.installed === "no") {
        const pull = h("input", { type: "checkbox", id: `pull-${e.id}` });
        actions.append(
          h("button", { type: "button", text: "Install", "aria-label": `Install ${e.displayName || e.id}`,
            onclick: () => install(e, pull.checked ? e.defaultVariant : null) }),
          h("span", { class: "field inline" }, pull,
            h("label", { for: pull.id, text: `also fetch ${e.defaultVariant || "the default variant"}` })));
      }
      if (e.installed === "yes" && e.managed && e.outdated) {
        actions.append(h("button", { type: "button", class: "secondary", text: "Reinstall",
          "aria-label": `Reinstall ${e.id}`, onclick: () => reinstall(e) }));
      }
      if (e.installed === "yes") {
        const variant = h("input", { type: "text", value: e.defaultVariant || "", "aria-label": `Variant of ${e.id} to fetch`,
          size: 10 });
        actions.append(variant, h("button", { type: "button", class: "secondary", text: "Pull",
          "aria-label": `Fetch a variant of ${e.id}`, onclick: () => pull(e, variant.value) }));
      }
      if (e.installed === "yes" && e.managed) {
        actions.append(h("button", { type: "button", class: "danger", text: "Uninstall",
          "aria-label": `Uninstall ${e.id}`, onclick: () => uninstall(e) }));
      }
      return [h("strong", { text: e.displayName || e.id }), h("span", { class: "mono", text: e.id }), lic.code || "-",
        weights, state, e.workerVersion || "-", actions];
    });
    catalog.replaceChildren(h("h2", { id: "catalog-heading", text: "Catalog" }),
      table(["Engine", "Id", "Code licence", "Weights licence", "Installed", "Version", ""], rows, "Every engine that exists"));
  }

  function askLicence(entry) {
    const lic = entry.license || {};
    return new Promise((resolve) => {
      const accept = h("button", { type: "button", text: `Accept ${lic.weights} and install` });
      const cancel = h("button", { type: "button", class: "secondary", text: "Cancel" });
      dialog.replaceChildren(
        h("h2", { id: "licence-title", text: `${entry.displayName || entry.id}: a weights licence to accept` }),
        h("p", {}, "The weights of this engine are licensed ", h("strong", { text: lic.weights }),
          ", which does not allow commercial use. Its code is licensed ", h("strong", { text: lic.code || "-" }), "."),
        lic.notes ? h("p", { class: "hint", text: lic.notes }) : "",
        h("div", { class: "actions" }, accept, cancel));
      const done = (answer) => { dialog.close(); resolve(answer); };
      accept.addEventListener("click", () => done(true));
      cancel.addEventListener("click", () => done(false));
      dialog.addEventListener("cancel", () => resolve(false), { once: true });
      dialog.showModal();
      cancel.focus();
    });
  }

  async function install(entry, variant) {
    const query = new URLSearchParams();
    if (variant) query.set("pull", variant);
    if (entry.license && entry.license.weightsCommercialUse === false) {
      if (!(await askLicence(entry))) { announce("Not installed: the licence was not accepted"); return; }
      query.set("accept", entry.license.weights);
    }
    const suffix = query.toString() ? `?${query}` : "";
    await start(() => api(`/engines/${enc(entry.id)}/install${suffix}`, { method: "POST" }));
  }

  async function reinstall(entry) {
    if (!window.confirm(`Reinstall ${entry.id}? Its model leaves memory and anything added to its virtualenv by hand is lost.`)) return;
    await start(() => api(`/engines/${enc(entry.id)}/reinstall`, { method: "POST" }));
  }

  async function pull(entry, variant) {
    if (!variant) { announce("Name a variant to fetch"); return; }
    await start(() => api(`/engines/${enc(entry.id)}/pull`, { method: "POST", json: { variant } }));
  }

  async function uninstall(entry) {
    if (!window.confirm(`Uninstall ${entry.id}? Its virtualenv is deleted; its weights stay in their cache.`)) return;
    try {
      await api(`/engines/${enc(entry.id)}`, { method: "DELETE" });
      announce(`Uninstalled ${entry.id}`);
    } catch (error) { announce(error.message); }
    await drawCatalog();
  }

  async function start(call) {
    let job;
    try { job = await call(); } catch (error) { announce(error.message); return; }
    announce(`${job.kind} of ${job.engine} started`);
    follow(job);
    await drawCatalog();
  }

  /** A job's card: a progress bar from its progress events and its log, until the last one. */
  function follow(job) {
    const bar = h("progress", { max: 1, value: 0, id: `progress-${job.id}`, "aria-label": `${job.kind} of ${job.engine}` });
    const step = h("p", { class: "hint", text: "queued" });
    const state = h("output", { id: `state-${job.id}`, dataset: { state: job.state }, text: job.state });
    const log = h("pre", { class: "log", "aria-label": `Output of ${job.kind} of ${job.engine}`, tabindex: 0 });
    const card = h("div", { class: "card", id: `job-${job.id}` },
      h("h3", { text: `${job.kind} of ${job.engine}${job.variant ? ` (${job.variant})` : ""}` }), bar, step, state, log);
    jobList.prepend(card);
    following.add(job.id);
    const source = new EventSource(`/api/installs/${enc(job.id)}/events`);
    streams.add(source);
    const finish = (outcome) => {
      source.close();
      streams.delete(source);
      following.delete(job.id);
      state.dataset.state = outcome;
      state.textContent = outcome;
      announce(`${job.kind} of ${job.engine}: ${outcome}`);
      drawCatalog().catch(() => {});
      // Over: it joins the table of jobs, as GET /installs now lists it.
      drawJobs().catch(() => {});
    };
    const line = (text) => {
      // Follows the end only while the reader is at the end.
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.append(`${text}\n`);
      if (atEnd) log.scrollTop = log.scrollHeight;
    };
    const read = (event) => { try { return JSON.parse(event.data); } catch { return {}; } };
    source.addEventListener("progress", (event) => {
      const data = read(event);
      const p = data.progress || {};
      if (p.total) { bar.max = p.total; bar.value = p.status === "running" ? p.index : p.index + 1; }
      step.textContent = `${p.phase || "step"}: ${p.status || ""}`;
      state.dataset.state = "running";
      state.textContent = "running";
      if (p.status && p.status !== "running") {
        if (p.status === "done") bar.value = bar.max;
        finish(p.status === "done" ? "succeeded" : "failed");
      }
    });
    source.addEventListener("log", (event) => line(read(event).message || ""));
    source.addEventListener("status", (event) => line(read(event).message || ""));
    source.addEventListener("error", (event) => { if (event.data) line(`error: ${read(event).message || ""}`); });
    source.addEventListener("resync", async () => {
      try {
        const now = await api(`/installs/${enc(job.id)}`);
        if (now.state === "succeeded" || now.state === "failed") { bar.value = bar.max; finish(now.state); }
      } catch (error) { line(error.message); }
    });
  }

  async function drawJobs() {
    let list = [];
    try { list = await api("/installs"); } catch { return; }
    // A job followed live has its card; every other, finished ones included, is a row.
    const rows = list.filter((j) => !following.has(j.id)).slice(0, 10)
      .map((j) => [j.kind, j.engine, j.variant || "", j.state, j.step || "", j.createdAt || "",
        j.error ? h("span", { class: "error", text: j.error.message }) : ""]);
    const old = jobs.querySelector(".table-wrap");
    if (old) old.remove();
    if (rows.length) jobs.append(table(["Kind", "Engine", "Variant", "State", "Step", "Created", "Error"], rows, "Recent jobs"));
  }

  async function drawResidency() {
    const doc = await api("/residency");
    const rows = (doc.models || []).map((m) => [m.engine, m.variant || "-", fmtBytes(m.sizeBytes), until(m),
      h("div", { class: "actions" },
        h("button", { type: "button", class: "secondary", text: "Unload", "aria-label": `Unload ${m.engine} and end its worker`,
          onclick: () => unload(m.engine, "terminate") }),
        h("button", { type: "button", class: "secondary", text: "Free model", "aria-label": `Free the model of ${m.engine}, keeping its worker`,
          onclick: () => unload(m.engine, "unload") }))]);
    resident.replaceChildren(h("h2", { id: "resident-heading", text: "In memory" }),
      h("p", { class: "hint", text: `${doc.resident} of ${doc.max} model slots used; ${doc.waiting} waiting.` }),
      rows.length ? table(["Engine", "Variant", "Size", "Until", ""], rows, "Resident models")
        : h("p", { text: "Nothing is resident." }));
  }

  async function unload(engine, mode) {
    try {
      await api(`/engines/${enc(engine)}/unload?mode=${enc(mode)}`, { method: "POST" });
      announce(`Unloaded ${engine}`);
    } catch (error) { announce(error.message); }
    await drawResidency();
  }

  await Promise.all([drawCatalog(), drawResidency(), drawJobs()]);
  timer = setInterval(() => { drawResidency().catch(() => {}); drawJobs().catch(() => {}); }, 5000);
  return () => {
    clearInterval(timer);
    for (const source of streams) source.close();
  };
}

function until(model) {
  if (model.leases) return `speaking (${model.leases})`;
  if (model.keepAliveSeconds === -1) return "until unloaded";
  if (!model.expiresAt) return "-";
  const left = Math.round((Date.parse(model.expiresAt) - Date.now()) / 1000);
  if (left <= 0) return "stopping";
  const when = new Date(model.expiresAt).toLocaleTimeString();
  if (left >= 3600) return `${Math.floor(left / 3600)} h ${Math.floor((left % 3600) / 60)} min (${when})`;
  if (left >= 60) return `${Math.floor(left / 60)} min ${left % 60} s (${when})`;
  return `${left} s (${when})`;
}
