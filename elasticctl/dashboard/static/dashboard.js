// elasticctl dashboard: polls /api/job once a second and redraws. Every value shown comes from
// etcd, which anyone with write access can fill: text goes in with textContent, never as HTML.
// One dashboard may serve several jobs: ?job=NAME in the page's address picks one (the picker
// sets it); without it the dashboard shows its only job, or asks to pick one.
"use strict";

const POLL_MS = 1000;
const EVENTS_LISTED = 200;
let state = { events: [] };  // the last /api/job answer (the markers' draw hook reads it)

function $(id) { return document.getElementById(id); }

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "-";
  return typeof value === "number" && !Number.isInteger(value) ? value.toPrecision(digits) : String(value);
}

// The job this page shows: ?job=NAME, else none (the dashboard's only job).
const CHOSEN = new URLSearchParams(window.location.search).get("job");

// A picker of the jobs the dashboard shows, when there are several: choosing one reloads the
// page with ?job=NAME.
function fillPicker(jobs, current) {
  const picker = $("job-picker");
  picker.style.display = jobs.length > 1 || (jobs.length && current === null) ? "inline" : "none";
  const names = [...picker.options].map((o) => o.value);
  if (names.join("\n") !== ["", ...jobs].join("\n")) {
    picker.replaceChildren(...["", ...jobs].map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name || "pick a job";
      return option;
    }));
  }
  picker.value = current || "";
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

