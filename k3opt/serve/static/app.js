// k3opt planning lab: the page sends its control values to the API and draws what evaluate() and plan() return.
"use strict";

const clientId = sessionStorage.getItem("k3opt-client") || Math.random().toString(36).slice(2, 14);
sessionStorage.setItem("k3opt-client", clientId);
const controls = document.getElementById("controls");
const planControls = document.getElementById("plan-controls");
const lab = { options: null, view: null, form: null, plan: null, seq: 0, timer: null, poll: null };
window.k3lab = lab;

async function api(method, path, body) {
  const res = await fetch(path, {
    method, headers: { "Content-Type": "application/json", "X-K3opt-Client": clientId },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const type = res.headers.get("content-type") || "";
  const data = type.includes("json") ? await res.json() : await res.text();
  if (!res.ok) throw (typeof data === "object" ? data : { error: String(data), field: null });
  return data;
}

function fmt(x, d = 2) {
  if (x === null || x === undefined) return "-";
  return Number(x).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
}

// ------------------------------------------------------------------------------------------- form

function fill(select, values) {
  select.innerHTML = "";
  for (const v of values) select.add(new Option(v, v));
}

function readForm() {
  const form = {};
  for (const el of controls.elements) {
    if (!el.name || el.type === "checkbox") continue;
    form[el.name] = el.value.trim();
  }
  if (lab.changed) form.changed = lab.changed;
  form.toggles = {};
  for (const box of controls.querySelectorAll("input[type=checkbox]")) form.toggles[box.name] = box.checked;
  return form;
}

function readPlanForm() {
  const form = readForm();
  for (const el of planControls.elements) if (el.name) form[el.name] = el.value.trim();
  return form;
}

function setForm(values) {
  for (const el of [...controls.elements, ...planControls.elements]) {
    if (!el.name) continue;
    if (el.type === "checkbox") { el.checked = !!(values.toggles || {})[el.name]; continue; }
    if (values[el.name] !== undefined && values[el.name] !== null) el.value = values[el.name];
  }
}

function clearErrors() {
  document.querySelectorAll(".err").forEach((e) => { e.textContent = ""; });
  document.querySelectorAll(".bad").forEach((e) => e.classList.remove("bad"));
}

function showError(err, fallback = "form-error") {
  const span = err.field ? document.querySelector(`.err[data-for="${err.field}"]`) : null;
  const target = span || document.getElementById(fallback);
  target.textContent = err.error;
  const control = err.field ? document.querySelector(`[name="${err.field}"]`) : null;
  if (control) control.classList.add("bad");
}

// ---------------------------------------------------------------------------------------- explore

function schedule(event) {
  if (!lab.pending) lab.changedAt = performance.now();
  if (event && event.target && event.target.name) {
    // The control just edited: a rule that spans several controls is reported beside it (serve/forms.py).
    lab.changed = controls.querySelector(`input[type=checkbox][name="${event.target.name}"]`) ? "toggles" : event.target.name;
  }
  clearTimeout(lab.timer);
  lab.pending = true;
  lab.seq++;  // a response still on its way answers older values: it is dropped, and the page stays pending
  lab.timer = setTimeout(evaluateNow, 30);
}

async function evaluateNow() {
  clearTimeout(lab.timer);
  lab.pending = true;
  const seq = ++lab.seq;
  const form = readForm();
  try {
    const data = await api("POST", "/api/evaluate", form);
    if (seq !== lab.seq) return;  // a later change is on its way
    clearErrors();
    lab.view = data.view;
    lab.form = form;
    draw(data.view);
    lab.pending = false;
    // From the first change since the last redraw to this redraw: what `bench/serve_latency.py` reports.
    if (lab.changedAt !== undefined) document.body.dataset.latencyMs = (performance.now() - lab.changedAt).toFixed(1);
    lab.changedAt = undefined;
    document.body.dataset.evaluated = String(seq);
  } catch (err) {
    if (seq !== lab.seq) return;
    clearErrors();
    showError(err);
    lab.pending = false;
    document.body.dataset.evaluated = String(seq);
  }
}

function draw(v) {
  const s = v.summary;
  const fit = s.fits ? `<b class="ok">fits</b>` : `<b class="over">does not fit</b>`;
  document.getElementById("summary").innerHTML =
    `<div><span data-k="layout">${s.layout}</span>, split <span data-k="split">${s.split}</span>, ` +
    `${s.model} on ${s.cluster}, runtime ${s.runtime}</div>` +
    `<div>step <b data-k="rank_time_s">${fmt(s.rank_time_s, 3)}</b> s (peak roofline ${fmt(s.step_time_s, 3)} s), ` +
    `bound by <b data-k="binding">${s.binding}</b> on rank ${s.slowest_rank}, bubble ${fmt(100 * s.bubble_fraction, 1)}%, ` +
    `${fmt(s.tokens_per_s_per_gpu, 0)} tokens/s per GPU, MFU ${fmt(100 * s.mfu, 1)}%</div>` +
    `<div>worst rank ${s.worst_rank}: device <b data-k="peak_device_gib">${fmt(s.peak_device_gib)}</b> GiB ` +
    `(live tensors ${fmt(s.peak_gib)} GiB) of ${fmt(s.capacity_gib)} usable, headroom ` +
    `<span data-k="headroom_gib">${fmt(s.headroom_gib)}</span> GiB: <span data-k="fits">${fit}</span>; ` +
    `${s.domains_held} racks x ${s.gpus_per_domain} GPUs (${s.gpus_held} held)</div>`;
  drawLedger(v.ledger);
  drawTime(v.time);
  drawTimeline(v.timeline);
  drawTable(document.getElementById("ledger-table"), ["term", ...v.table.columns], v.table.rows);
}

const LAYOUT = { margin: { t: 40, r: 10, b: 40, l: 60 }, barmode: "stack", legend: { font: { size: 10 } },
  font: { family: "system-ui, sans-serif", size: 12 } };
const CONFIG = { displaylogo: false, responsive: true };

function drawLedger(l) {
  const palette = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896",
    "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#bcbd22", "#dbdb8d", "#17becf"];
  const grey = { allocated: "#4d4d4d", reserved: "#8c8c8c", device: "#c7c7c7", "optimizer phase": "#000000" };
  const traces = l.segments.map((s, i) => ({
    type: "bar", name: s.key, x: l.ranks, y: s.gib, legendgroup: s.group,
    marker: { color: grey[s.group] || palette[i % palette.length],
      pattern: { shape: s.group === "activation phase" ? "/" : "" } },
    hovertemplate: `${s.key} (${s.group}): %{y:.2f} GiB<br>${s.formula.slice(0, 120)}<extra>%{x}</extra>`,
  }));
  traces.push({ type: "scatter", mode: "text", x: l.ranks, y: l.device_gib.map((d) => d + 2),
    text: l.device_gib.map((d, i) => fmt(d, 1) + (l.fits[i] ? "" : " over")), showlegend: false,
    textposition: "top center", hoverinfo: "skip" });
  const lines = [
    { y: l.hbm_gib, color: "red", dash: "solid", label: `HBM ${fmt(l.hbm_gib, 1)} GiB` },
  ];
  if (l.capacity_gib < l.hbm_gib) {
    lines.push({ y: l.capacity_gib, color: "red", dash: "dash", label: `HBM - reserve ${fmt(l.capacity_gib, 1)} GiB` });
  }
  Plotly.react("ledger-chart", traces, {
    ...LAYOUT, title: { text: "Per-rank memory: ledger, then allocated / reserved / device", font: { size: 14 } },
    yaxis: { title: { text: "GiB per GPU" }, range: [0, Math.max(l.hbm_gib, ...l.device_gib) * 1.12] },
    shapes: lines.map((x) => ({ type: "line", xref: "paper", x0: 0, x1: 1, y0: x.y, y1: x.y,
      line: { color: x.color, dash: x.dash, width: 1.5 } })),
    annotations: lines.map((x) => ({ xref: "paper", x: 1, y: x.y, text: x.label, showarrow: false,
      xanchor: "right", yanchor: "bottom", font: { color: "red", size: 10 } })),
  }, CONFIG);
}

function drawTime(t) {
  const traces = t.resources.map((res) => ({ type: "bar", name: res, x: t.ranks, y: t.ms[res],
    hovertemplate: `${res}: %{y:.2f} ms per stage-microbatch<extra>%{x}</extra>` }));
  traces.push({ type: "scatter", mode: "markers", name: "stage time", x: t.ranks, y: t.stage_ms,
    marker: { symbol: "line-ew-open", size: 40, color: "black", line: { width: 2 } },
    hovertemplate: "stage %{y:.2f} ms<extra>%{x}</extra>" });
  const marks = t.ranks.map((r, i) => ({ x: r, y: t.stage_ms[i],
    text: (i === t.slowest_rank ? "slowest: " : "") + t.binding[i], showarrow: false, yanchor: "bottom",
    font: { size: 10, color: i === t.slowest_rank ? "#b00" : "#333" } }));
  Plotly.react("time-chart", traces, {
    ...LAYOUT, barmode: "group", annotations: marks,
    title: { text: `Stage time per rank and resource, ${t.rates} (binding resource named; bar: the stage time)`,
      font: { size: 14 } },
    yaxis: { title: { text: "ms per stage-microbatch" } },
  }, CONFIG);
}

function drawTimeline(tl) {
  document.getElementById("timeline-note").textContent = tl.note;
  if (!tl.ops.length) { Plotly.purge("timeline-chart"); return; }
  // Each operation is one thick line segment (start to end on its rank's row), one WebGL trace per kind: the
  // 4,096 operations of an interleaved K3 layout draw in about 30 ms, where as many SVG paths take 150-250 ms.
  const series = { F: { x: [], y: [] }, B: { x: [], y: [] } };
  for (const [rank, kind, , , start, end] of tl.ops) {
    const s = series[kind];
    s.x.push(start, end, null); s.y.push(rank, rank, null);
  }
  const height = Math.max(180, Math.min(520, 40 * tl.pp + 120));
  const width = Math.max(2, Math.min(18, (height - 120) / tl.pp * 0.6));
  const traces = [["F", "forward", "#1f77b4"], ["B", "backward", "#d62728"]].map(([k, name, color]) => ({
    type: "scattergl", mode: "lines", name, x: series[k].x, y: series[k].y, connectgaps: false,
    line: { color, width }, hoverinfo: "skip" }));
  Plotly.react("timeline-chart", traces, {
    ...LAYOUT, height,
    title: { text: `Pipeline schedule, PP${tl.pp} VP${tl.vp}, ${tl.microbatches} microbatches (gaps are the bubble)`,
      font: { size: 14 } },
    xaxis: { title: { text: "seconds within the step's pipeline phase" } },
    yaxis: { autorange: "reversed", tickvals: [...Array(tl.pp).keys()], ticktext: [...Array(tl.pp).keys()].map((r) => `rank ${r}`) },
  }, CONFIG);
}

function drawTable(table, header, rows, onClick) {
  table.innerHTML = "";
  const head = table.createTHead().insertRow();
  for (const h of header) head.appendChild(document.createElement("th")).textContent = h;
  const body = table.createTBody();
  rows.forEach((row, i) => {
    const tr = body.insertRow();
    for (const cell of row) tr.insertCell().textContent = cell;
    if (onClick) tr.addEventListener("click", () => onClick(i));
  });
}

async function download(what) {
  try {
    const res = await fetch(`/api/download/${what}`, { method: "POST", body: JSON.stringify(readForm()),
      headers: { "Content-Type": "application/json", "X-K3opt-Client": clientId } });
    if (!res.ok) throw await res.json();
    const name = (res.headers.get("content-disposition") || "").match(/filename="([^"]+)"/);
    const a = document.createElement("a");
    a.href = URL.createObjectURL(await res.blob());
    a.download = name ? name[1] : what;
    a.click();
  } catch (err) { clearErrors(); showError(err); }
}

