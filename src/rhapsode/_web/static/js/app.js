// The page's shell: one module per page, chosen by the location's hash.
import { announce, h } from "./dom.js";

const pages = {
  try: ["Try it", () => import("./try.js")],
  voices: ["Voices", () => import("./voices.js")],
  engines: ["Engines", () => import("./engines.js")],
  settings: ["Settings", () => import("./settings.js")],
  api: ["API", () => import("./apiref.js")],
};

let leave = null;

async function show() {
  const name = (location.hash || "#try").slice(1);
  const [title, load] = pages[name] || pages.try;
  for (const link of document.querySelectorAll("nav a")) {
    if (link.getAttribute("href") === `#${name}`) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (leave) { leave(); leave = null; }
  const main = document.getElementById("main");
  main.replaceChildren(h("h1", { text: title }));
  document.title = `${title} · Rhapsode`;
  try {
    const module = await load();
    leave = (await module.render(main)) || null;
    main.dataset.ready = name;
  } catch (error) {
    main.append(h("p", { class: "error", text: `This page could not be drawn: ${error.message}` }));
    announce(error.message);
  }
}

window.addEventListener("hashchange", () => {
  show().then(() => document.getElementById("main").focus());
});
show();
