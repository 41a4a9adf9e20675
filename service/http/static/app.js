// OCR service web UI: plain JS, no dependencies. Talks to the public API with the key typed into the page.
// A single image goes to POST /v1/ocr; a PDF or several images become a job (POST /v1/jobs) whose pages arrive
// one by one, in page order, from GET /v1/jobs/{id}/events (read with fetch, since EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_CANVAS_WIDTH = 1000;
let config = null;
let currentJob = null; // {id, controller}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
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
      setStatus("Could not load the service configuration: " + (await errorText(resp)), "error");
      return;
    }
    config = await resp.json();
  } catch (err) {
    setStatus("Could not load the service configuration: " + err, "error");
    return;
  }
  if ($("status").className === "error") setStatus("Choose a file and press Run.");
  $("engine").textContent = `engine: ${config.engine} · model: ${config.model}` +
    (config.auth_required ? (config.authenticated ? " · API key accepted" : " · API key required") : "");
  const select = $("task");
  const chosen = select.value;
  select.replaceChildren();
  for (const task of config.tasks) {
    const option = el("option", { value: task.name }, task.name + (task.supported ? "" : " (not on this engine)"));
    if (!task.supported) option.disabled = true;
    select.appendChild(option);
  }
  const keep = config.tasks.find((t) => t.supported && t.name === chosen) || config.tasks.find((t) => t.supported);
  if (keep) select.value = keep.name;
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
    if (!node.closest(".opt") || !node.closest(".opt").hidden) {
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
  await renderPage({ number: 1, imageSrc: URL.createObjectURL(file), result, clientMs });
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

// The page with every line's polygon and confidence; boxes are in pixels of the uploaded (or rendered) page.
async function drawPage(canvas, imageSrc, result) {
  const pageWidth = result.image.width;
  const pageHeight = result.image.height;
  const scale = Math.min(1, MAX_CANVAS_WIDTH / pageWidth);
  canvas.width = Math.round(pageWidth * scale);
  canvas.height = Math.round(pageHeight * scale);
  const g = canvas.getContext("2d");
  g.fillStyle = "white";
  g.fillRect(0, 0, canvas.width, canvas.height);
  if (imageSrc) {
    try {
      g.drawImage(await loadImage(imageSrc), 0, 0, canvas.width, canvas.height);
    } catch (_) { /* boxes on white */ }
  }
  // labels and strokes keep a readable size on screen whatever CSS scaling the canvas gets
  const shown = canvas.clientWidth ? canvas.clientWidth / canvas.width : 1;
  const fontSize = Math.round(12 / shown);
  g.font = `${fontSize}px sans-serif`;
  g.lineWidth = Math.max(1.5, 1.5 / shown);
  let drawn = 0;
  for (const line of result.lines || []) {
    const colour = confidenceColour(line.confidence);
    const points = line.polygon && line.polygon.length ? line.polygon
      : [[line.box[0], line.box[1]], [line.box[2], line.box[1]], [line.box[2], line.box[3]], [line.box[0], line.box[3]]];
    g.strokeStyle = colour;
    g.beginPath();
    points.forEach(([x, y], i) => (i ? g.lineTo(x * scale, y * scale) : g.moveTo(x * scale, y * scale)));
    g.closePath();
    g.stroke();
    if (line.confidence !== null && line.confidence !== undefined) {
      const label = line.confidence.toFixed(2);
      const x = Math.min(...points.map((p) => p[0])) * scale;
      const y = Math.min(...points.map((p) => p[1])) * scale;
      const width = g.measureText(label).width + 6;
      g.fillStyle = colour;
      g.fillRect(x, Math.max(0, y - fontSize - 4), width, fontSize + 4);
      g.fillStyle = "white";
      g.fillText(label, x + 3, Math.max(fontSize, y - 4));
    }
    drawn += 1;
  }
  canvas.dataset.boxes = String(drawn);
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
  const canvas = el("canvas", { class: "page-canvas" });
  const side = el("div", { class: "page-side" });
  body.append(canvas, side);
  card.appendChild(body);

  const summary = [`${(result.lines || []).length} lines`];
  if (result.confidence !== null && result.confidence !== undefined) {
    summary.push(`confidence ${result.confidence.toFixed(3)}`);
  }
  summary.push(`${result.image.width}×${result.image.height}px`);
  if (dpi) summary.push(`${dpi} dpi`);
  side.appendChild(el("p", { class: "muted" }, summary.join(" · ")));
  side.appendChild(el("pre", { class: "page-text" }, result.text));
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

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", onSubmit);
  $("task").addEventListener("change", onTaskChange);
  $("cancel").addEventListener("click", onCancel);
  $("api-key").addEventListener("change", loadConfig);
  loadConfig();
});