// ------------------------------------------------------------------------------------------- plan

function setRunning(running) {
  document.getElementById("cancel-plan").disabled = !running;
}

async function startPlan(pareto) {
  clearErrors();
  document.getElementById("plan-table").innerHTML = "";
  document.getElementById("plan-downloads").innerHTML = "";
  Plotly.purge("front-chart");
  try {
    const run = await api("POST", "/api/plans", { ...readPlanForm(), pareto });
    lab.plan = run;
    document.getElementById("plan-live").textContent = `plan ${run.id} started`;
    setRunning(true);
    clearInterval(lab.poll);
    lab.poll = setInterval(() => pollPlan(run.id), 300);
  } catch (err) { showError(err, "plan-error"); }
}

function liveText(p, state) {
  if (!p) return `${state}: starting`;
  const gap = p.gap === null ? "-" : `${fmt(100 * p.gap)}%`;
  return `${state} | ${p.phase} | ${fmt(p.elapsed_s, 1)} s | best ${p.incumbent_s === null ? "none yet" : fmt(p.incumbent_s, 3) + " s"}` +
    ` | bound ${p.bound_s === null ? "not yet" : fmt(p.bound_s, 3) + " s"} | gap ${gap}` +
    ` | shapes settled ${p.shapes_settled}/${p.shapes_total}` + (p.front_points ? ` | front ${p.front_points} points` : "");
}

