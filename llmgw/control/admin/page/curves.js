// The console's curves: GET /api/v1/series polled every 10 s (only what is
// new after the first answer), kept here for the last hour and drawn with
// uPlot (page/vendor/, shipped in the package: no CDN). One chart per
// figure; a chart is rebuilt only when its set of lines changes, else its
// data is replaced. Polling pauses while the page is hidden.
"use strict";

(() => {
  const POLL_MS = 10000;
  const STALE_MS = 35000;
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
    "#17becf", "#7f7f7f", "#bcbd22"];
  // Each chart: where its lines come from (family, metric) and how values read.
  const CHARTS = [
    { id: "rps", title: "Requests per second, by model", family: "models", metrics: ["requests_per_s"], fmt: (v) => v.toFixed(1) },
    { id: "ttfb", title: "Time to first byte, by model (p50, p99 dashed)", family: "models", metrics: ["ttfb_p50_s", "ttfb_p99_s"], fmt: secondsText },
    { id: "tps", title: "Output tokens per second, by model", family: "models", metrics: ["output_tokens_per_s"], fmt: (v) => v.toFixed(0) },
    { id: "queue", title: "Requests waiting in gateway queues, by model", family: "models", metrics: ["queue"], fmt: (v) => v.toFixed(0) },
    { id: "gpumem", title: "GPU memory used, busiest nodes (%)", family: "nodes", metrics: ["gpu_memory_used_pct"], fmt: (v) => v.toFixed(0) + "%" },
    { id: "fleetmem", title: "GPU memory of the fleet (GiB: used, in all)", family: "fleet", metrics: ["gpu_memory_used_gib", "gpu_memory_total_gib"], fmt: (v) => v.toFixed(0) },
    { id: "keyrps", title: "Requests per second, by API key", family: "keys", metrics: ["requests_per_s"], fmt: (v) => v.toFixed(1) },
    { id: "keytps", title: "Tokens per second (prompt and output), by API key", family: "keys", metrics: ["tokens_per_s"], fmt: (v) => v.toFixed(0) },
  ];
  // family -> name -> metric -> Map(t -> v); the fleet family has one name.
  const store = { models: new Map(), nodes: new Map(), keys: new Map(), fleet: new Map() };
  const charts = new Map();
  const curves = { polls: 0, failures: 0, lastOk: 0, keepS: 3600, newest: null, charts };
  window.llmgwCurves = curves;
  let timer = null, refetch = true, inFlight = false;

  function secondsText(v) {
    return v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";
  }

  function merge(family, byName, keepFrom) {
    const fam = store[family];
    for (const [name, metrics] of Object.entries(byName || {})) {
      let m = fam.get(name);
      if (!m) { m = new Map(); fam.set(name, m); }
      for (const [metric, points] of Object.entries(metrics)) {
        let pts = m.get(metric);
        if (!pts) { pts = new Map(); m.set(metric, pts); }
        for (const [t, v] of points) pts.set(t, v);
      }
    }
    for (const [name, m] of fam) {
      let any = false;
      for (const pts of m.values()) {
        for (const t of pts.keys()) { if (t < keepFrom) pts.delete(t); else break; }
        if (pts.size) any = true;
      }
      if (!any) fam.delete(name);
    }
  }

  // uPlot's columns: the times every line of the chart has a point at, and
  // one column per (name, metric), null where it has none.
  function columns(chart) {
    const fam = store[chart.family];
    const names = [...fam.keys()].sort();
    const lines = [];
    const times = new Set();
    for (const name of names) {
      for (const metric of chart.metrics) {
        const pts = fam.get(name).get(metric);
        if (!pts || !pts.size) continue;
        lines.push({ name, metric, pts });
        for (const t of pts.keys()) times.add(t);
      }
    }
    const xs = [...times].sort((a, b) => a - b);
    const data = [xs, ...lines.map((l) => xs.map((t) => (l.pts.has(t) ? l.pts.get(t) : null)))];
    return { lines, data };
  }

  function lineLabel(chart, line) {
    if (chart.family === "fleet") return line.metric === "gpu_memory_total_gib" ? "in all" : "used";
    return chart.metrics.length > 1 ? line.name + " " + line.metric.split("_")[1] : line.name;
  }

  function build(chart, box, lines, data) {
    const names = [...new Set(lines.map((l) => l.name))];
    const series = [{}].concat(lines.map((l) => {
      const colour = PALETTE[names.indexOf(l.name) % PALETTE.length];
      const second = chart.metrics.length > 1 && l.metric === chart.metrics[1];
      return { label: lineLabel(chart, l), stroke: colour, width: 1.5, dash: second ? [5, 4] : undefined,
        value: (u, v) => (v === null || v === undefined ? "-" : chart.fmt(v)) };
    }));
    const opts = {
      width: Math.max(box.clientWidth, 200), height: 170, series,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
      axes: [{}, { size: 64, values: (u, vals) => vals.map((v) => chart.fmt(v)) }],
      cursor: { drag: { x: false, y: false } },
    };
    box.replaceChildren();
    return new uPlot(opts, data, box);
  }

  function draw() {
    for (const chart of CHARTS) {
      const box = document.getElementById("curve-" + chart.id);
      if (!box) continue;
      const { lines, data } = columns(chart);
      const key = lines.map((l) => l.name + "\u0000" + l.metric).join("\u0001");
      const held = charts.get(chart.id);
      box.parentElement.classList.toggle("empty", lines.length === 0);
      if (!lines.length) {
        if (held) { held.plot.destroy(); charts.delete(chart.id); }
        continue;
      }
      if (held && held.key === key) held.plot.setData(data);
      else {
        if (held) held.plot.destroy();
        charts.set(chart.id, { key, plot: build(chart, box, lines, data), lines: lines.length });
      }
    }
  }

  function status() {
    const el = document.getElementById("curves-status");
    if (!el) return;
    if (!curves.lastOk) { el.textContent = curves.failures ? "unavailable" : "loading"; el.className = "stale"; return; }
    const age = Date.now() - curves.lastOk;
    el.textContent = age > STALE_MS ? "stale: last updated " + new Date(curves.lastOk).toLocaleTimeString()
      : "updated " + new Date(curves.lastOk).toLocaleTimeString();
    el.className = age > STALE_MS ? "stale" : "";
  }

  async function poll() {
    timer = null;
    if (document.hidden || inFlight) return;
    inFlight = true;
    const since = refetch || curves.newest === null ? 0 : curves.newest;
    try {
      const r = await fetch("/api/v1/series?since=" + since, { credentials: "same-origin", headers: { Accept: "application/json" } });
      const body = await r.json();
      if (!r.ok) throw new Error(body.error || "HTTP " + r.status);
      curves.polls++;
      curves.keepS = body.keep_s;
      if (refetch) for (const fam of Object.values(store)) fam.clear();
      const keepFrom = body.now - body.keep_s;
      // A node new among the busiest has no history here: all of it next time.
      refetch = Object.keys(body.nodes || {}).some((n) => !store.nodes.has(n)) && since !== 0;
      merge("models", body.models, keepFrom);
      merge("keys", body.keys, keepFrom);
      merge("nodes", body.nodes, keepFrom);
      merge("fleet", body.fleet ? { fleet: body.fleet } : {}, keepFrom);
      // The busiest nodes change: only those in the answer stay drawn.
      for (const n of [...store.nodes.keys()]) if (!(n in (body.nodes || {}))) store.nodes.delete(n);
      if (body.newest !== null) curves.newest = body.newest;
      curves.lastOk = Date.now();
      draw();
    } catch (err) {
      curves.failures++;
      curves.error = String(err && err.message ? err.message : err);
    }
    inFlight = false;
    status();
    schedule();
  }

  function schedule() {
    if (timer === null && !document.hidden) timer = setTimeout(poll, POLL_MS);
  }

  function resize() {
    for (const [id, held] of charts) {
      const box = document.getElementById("curve-" + id);
      if (box) held.plot.setSize({ width: Math.max(box.clientWidth, 200), height: 170 });
    }
  }

  function start() {
    const grid = document.getElementById("curves");
    if (!grid || typeof uPlot === "undefined") return;
    grid.replaceChildren(...CHARTS.map((c) => {
      const fig = document.createElement("figure");
      fig.className = "curve empty";
      const cap = document.createElement("figcaption");
      cap.textContent = c.title;
      const box = document.createElement("div");
      box.id = "curve-" + c.id;
      fig.append(cap, box);
      return fig;
    }));
    let pending = null;
    window.addEventListener("resize", () => {
      if (pending === null) pending = requestAnimationFrame(() => { pending = null; resize(); });
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && timer === null) poll();
    });
    setInterval(status, 5000);
    curves.poll = poll;
    // The first poll waits until the page is in (logged in where it must).
    if (window.llmgwPage && window.llmgwPage.live) poll();
    else document.addEventListener("llmgw:live", () => { if (!curves.polls && !inFlight) poll(); });
  }

  start();
})();