// One colour per event kind, derived from its name: any kind, known or new, gets one.
function kindColour(kind) {
  let hash = 0;
  for (const c of kind) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${hash % 360}, 70%, 40%)`;
}

// Frequent routine events: a small tick at the foot of the plot each, not a line across it.
const TICK_KINDS = new Set(["checkpoint_written"]);

// Vertical lines at the membership changes and faults, as DOM elements over the plot: the kind
// on hover, and data-event-kind (data-world-size) for whoever reads the page. Checkpoint writes
// are ticks (class "tick", data-step) so that a hundred of them do not hide the curves.
function drawMarkers(u) {
  u.over.querySelectorAll(".marker, .tick").forEach((m) => m.remove());
  const { min, max } = u.scales.x;
  for (const e of state.events) {
    if (min === null || e.time < min || e.time > max) continue;
    const m = document.createElement("div");
    m.style.left = `${u.valToPos(e.time, "x")}px`;
    m.style.color = kindColour(e.kind);
    if (TICK_KINDS.has(e.kind)) {
      m.className = "tick";
      if (e.step !== undefined) m.dataset.step = e.step;
    } else {
      m.className = "marker";
      m.dataset.eventKind = e.kind;
      if (e.world_size !== undefined) m.dataset.worldSize = e.world_size;
    }
    m.title = `${clock(e.time)} ${e.kind} ${e.node || "-"}${e.text ? ": " + e.text : ""}`;
    u.over.appendChild(m);
  }
}

function chart(target, series, axes, scales = {}) {
  const opts = {
    width: 600, height: 260,
    scales: { x: { time: true }, ...scales },
    legend: { live: false },
    series: [{}, ...series],
    axes: [{}, ...axes],
    hooks: { draw: [drawMarkers] },
  };
  return new uPlot(opts, [[], ...series.map(() => [])], $(target));
}

const worldChart = chart("world-chart", [
  { label: "steps/s", scale: "rate", stroke: "#1f77b4", width: 2, spanGaps: false },
  { label: "world size", scale: "world", stroke: "#d62728", width: 2, spanGaps: true,
    paths: uPlot.paths.stepped({ align: 1 }) },
], [{ scale: "rate", label: "steps/s" }, { scale: "world", label: "world size", side: 1, grid: { show: false } }],
{ rate: { range: (u, min, max) => [0, Math.max(1, max) * 1.1] },
  world: { range: (u, min, max) => [0, Math.max(1, max) + 1] } });

const lossChart = chart("loss-chart", [
  { label: "loss", scale: "loss", stroke: "#2ca02c", width: 2, spanGaps: true },
], [{ scale: "loss", label: "loss (log)" }], { loss: { distr: 3 } });

function drawCharts(job) {
  const s = job.samples, w = job.world;
  // The world size holds until now: extend its last step to the right edge.
  const worldT = w.time.concat(w.time.length ? [job.now] : []);
  const worldV = w.world_size.concat(w.time.length ? [job.world_size ?? w.world_size.at(-1)] : []);
  const first = Math.min(s.time[0] ?? job.now, worldT[0] ?? job.now);
  const range = { min: first, max: Math.max(job.now, first + 1) };
  worldChart.setData(uPlot.join([[s.time, s.steps_per_s], [worldT, worldV]]), false);
  worldChart.setScale("x", range);
  // A log scale (a loss falls by orders of magnitude): a loss of 0 or less has no place on it.
  lossChart.setData([s.time, s.loss.map((v) => (v > 0 ? v : null))], false);
  lossChart.setScale("x", range);
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    return tr;
  }));
}

function render(job) {
  $("job").textContent = job.job;
  $("round").textContent = fmt(job.round);
  $("world-size").textContent = fmt(job.world_size);
  $("live-nodes").textContent = fmt(job.live_nodes);
  // Hot spares waiting warm, against the --spares N the job asks for; SHORT while fewer wait.
  const sp = job.spares;
  $("spares").textContent = sp.expected ? `${sp.waiting.length} of ${sp.expected}` : String(sp.waiting.length);
  $("spares-short").textContent = sp.short > 0 ? `${sp.short} SHORT` : "";
  const p = job.progress || {};
  $("step").textContent = fmt(p.step);
  $("loss").textContent = fmt(p.loss);
  $("progress-age").textContent = job.progress_age === null ? "-" : `${job.progress_age.toFixed(1)} s ago`;
  const c = job.checkpoint;
  $("checkpoint").textContent = c ? `step ${fmt(c.step)}, ${c.age.toFixed(1)} s ago` : "-";
  $("recoveries").textContent = job.totals.recoveries;
  $("recovery-seconds").textContent = `${job.totals.recovery_seconds.toFixed(1)} s`;
  $("restarts-spent").textContent = job.totals.restarts_spent;

  fillRows(document.querySelector("#nodes tbody"), job.nodes.map((n) => [
    [n.id], [fmt(n.host)], [fmt(n.addr)], [n.state, n.state === "spare" ? "spare" : ""], [fmt(n.rank)], [fmt(n.gpus)], [fmt(n.restarts)],
    [n.heartbeat_age === null ? "-" : `${n.heartbeat_age.toFixed(0)} s ago`],
    n.straggler === null || n.straggler === undefined ? ["-"]
      : [`${n.straggler.toFixed(2)}x slower`, "straggler"],
  ]));
  fillRows(document.querySelector("#events tbody"), job.events.slice(0, EVENTS_LISTED).map((e) => [
    [clock(e.time)], [e.kind, "kind"], [e.node || "-"], [e.text],
  ]));
  state = job;
  drawCharts(job);
}

async function poll() {
  try {
    const query = CHOSEN === null ? "" : `?job=${encodeURIComponent(CHOSEN)}`;
    const response = await fetch(`api/job${query}`, { cache: "no-store" });
    const body = await response.json();
    fillPicker(body.jobs || [], response.ok ? body.job : null);
    if (!response.ok) throw new Error(body.error || response.statusText);
    render(body);
    $("error").style.display = "none";
  } catch (err) {
    $("error").textContent = `Cannot read the job: ${err.message}`;
    $("error").style.display = "block";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("job-picker").addEventListener("change", (event) => {
  if (event.target.value) window.location.search = `?job=${encodeURIComponent(event.target.value)}`;
});
poll();