async function pollPlan(id) {
  let st;
  try { st = await api("GET", `/api/plans/${id}`); } catch (err) { showError(err, "plan-error"); return; }
  if (!lab.plan || lab.plan.id !== id) return;
  const live = document.getElementById("plan-live");
  live.textContent = liveText(st.progress, st.state);
  live.dataset.state = st.state;
  if (st.state === "running") return;
  clearInterval(lab.poll);
  setRunning(false);
  if (st.state === "failed") { document.getElementById("plan-error").textContent = st.error; return; }
  if (st.state !== "done") return;
  const r = st.result;
  live.textContent = `${r.status}: best ${r.layouts.length ? fmt(r.layouts[0].rank_time_s, 3) : "-"} s, bound ` +
    `${r.bound_s === null ? "-" : fmt(r.bound_s, 3)} s, gap ${fmt(100 * r.gap)}% in ${fmt(r.solve_time_s, 1)} s` +
    (st.pareto ? `; front ${r.pareto.length} points, ${r.pareto_complete ? "every point proven" : "not every point proven"}` : "");
  lab.plan.result = r;
  document.getElementById("plan-downloads").innerHTML =
    `<a href="/api/plans/${id}/csv" download>${st.pareto ? "front" : "plan"} CSV</a>`;
  const items = st.pareto ? r.pareto : r.layouts;
  drawTable(document.getElementById("plan-table"),
    ["#", "layout", "split", "recompute", "step s", "device GiB", "headroom GiB", "binds", "runs on", "toggles"]
      .concat(st.pareto ? ["proven"] : []),
    items.map((it) => [it.index + 1, it.layout, it.split, it.recompute, fmt(it.rank_time_s, 3),
      fmt(it.peak_device_gib), fmt(it.headroom_gib), it.binding, it.runs_on ? it.runs_on.join(" ") || "none" : "-",
      it.toggles].concat(st.pareto ? [it.proven ? "yes" : "no"] : [])),
    (i) => loadItem(items[i]));
  if (st.pareto && r.pareto.length) drawFront(r.pareto);
}

