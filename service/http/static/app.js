// OCR service web UI: plain JS, no dependencies. Talks to the public API with the key typed into the page.
// A single image goes to POST /v1/ocr; a PDF or several images become a job (POST /v1/jobs) whose pages arrive
// one by one, in page order, from GET /v1/jobs/{id}/events (read with fetch, since EventSource cannot send headers).
// Only the controls the engine supports are shown (/ui/config.json says which); the API key field only where the
// service asks for keys, its value kept in sessionStorage (this tab only, gone when it closes).
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_CANVAS_WIDTH = 1000;
const KEY_STORAGE = "ocr-serve.api-key";
let config = null;
let currentJob = null; // {id, controller}
let shown = null; // what Copy text / Download JSON take: {name, pages: [{page, result, error}], job}

function authHeaders() {
  const key = $("api-key").value.trim();
  // in open mode the field is off and nothing is sent
  return key && (!config || config.auth_required) ? { Authorization: "Bearer " + key } : {};
}

function rememberKey() {
  const key = $("api-key").value.trim();
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  } catch (_) { /* storage off: the key lives in the field only */ }
}

function restoreKey() {
  try {
    $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  } catch (_) { /* storage off */ }
}

function showKeyField(required) {
  $("api-key-control").hidden = !required;
  $("api-key").disabled = !required;
  $("api-key").required = required;
  $("open-mode").hidden = required;
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = kind || "muted";
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text; // never innerHTML: OCR text is untrusted
  return node;
}

// Loaded at start and again when the key changes: adapter names come only with a valid key.
async function loadConfig() {
  let resp;
  try {
    resp = await fetch("/ui/config.json", { headers: authHeaders() });
    if (!resp.ok) {
      if (resp.status === 401) showKeyField(true); // a wrong key: let it be fixed
      setStatus("Could not load the service configuration: " + (await errorText(resp)), "error");
      return;
    }
    config = await resp.json();
  } catch (err) {
    setStatus("Could not load the service configuration: " + err, "error");
    return;
  }
  if ($("status").className === "error") setStatus("Choose a file and press Run.");
  showKeyField(config.auth_required);
  $("engine").textContent = `engine: ${config.engine} · model: ${config.model}` +
    (config.auth_required ? (config.authenticated ? " · API key accepted" : " · API key required") : "");
  const select = $("task");
  const chosen = select.value;
  select.replaceChildren();
  for (const task of config.tasks.filter((t) => t.supported)) {
    select.appendChild(el("option", { value: task.name }, task.name));
  }
  const keep = config.tasks.find((t) => t.supported && t.name === chosen) || config.tasks.find((t) => t.supported);
  if (keep) select.value = keep.name;
  const missing = config.tasks.filter((t) => !t.supported).map((t) => t.name);
  $("unsupported-tasks").textContent = missing.length
    ? `Not on the ${config.engine} engine: ${missing.join(", ")}.` : "";
  $("unsupported-tasks").hidden = !missing.length;
  const adapters = Boolean(config.features && config.features.adapters);
  $("adapter-control").hidden = !adapters;
  if (!adapters) $("adapter").value = "";
  $("adapters").replaceChildren(...(config.adapters || []).map((name) => el("option", { value: name })));
  onTaskChange();
}

function onTaskChange() {
  const task = $("task").value;
  const info = (config && config.tasks.find((t) => t.name === task)) || {};
  $("task-description").textContent = info.description || "";
  for (const node of document.querySelectorAll(".opt")) {
    node.hidden = !node.classList.contains("opt-" + task);
  }
}

function addTaskFields(form) {
  form.append("task", $("task").value);
  const optional = { fields: "fields", schema: "schema", target_language: "target_language", adapter: "adapter" };
  for (const [id, name] of Object.entries(optional)) {
    const node = $(id);
    if (!node.closest("[hidden]")) { // a hidden control (other task, unsupported) sends nothing
      const value = node.value.trim();
      if (value) form.append(name, value);
    }
  }
}

