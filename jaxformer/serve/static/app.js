// The page's behaviour: pickers from GET /languages, POST /translate, alternatives, copy, and
// (for a JAX-engine model) POST /attention's heat map. Plain JavaScript, no external assets.
"use strict";

const $ = (id) => document.getElementById(id);
let languages = [];   // GET /languages
let models = [];      // GET /models

function option(code, name) {
  const o = document.createElement("option");
  o.value = code;
  o.textContent = `${name} (${code})`;
  return o;
}

function fillTargets() {
  const source = $("source").value;
  const previous = $("target").value;
  const entry = languages.find((l) => l.code === source);
  const targets = source === "auto"
    ? [...new Set(languages.flatMap((l) => l.targets))]
    : (entry ? entry.targets : []);
  $("target").replaceChildren(...targets.map((code) => {
    const known = languages.find((l) => l.code === code);
    return option(code, known ? known.name : code);
  }));
  if (targets.includes(previous)) $("target").value = previous;
  updateHeatmapButton();
}

function modelOf(source, target) {
  return models.find((m) => m.sources.includes(source) && m.targets.includes(target));
}

function updateHeatmapButton() {
  const model = modelOf($("source").value, $("target").value);
  $("heatmap").hidden = !(model && model.features.includes("attention") && model.sources.length === 1);
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "muted";
}

async function post(path, body) {
  const key = $("api-key").value;
  if (key) body.api_key = key;
  return fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                       body: JSON.stringify(body) });
}

async function translate() {
  const q = $("text").value;
  if (!q.trim()) return;
  const alternatives = Number($("alternatives").value) || 0;
  $("translate").disabled = true;
  status("translating…");
  const started = performance.now();
  try {
    const response = await post("/translate", { q, source: $("source").value, target: $("target").value,
                                                format: "text", alternatives });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || response.statusText);
    $("translation").textContent = answer.translatedText;
    $("alternatives-list").replaceChildren(...(answer.alternatives || []).map((text) => {
      const li = document.createElement("li");
      li.textContent = text;
      return li;
    }));
    const detected = answer.detectedLanguage ? ` · detected ${answer.detectedLanguage.language}` : "";
    status(`${Math.round(performance.now() - started)} ms${detected}`);
    $("copy").disabled = false;
    $("heatmap").disabled = false;
    $("heatmap-figure").hidden = true;
  } catch (e) {
    status(e.message, true);
  } finally {
    $("translate").disabled = false;
  }
}

async function heatmap() {
  status("drawing…");
  const response = await post("/attention", { q: $("text").value, source: $("source").value,
                                              target: $("target").value });
  if (!response.ok) {
    status((await response.json()).error || response.statusText, true);
    return;
  }
  const image = $("heatmap-image");
  if (image.src) URL.revokeObjectURL(image.src);
  image.src = URL.createObjectURL(await response.blob());
  $("heatmap-figure").hidden = false;
  status("");
}

async function copy() {
  const text = $("translation").textContent;
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
    } else {   // a page served over plain http from another host: the clipboard API is not there
      const area = Object.assign(document.createElement("textarea"), { value: text });
      document.body.append(area);
      area.select();
      const copied = document.execCommand("copy");
      area.remove();
      if (!copied) throw new Error("the browser refused");
    }
    status("copied");
  } catch (e) {
    status(`copy failed: ${e.message}`, true);
  }
}

async function start() {
  const [langs, served, settings] = await Promise.all(
    ["/languages", "/models", "/frontend/settings"].map((path) => fetch(path).then((r) => r.json())));
  languages = langs;
  models = served;
  const sources = languages.filter((l) => l.targets.length);
  $("source").replaceChildren(option("auto", "Detect"), ...sources.map((l) => option(l.code, l.name)));
  if (sources.length) $("source").value = sources[0].code;
  const limit = Math.min(...models.map((m) => m.alternatives_limit));
  $("alternatives").max = String(limit);
  $("key-label").hidden = !settings.keyRequired;
  fillTargets();
  $("count").textContent = settings.charLimit > 0 ? `at most ${settings.charLimit} characters` : "";
  $("text").maxLength = settings.charLimit > 0 ? settings.charLimit : -1;
}

$("source").addEventListener("change", fillTargets);
$("target").addEventListener("change", updateHeatmapButton);
$("swap").addEventListener("click", () => {
  const source = $("source").value;
  const target = $("target").value;
  if (source === "auto" || ![...$("source").options].some((o) => o.value === target)) return;
  $("source").value = target;
  fillTargets();
  if ([...$("target").options].some((o) => o.value === source)) $("target").value = source;
  updateHeatmapButton();
});
$("translate").addEventListener("click", translate);
$("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate(); });
$("copy").addEventListener("click", copy);
$("heatmap").addEventListener("click", heatmap);
start().catch((e) => status(`cannot reach the service: ${e.message}`, true));