function drawFront(points) {
  Plotly.react("front-chart", [{
    type: "scatter", mode: "lines+markers", line: { shape: "hv" }, name: "front",
    x: points.map((p) => p.peak_gib), y: points.map((p) => p.rank_time_s),
    text: points.map((p) => `${p.layout}<br>${p.recompute}, split ${p.split}`),
    hovertemplate: "%{text}<br>%{y:.3f} s at %{x:.1f} GiB<extra>click to explore</extra>",
    marker: { size: 10 },
  }], { ...LAYOUT, title: { text: "Pareto front: step time against worst-rank peak (click a point)", font: { size: 14 } },
    xaxis: { title: { text: "worst-rank live-tensor peak, GiB" } }, yaxis: { title: { text: "ranked step time, s" } } }, CONFIG);
  document.getElementById("front-chart").on("plotly_click", (e) => loadItem(points[e.points[0].pointIndex]));
}

function loadItem(item) {
  const runtime = controls.elements.runtime.value;
  setForm({ ...item.form, runtime });
  showTab("explore");
  evaluateNow();
}

// -------------------------------------------------------------------------------- validation, sweeps

async function loadValidation() {
  const v = await api("GET", "/api/validation");
  drawTable(document.getElementById("fit-table"),
    ["run", "model", "cluster", "runtime", "device GiB", "without slack GiB", "HBM GiB", "fits"],
    v.fit.map((r) => [r.layout, r.model, r.cluster, r.runtime, fmt(r.device_gib, 1), fmt(r.floor_gib, 1),
      fmt(r.hbm_gib, 1), r.verdict]));
  drawTable(document.getElementById("memory-table"), ["run", "figure", "kind", "modeled", "measured", "unit", "GAP", "GAP %"],
    v.memory.map((r) => [r.layout, r.figure, r.kind, fmt(r.modeled), fmt(r.measured), r.unit, fmt(r.gap), fmt(r.gap_pct, 1)]));
  const t = v.throughput;
  document.getElementById("throughput-summary").textContent =
    `mean absolute error ${fmt(t.mean_abs_error_pct, 1)}%, largest ${fmt(t.max_abs_error_pct, 1)}% ` +
    `(peak roofline: ${fmt(t.roofline_mean_abs_error_pct, 1)}%)`;
  drawTable(document.getElementById("throughput-table"),
    ["run", "model", "cluster", "GPUs", "precision", "measured", "predicted", "error %", "GAP ms per stage-microbatch", "binds"],
    t.rows.map((r) => [r.id, r.model, r.cluster, r.gpus, r.precision, fmt(r.measured_tps_per_gpu, 0),
      fmt(r.predicted_tps_per_gpu, 0), fmt(r.error_pct, 1), fmt(r.stage_gap_ms), r.binding]));
}

