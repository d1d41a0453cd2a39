// The watch stream's socket, in a worker: the frames arrive and are parsed
// here, off the page's main thread. At a thousand nodes the stream sends
// thousands of frames a second, mostly new figures (GPU memory, engine
// signals) of rows the page does not show; handing each over would keep
// the page's thread busy with them alone. So the worker keeps the latest
// view of every node and replica and hands the page, in batches (of CHUNK
// at most) every FLUSH_MS, where one changed twice keeps only its last:
//   - every change of a node or replica the page shows (it says which);
//   - of the others, only a change to what the page needs of a row it
//     does not show: its state, flags and placement (the table's order,
//     its filter, the GPU cells of the nodes shown), not its figures;
//   - every deployment, event, snapshot and answer;
// and when the page shows other rows, their latest views at once.
//
// From the page: {op: "open", url}, {op: "send", data} (a text frame),
// {op: "close"}, {op: "show", kind: "node"|"replica", ids}. To the page:
// {op: "open"}, {op: "close", code}, {op: "messages", messages, received,
// revision} (received: frames since the last; revision: the newest seen).
"use strict";

const FLUSH_MS = 100;
// Messages handed over at once at most: each handing over is one task of
// the page's, and a short one leaves room for a click between two.
const CHUNK = 200;
let socket = null, queue = [], latest = new Map(), timer = null, received = 0, revision = null;
// kind -> id -> latest view; kind -> ids the page shows; kind -> id -> the
// summary of the view the page holds.
const views = { node: new Map(), replica: new Map() };
const shown = { node: new Set(), replica: new Set() };
const held = { node: new Map(), replica: new Map() };

function summary(kind, v) {
  if (kind === "node") return JSON.stringify([v.state, v.cordoned, v.draining, v.connected, v.certificate_not_after]);
  // A fetch's whole percent counts as state: the deploy view shows it for
  // rows the tables may not, and only fetching replicas have one.
  return JSON.stringify([v.model, v.state, v.draining, v.sleeping, v.adapters, (v.shards || []).map((s) =>
    [s.id, s.node, s.gpus, s.state, s.fetch && s.fetch.total ? Math.floor((100 * s.fetch.done) / s.fetch.total) : null])]);
}

function flush() {
  if (timer !== null) { clearTimeout(timer); timer = null; }
  if (!queue.length && !received) return;
  const messages = queue.filter((m) => m !== null);
  queue = []; latest = new Map();
  let i = 0;
  do {
    postMessage({ op: "messages", messages: messages.slice(i, i + CHUNK), received: i === 0 ? received : 0, revision });
    i += CHUNK;
  } while (i < messages.length);
  received = 0;
}

function later() {
  if (timer === null) timer = setTimeout(flush, FLUSH_MS);
}

function enqueue(m) {
  if (m.type === "node" || m.type === "replica" || m.type === "deployment") {
    const key = m.type + "\u0000" + m.id;
    const at = latest.get(key);
    if (at !== undefined) queue[at] = null;
    latest.set(key, queue.length);
  }
  queue.push(m);
}

function take(m) {
  received++;
  if (typeof m.revision === "number") revision = m.revision;
  switch (m.type) {
    case "response":
      // Answers go at once, after what came before them.
      queue.push(m); flush(); return;
    case "snapshot":
      // What was queued is replaced by the snapshot.
      queue = []; latest = new Map();
      for (const kind of ["node", "replica"]) {
        views[kind].clear(); held[kind].clear();
        for (const v of m[kind + "s"] || []) { views[kind].set(v.id, v); held[kind].set(v.id, summary(kind, v)); }
      }
      queue.push(m);
      break;
    case "node":
    case "replica": {
      const kind = m.type;
      if (m.removed) {
        views[kind].delete(m.id); held[kind].delete(m.id);
        enqueue(m);
        break;
      }
      const v = m[kind];
      views[kind].set(m.id, v);
      const s = summary(kind, v);
      if (shown[kind].has(m.id) || held[kind].get(m.id) !== s) { held[kind].set(m.id, s); enqueue(m); }
      break;
    }
    default:
      enqueue(m);
  }
  later();
}

function show(kind, ids) {
  const now = new Set(ids);
  for (const id of now) {
    const v = views[kind].get(id);
    if (!shown[kind].has(id) && v) { held[kind].set(id, summary(kind, v)); enqueue({ type: kind, id, [kind]: v }); }
  }
  shown[kind] = now;
  if (queue.length) flush();
}

function open(url) {
  const s = socket = new WebSocket(url);
  s.onopen = () => { if (s === socket) postMessage({ op: "open" }); };
  s.onmessage = (e) => {
    let m;
    try { m = JSON.parse(e.data); } catch (err) { return; }
    if (s === socket && m && typeof m === "object") take(m);
  };
  s.onclose = (e) => {
    if (s !== socket) return;
    flush();
    socket = null;
    postMessage({ op: "close", code: e.code });
  };
}

function drop() {
  queue = []; latest = new Map();
  if (timer !== null) { clearTimeout(timer); timer = null; }
}

onmessage = (e) => {
  const m = e.data;
  if (m.op === "open") {
    if (socket) { socket.onclose = null; socket.close(); }
    drop();
    open(m.url);
  } else if (m.op === "send") {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(m.data);
  } else if (m.op === "show") {
    show(m.kind, m.ids);
  } else if (m.op === "close") {
    if (socket) { const s = socket; socket = null; s.onclose = null; s.close(); }
    drop();
  }
};