function isPdf(file) {
  return file.type === "application/pdf" || /\.pdf$/i.test(file.name);
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body.error) return `${resp.status} ${body.error.code}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `HTTP ${resp.status}`;
}

async function onSubmit(event) {
  event.preventDefault();
  const files = Array.from($("file").files);
  if (!files.length) {
    setStatus("Choose a file first.", "error");
    return;
  }
  $("results").replaceChildren();
  $("result-actions").hidden = true;
  shown = null;
  $("run").disabled = true;
  try {
    if (files.length === 1 && !isPdf(files[0])) await runSingle(files[0]);
    else await runJob(files);
  } catch (err) {
    setStatus("Request failed: " + err, "error");
  } finally {
    $("run").disabled = false;
    $("cancel").disabled = true;
    currentJob = null;
  }
}

async function runSingle(file) {
  const form = new FormData();
  form.append("file", file);
  addTaskFields(form);
  setStatus("Recognising…");
  const started = performance.now();
  const resp = await fetch("/v1/ocr", { method: "POST", body: form, headers: authHeaders() });
  const clientMs = performance.now() - started;
  if (!resp.ok) {
    setStatus(await errorText(resp), "error");
    return;
  }
  const result = await resp.json();
  shown = { name: result.id || "ocr-result", pages: [{ page: 1, result }] };
  await renderPage({ number: 1, imageSrc: URL.createObjectURL(file), result, clientMs });
  $("result-actions").hidden = false;
  setStatus(`Done in ${clientMs.toFixed(0)} ms — ${result.lines.length} lines.`, "ok");
}

async function runJob(files) {
  const form = new FormData();
  for (const file of files) form.append("file", file);
  addTaskFields(form);
  const pages = $("pages").value.trim();
  if (pages) form.append("pages", pages);
  form.append("return_page_images", "true");
  setStatus("Uploading…");
  const started = performance.now();
  const resp = await fetch("/v1/jobs", { method: "POST", body: form, headers: authHeaders() });
  if (resp.status !== 202) {
    setStatus(await errorText(resp), "error");
    return;
  }
  const job = await resp.json();
  shown = { name: job.id, job: job.id, pages: [] };
  const controller = new AbortController();
  currentJob = { id: job.id, controller };
  $("cancel").disabled = false;
  const progress = $("progress");
  progress.hidden = false;
  progress.max = job.pages_total;
  progress.value = 0;
  setStatus(`Job ${job.id}: 0 / ${job.pages_total} pages`);
  let done = 0;
  await readEvents(`/v1/jobs/${job.id}/events`, controller.signal, async (type, data) => {
    if (type === "page") {
      done += 1;
      progress.value = done;
      setStatus(`Job ${job.id}: ${done} / ${job.pages_total} pages`);
      shown.pages.push({ page: data.page, result: data.result || null, error: data.error || null });
      $("result-actions").hidden = false;
      await renderPage({ number: data.page, imageSrc: data.image, result: data.result, error: data.error,
                         dpi: data.dpi, attempts: data.attempts });
    } else if (type === "done") {
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      const failed = data.pages_failed ? `, ${data.pages_failed} failed` : "";
      setStatus(`Job ${data.status}: ${data.pages_done} / ${data.pages_total} pages${failed} in ${seconds} s.`,
                data.status === "succeeded" ? "ok" : "error");
    } else if (type === "error") {
      setStatus(`Job error: ${data.error.code}: ${data.error.message}`, "error");
    }
  });
}

// Minimal SSE reader over fetch (the events endpoint needs the Authorization header).
async function readEvents(url, signal, onEvent) {
  const resp = await fetch(url, { headers: { ...authHeaders(), Accept: "text/event-stream" }, signal });
  if (!resp.ok) {
    setStatus(await errorText(resp), "error");
    return;
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (signal.aborted) return;
      throw err;
    }
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let type = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) type = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) await onEvent(type, JSON.parse(data.join("\n")));
    }
  }
}

async function onCancel() {
  if (!currentJob) return;
  $("cancel").disabled = true;
  const resp = await fetch(`/v1/jobs/${currentJob.id}`, { method: "DELETE", headers: authHeaders() });
  if (!resp.ok) setStatus(await errorText(resp), "error");
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("could not load the page image"));
    img.src = src;
  });
}

function confidenceColour(confidence) {
  if (confidence === null || confidence === undefined) return "rgb(0, 120, 255)";
  if (confidence >= 0.9) return "rgb(0, 170, 70)";
  if (confidence >= 0.7) return "rgb(230, 140, 0)";
  return "rgb(220, 30, 30)";
}

function confidenceClass(confidence) {
  if (confidence === null || confidence === undefined) return "conf-none";
  if (confidence >= 0.9) return "conf-high";
  if (confidence >= 0.7) return "conf-mid";
  return "conf-low";
}

function linePoints(line) {
  return line.polygon && line.polygon.length ? line.polygon
    : [[line.box[0], line.box[1]], [line.box[2], line.box[1]], [line.box[2], line.box[3]], [line.box[0], line.box[3]]];
}

// The page with every line's outline, coloured by confidence; nothing is drawn over the text itself (confidences
// are in the line list beside the page and in the tooltip of the box under the pointer). Boxes are in pixels of the
// uploaded (or rendered) page.
async function drawPage(canvas, imageSrc, result) {
  const pageWidth = result.image.width;
  const scale = Math.min(1, MAX_CANVAS_WIDTH / pageWidth);
  canvas.width = Math.round(pageWidth * scale);
  canvas.height = Math.round(result.image.height * scale);
  let image = null;
  if (imageSrc) {
    try {
      image = await loadImage(imageSrc);
    } catch (_) { /* boxes on white */ }
  }
  canvas.ocr = { image, lines: result.lines || [], scale, highlight: -1 };
  paint(canvas);
  canvas.dataset.boxes = String(canvas.ocr.lines.length);
}

function paint(canvas) {
  const { image, lines, scale, highlight } = canvas.ocr;
  const g = canvas.getContext("2d");
  g.fillStyle = "white";
  g.fillRect(0, 0, canvas.width, canvas.height);
  if (image) g.drawImage(image, 0, 0, canvas.width, canvas.height);
  // strokes keep a readable width on screen whatever CSS scaling the canvas gets
  const shownScale = canvas.clientWidth ? canvas.clientWidth / canvas.width : 1;
  lines.forEach((line, i) => {
    g.strokeStyle = confidenceColour(line.confidence);
    g.lineWidth = Math.max(1.5, 1.5 / shownScale) * (i === highlight ? 2.5 : 1);
    g.beginPath();
    linePoints(line).forEach(([x, y], k) => (k ? g.lineTo(x * scale, y * scale) : g.moveTo(x * scale, y * scale)));
    g.closePath();
    g.stroke();
  });
  canvas.dataset.highlight = String(highlight);
}

// The line whose box holds a point (canvas pixels), the smallest when boxes nest; -1 if none.
function lineAt(canvas, x, y) {
  const { lines, scale } = canvas.ocr;
  let best = -1;
  let bestArea = Infinity;
  lines.forEach((line, i) => {
    const xs = linePoints(line).map((p) => p[0] * scale);
    const ys = linePoints(line).map((p) => p[1] * scale);
    const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    const area = (x1 - x0) * (y1 - y0);
    if (x >= x0 - 2 && x <= x1 + 2 && y >= y0 - 2 && y <= y1 + 2 && area < bestArea) {
      best = i;
      bestArea = area;
    }
  });
  return best;
}

// One line highlighted on the canvas and in the list; its tooltip below the box (never over its text).
function highlightLine(card, index, fromList) {
  const canvas = card.querySelector("canvas");
  if (!canvas || !canvas.ocr || canvas.ocr.highlight === index) return;
  canvas.ocr.highlight = index;
  paint(canvas);
  for (const item of card.querySelectorAll(".line-list li")) {
    item.classList.toggle("active", Number(item.dataset.line) === index);
  }
  const tip = card.querySelector(".box-tip");
  if (index < 0) {
    tip.hidden = true;
    return;
  }
  const line = canvas.ocr.lines[index];
  const conf = line.confidence === null || line.confidence === undefined ? "no confidence"
    : `confidence ${line.confidence.toFixed(3)}`;
  tip.textContent = `${conf} · ${line.text}`;
  const ys = linePoints(line).map((p) => p[1] * canvas.ocr.scale);
  const xs = linePoints(line).map((p) => p[0] * canvas.ocr.scale);
  const shownScale = canvas.clientWidth / canvas.width;
  tip.style.left = `${canvas.offsetLeft + Math.min(...xs) * shownScale}px`;
  tip.style.top = `${canvas.offsetTop + Math.max(...ys) * shownScale + 4}px`;
  tip.hidden = false;
  if (!fromList) {
    const item = card.querySelector(`.line-list li[data-line="${index}"]`);
    if (item) item.scrollIntoView({ block: "nearest" });
  }
}

function lineList(card, lines) {
  const list = el("ol", { class: "line-list" });
  lines.forEach((line, i) => {
    const conf = line.confidence === null || line.confidence === undefined ? "–" : line.confidence.toFixed(2);
    const item = el("li", { "data-line": String(i), tabindex: "0" });
    item.append(el("span", { class: "conf " + confidenceClass(line.confidence) }, conf), el("span", {}, line.text));
    item.addEventListener("mouseenter", () => highlightLine(card, i, true));
    item.addEventListener("focus", () => highlightLine(card, i, true));
    list.appendChild(item);
  });
  list.addEventListener("mouseleave", () => highlightLine(card, -1, true));
  return list;
}

function timingsTable(timings, extra) {
  const table = el("table", { class: "timings" });
  const rows = Object.entries(timings || {}).map(([k, v]) => [k, `${Number(v).toFixed(1)} ms`]);
  for (const [k, v] of Object.entries(extra || {})) rows.push([k, v]);
  for (const [name, value] of rows) {
    const tr = el("tr");
    tr.append(el("th", {}, name), el("td", {}, value));
    table.appendChild(tr);
  }
  return table;
}

async function renderPage({ number, imageSrc, result, error, clientMs, dpi, attempts }) {
  const card = el("article", { class: "page", "data-page": String(number) });
  card.appendChild(el("h2", {}, `Page ${number}`));
  $("results").appendChild(card);
  if (error || !result) {
    const message = error ? `${error.code}: ${error.message}` : "no result";
    card.appendChild(el("p", { class: "error page-error" }, `Failed after ${attempts || 0} attempt(s) — ${message}`));
    return;
  }
  const body = el("div", { class: "page-body" });
  const view = el("div", { class: "page-view" });
  const canvas = el("canvas", { class: "page-canvas" });
  const tip = el("div", { class: "box-tip", role: "tooltip" });
  tip.hidden = true;
  view.append(canvas, tip);
  const side = el("div", { class: "page-side" });
  body.append(view, side);
  card.appendChild(body);
  canvas.addEventListener("mousemove", (event) => {
    if (!canvas.ocr) return;
    const box = canvas.getBoundingClientRect();
    const x = (event.clientX - box.left) * canvas.width / box.width;
    const y = (event.clientY - box.top) * canvas.height / box.height;
    highlightLine(card, lineAt(canvas, x, y), false);
  });
  canvas.addEventListener("mouseleave", () => highlightLine(card, -1, false));

  const summary = [`${(result.lines || []).length} lines`];
  if (result.confidence !== null && result.confidence !== undefined) {
    summary.push(`confidence ${result.confidence.toFixed(3)}`);
  }
  summary.push(`${result.image.width}×${result.image.height}px`);
  if (dpi) summary.push(`${dpi} dpi`);
  side.appendChild(el("p", { class: "muted" }, summary.join(" · ")));
  side.appendChild(el("pre", { class: "page-text" }, result.text));
  if ((result.lines || []).length) {
    const lines = el("details", { class: "page-lines", open: "" });
    lines.append(el("summary", {}, "Lines and confidences"), lineList(card, result.lines));
    side.appendChild(lines);
  }
  if (result.fields) side.appendChild(el("pre", { class: "page-fields" }, JSON.stringify(result.fields, null, 2)));
  for (const warning of result.warnings || []) side.appendChild(el("p", { class: "warning" }, warning));
  const extra = {};
  if (clientMs !== undefined) extra["round trip"] = `${clientMs.toFixed(1)} ms`;
  if (attempts > 1) extra.attempts = String(attempts);
  side.appendChild(timingsTable(result.timings_ms, extra));
  const details = el("details");
  details.append(el("summary", {}, "JSON"), el("pre", { class: "page-json" }, JSON.stringify(result, null, 2)));
  side.appendChild(details);
  await drawPage(canvas, imageSrc, result);
}

function shownText() {
  return shown.pages.map((p) => (p.result && p.result.text) || "").join("\n\n");
}

async function onCopyText() {
  if (!shown) return;
  const text = shownText();
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) { // no clipboard API (plain http off loopback is not a secure context): the selection way
    const area = el("textarea", { readonly: "", class: "offscreen" });
    area.value = text;
    document.body.appendChild(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    if (!copied) {
      setStatus("Could not copy: the browser refused the clipboard.", "error");
      return;
    }
  }
  setStatus(`Copied ${text.length} characters of text.`, "ok");
}

function onDownloadJson() {
  if (!shown) return;
  const body = shown.job ? { job: shown.job, pages: shown.pages } : shown.pages[0].result;
  const url = URL.createObjectURL(new Blob([JSON.stringify(body, null, 2)], { type: "application/json" }));
  const link = el("a", { href: url, download: `${shown.name}.json` });
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function describeFiles() {
  const files = Array.from($("file").files);
  $("drop-hint").textContent = files.length
    ? `Ready: ${files.map((f) => f.name).join(", ")}` : "or drop files here";
}

function setupDrop() {
  const zone = $("drop");
  const has = (event) => Array.from(event.dataTransfer ? event.dataTransfer.types : []).includes("Files");
  // the whole page takes the drop (a file dropped beside the zone must not navigate away from the page)
  document.addEventListener("dragover", (event) => {
    if (!has(event)) return;
    event.preventDefault();
    event.dataTransfer.dropEffect = "copy";
    zone.classList.add("dragging");
  });
  document.addEventListener("dragleave", (event) => {
    if (!event.relatedTarget) zone.classList.remove("dragging");
  });
  document.addEventListener("drop", (event) => {
    if (!has(event)) return;
    event.preventDefault();
    zone.classList.remove("dragging");
    if (event.dataTransfer.files.length) {
      $("file").files = event.dataTransfer.files;
      describeFiles();
      setStatus("Press Run.");
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", onSubmit);
  $("task").addEventListener("change", onTaskChange);
  $("cancel").addEventListener("click", onCancel);
  $("copy-text").addEventListener("click", onCopyText);
  $("download-json").addEventListener("click", onDownloadJson);
  $("file").addEventListener("change", describeFiles);
  $("api-key").addEventListener("change", () => {
    rememberKey();
    loadConfig();
  });
  setupDrop();
  restoreKey();
  loadConfig();
});