async function loadSweeps() {
  const sweeps = await api("GET", "/api/sweeps");
  if (!sweeps.length) return;
  const box = document.getElementById("sweep-list");
  box.innerHTML = "";
  for (const s of sweeps) {
    box.appendChild(document.createElement("h2")).textContent = s.file;
    const table = box.appendChild(document.createElement("table"));
    table.className = "table";
    drawTable(table, s.columns, s.rows.map((r) => s.columns.map((c) => (typeof r[c] === "number" ? fmt(r[c], 3) : r[c] ?? ""))));
    const img = box.appendChild(document.createElement("img"));
    img.src = s.png; img.alt = `sweep ${s.file}`; img.className = "sweep";
  }
}

// ------------------------------------------------------------------------------------------- tabs

const loaded = {};
function showTab(name) {
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === name));
  if (name === "validation" && !loaded.validation) loaded.validation = loadValidation().catch((e) => showError(e));
  if (name === "sweeps" && !loaded.sweeps) loaded.sweeps = loadSweeps().catch((e) => showError(e));
  if (name === "explore" && lab.view) drawTimeline(lab.view.timeline);
}

async function init() {
  const o = await api("GET", "/api/options");
  lab.options = o;
  fill(controls.elements.model, o.models);
  fill(controls.elements.cluster, o.clusters);
  fill(controls.elements.runtime, o.runtimes);
  for (const [name, values] of Object.entries(o.choices)) fill(controls.elements[name], values);
  fill(planControls.elements.target, o.targets);
  const box = document.getElementById("toggles");
  for (const t of o.toggles) {
    const label = document.createElement("label");
    label.className = "toggle";
    label.innerHTML = `<input type="checkbox" name="${t.name}"> ${t.name} <small>${t.kind}</small>`;
    box.insertBefore(label, box.querySelector(".err"));
  }
  document.getElementById("export-buttons").innerHTML =
    o.formats.map((f) => `<button type="button" data-download="${f}">${f}</button>`).join(" ");
  document.querySelectorAll("[data-download]").forEach((b) => b.addEventListener("click", () => download(b.dataset.download)));
  setForm(o.default);
  // A new PP or VP changes the chunk count: the split goes back to even rather than to an error, and a Megatron
  // layout string (which sets the split) is dropped; a split typed by hand replaces the string too.
  for (const name of ["pp", "vp"]) controls.elements[name].addEventListener("input", () => {
    controls.elements.split.value = "";
    controls.elements.pipeline_layout.value = "";
  });
  controls.elements.split.addEventListener("input", () => { controls.elements.pipeline_layout.value = ""; });
  controls.addEventListener("input", schedule);
  controls.addEventListener("change", schedule);
  document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  document.getElementById("run-plan").addEventListener("click", () => startPlan(false));
  document.getElementById("run-pareto").addEventListener("click", () => startPlan(true));
  document.getElementById("cancel-plan").addEventListener("click", async () => {
    if (lab.plan) await api("POST", `/api/plans/${lab.plan.id}/cancel`).catch((e) => showError(e, "plan-error"));
  });
  await evaluateNow();
  document.body.dataset.ready = "1";
}

init().catch((err) => showError(err.error ? err : { error: String(err), field: null }));
