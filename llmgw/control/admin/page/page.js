// The fleet page: the admin API's watch stream, rendered. No build step.
// State is kept in Maps keyed by id; a message marks what it touched, and
// a frame later only those rows are rebuilt, and only where they are shown:
// the nodes and replicas tables show one page of rows at a time, so the
// page's work does not grow with the fleet. Renders driven by the stream
// are at most every MIN_RENDER_MS; a person's action is drawn on the next
// frame. The stream's socket is in a worker (page/watch.js), which parses
// its frames off this thread. Commands (cordon, drain, scale) go over the
// same socket as requests the admin API answers with its own handlers.
"use strict";

const state = {
  nodes: new Map(), replicas: new Map(), deployments: new Map(), events: [],
  revision: null, epoch: null, role: null, name: null,
};
// node id -> Set of replica ids with a shard there
const nodeReplicas = new Map();
const dirty = { all: true, nodes: new Set(), replicas: new Set(), deployments: false, events: false };
const pending = new Map();
const stats = { renders: 0, lastRenderMs: 0, maxRenderMs: 0, messages: 0, received: 0, reconnects: 0 };
window.llmgwPage = { state, stats, redraw: () => { dirty.all = true; schedule(true); } };
let nextId = 1, scheduled = false, backoff = 500, lastRender = 0;
const MAX_EVENTS = 50;
// Rows a table shows at once.
const PAGE_ROWS = 50;
// Least milliseconds between two renders the stream asks for.
const MIN_RENDER_MS = 200;
// The socket is asked who we are every everyMs; with no answer within
// waitMs the connection is taken for dead (a silent network) and made again.
const heartbeatTimes = { everyMs: 15000, waitMs: 10000 };
window.llmgwPage.heartbeat = heartbeatTimes;
const $ = (id) => document.getElementById(id);
function esc(v) {
  return String(v === null || v === undefined ? "" : v).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
const domId = (prefix, id) => prefix + "-" + encodeURIComponent(id);
const isOperator = () => state.role === "operator" || state.role === "admin";
// A logged-in person's CSRF token (none for a certificate or on loopback),
// repeated on every write; the session itself is an HttpOnly cookie.
let csrf = null;

// -- the connection -----------------------------------------------------------------

// The socket lives in a worker (page/watch.js), which parses the stream's
// frames and hands over in batches what the page shows or needs (told by
// the tables, each time they show other rows): the figures of rows not
// shown stay in the worker until they are. 'link' is what the page knows of
// it: null (none), "connecting" or "open". From a close until the next
// open the page shows the fleet as it was, marked stale, with the time it
// was last known.
const watcher = new Worker("/page/watch.js");
let link = null, lostAt = null, retryAt = 0, retryTimer = null, heartbeat = null, heartbeatWait = null;

watcher.onmessage = (e) => {
  const m = e.data;
  if (m.op === "messages") {
    stats.received += m.received;
    for (const x of m.messages) handle(x);
    // The worker hands over fewer messages than it read: the newest
    // revision is what a resume starts from.
    if (typeof m.revision === "number") state.revision = m.revision;
  } else if (m.op === "open") opened();
  else if (m.op === "close") dropped();
};

function showConn() {
  const el = $("conn");
  if (link === "open") {
    el.textContent = "live"; el.className = "conn up";
  } else if (lostAt === null) {
    el.textContent = "connecting"; el.className = "conn down";
  } else {
    const wait = Math.max(0, Math.ceil((retryAt - Date.now()) / 1000));
    el.textContent = "disconnected" + (retryTimer !== null ? ", retrying in " + wait + " s" : ", connecting");
    el.className = "conn down";
  }
  const stale = lostAt !== null;
  document.body.classList.toggle("stale", stale);
  $("stale").hidden = !stale;
  $("reconnect").hidden = !stale || retryTimer === null;
  if (stale) $("stale-since").textContent = new Date(lostAt).toLocaleTimeString();
}

function connect() {
  if (retryTimer !== null) { clearTimeout(retryTimer); retryTimer = null; }
  let url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/api/v1/watch";
  if (state.revision !== null && state.epoch) {
    url += "?since=" + state.revision + "&epoch=" + encodeURIComponent(state.epoch);
  }
  link = "connecting";
  watcher.postMessage({ op: "open", url });
  showConn();
}

function opened() {
  link = "open"; backoff = 500; lostAt = null;
  showConn();
  if (!window.llmgwPage.live) {
    window.llmgwPage.live = true;
    document.dispatchEvent(new Event("llmgw:live"));
  }
  request("GET", "/api/v1/whoami").then((w) => {
    state.role = w.role; state.name = w.name;
    $("who").textContent = (w.name ? w.name + " " : "") + "(" + w.role + ")";
    dirty.all = true; schedule(true);
  }, () => {});
  beat();
}

// The socket is gone (closed, or silent past the heartbeat's wait): what
// was asked over it fails, and it is made again after a backoff. A session
// may have ended: with one, the page asks who it is first, which shows the
// login when it has.
function dropped() {
  if (link === null) return;
  watcher.postMessage({ op: "close" });
  link = null;
  clearTimeout(heartbeat); clearTimeout(heartbeatWait); heartbeat = heartbeatWait = null;
  if (lostAt === null) lostAt = Date.now();
  stats.reconnects++;
  for (const [, p] of pending) p.reject(new Error("the connection closed"));
  pending.clear();
  retryAt = Date.now() + backoff;
  retryTimer = setTimeout(reconnect, backoff);
  backoff = Math.min(backoff * 2, 30000);
  showConn();
}

function reconnect() {
  if (retryTimer !== null) { clearTimeout(retryTimer); retryTimer = null; }
  if (link !== null) return;
  if (csrf) start(); else connect();
}

function beat() {
  heartbeat = setTimeout(() => {
    heartbeatWait = setTimeout(dropped, heartbeatTimes.waitMs);
    const again = () => { clearTimeout(heartbeatWait); heartbeatWait = null; if (link === "open") beat(); };
    request("GET", "/api/v1/whoami").then(again, again);
  }, heartbeatTimes.everyMs);
}

setInterval(() => { if (lostAt !== null) showConn(); }, 1000);
window.addEventListener("online", reconnect);
$("reconnect").addEventListener("click", () => { backoff = 500; reconnect(); });

function request(method, path, body) {
  return new Promise((resolve, reject) => {
    if (link !== "open") { reject(new Error("not connected")); return; }
    const id = nextId++;
    pending.set(id, { resolve, reject });
    const m = { type: "request", id, method, path };
    if (csrf && method !== "GET") m.csrf = csrf;
    if (body !== undefined) m.body = body;
    watcher.postMessage({ op: "send", data: JSON.stringify(m) });
  });
}

function indexReplica(id, replica, add) {
  for (const s of (replica && replica.shards) || []) {
    let set = nodeReplicas.get(s.node);
    if (!set) { if (!add) continue; set = new Set(); nodeReplicas.set(s.node, set); }
    if (add) set.add(id); else set.delete(id);
    dirty.nodes.add(s.node);
  }
}

function setReplica(id, replica) {
  if (!!replica !== state.replicas.has(id)) tables.replicas.order = null;
  indexReplica(id, state.replicas.get(id), false);
  if (replica) { state.replicas.set(id, replica); indexReplica(id, replica, true); }
  else state.replicas.delete(id);
  dirty.replicas.add(id);
}

function handle(m) {
  stats.messages++;
  if (m.type === "response") {
    const p = pending.get(m.id);
    if (p) {
      pending.delete(m.id);
      if (m.status === 200) p.resolve(m.body);
      else p.reject(new Error((m.body && m.body.error) || ("HTTP " + m.status)));
    }
    return;
  }
  if (typeof m.revision === "number") state.revision = m.revision;
  switch (m.type) {
    case "snapshot":
      state.epoch = m.epoch;
      state.nodes = new Map((m.nodes || []).map((n) => [n.id, n]));
      state.deployments = new Map((m.deployments || []).map((d) => [d.model, d]));
      state.events = (m.events || []).slice(-MAX_EVENTS);
      state.replicas = new Map(); nodeReplicas.clear();
      for (const r of m.replicas || []) { state.replicas.set(r.id, r); indexReplica(r.id, r, true); }
      tables.nodes.order = tables.replicas.order = null;
      dirty.all = true;
      break;
    case "node":
      if (!m.removed !== state.nodes.has(m.id)) tables.nodes.order = null;
      if (m.removed) state.nodes.delete(m.id); else state.nodes.set(m.id, m.node);
      dirty.nodes.add(m.id);
      break;
    case "replica":
      setReplica(m.id, m.removed ? null : m.replica);
      break;
    case "deployment":
      if (m.removed) state.deployments.delete(m.id); else state.deployments.set(m.id, m.deployment);
      dirty.deployments = true;
      break;
    case "event":
      state.events.push(m.event);
      if (state.events.length > MAX_EVENTS) state.events.shift();
      dirty.events = true;
      break;
    default:
      break;
  }
  schedule();
}

// A render on the next frame; one the stream asks for (not 'now') waits
// until MIN_RENDER_MS after the last, so that a busy stream costs at most a
// few renders a second, each of what changed on the rows shown.
let throttle = null;
function schedule(now) {
  if (scheduled) {
    if (now && throttle !== null) { clearTimeout(throttle); throttle = null; requestAnimationFrame(render); }
    return;
  }
  scheduled = true;
  const wait = now ? 0 : lastRender + MIN_RENDER_MS - performance.now();
  if (wait <= 0) requestAnimationFrame(render);
  else throttle = setTimeout(() => { throttle = null; requestAnimationFrame(render); }, wait);
}

// -- rendering ---------------------------------------------------------------------

function shardsOn(nodeId) {
  // gpu index -> [{label, state}]
  const out = new Map();
  for (const rid of nodeReplicas.get(nodeId) || []) {
    const r = state.replicas.get(rid);
    if (!r) continue;
    for (const s of r.shards || []) {
      if (s.node !== nodeId) continue;
      for (const g of s.gpus || []) {
        if (!out.has(g)) out.set(g, []);
        out.get(g).push({ label: r.model + "/" + s.id, state: s.state });
      }
    }
  }
  return out;
}

const STATE_RANK = { failed: 5, stopped: 4, stopping: 3, draining: 3, fetching: 2, starting: 2, pending: 2, ready: 1 };

// A node row's five cells, as HTML: a render replaces only those that
// changed, so that a button stays the same element while its row's
// figures move (a click or the focus on it is not lost).
function nodeCells(n) {
  const placed = shardsOn(n.id);
  const gpus = (n.gpus || []).map((g) => {
    const shards = placed.get(g.index) || [];
    let cls = "s-free";
    if (g.problems && g.problems.length) cls = "s-problem";
    else if (shards.length) {
      const worst = shards.reduce((a, s) => ((STATE_RANK[s.state] || 0) > (STATE_RANK[a] || 0) ? s.state : a), "ready");
      cls = "s-" + worst;
    }
    const title = (g.name || "GPU") + " " + g.index + (g.problems && g.problems.length ? ": " + g.problems.join(", ") : "");
    return '<span class="gpu ' + esc(cls) + '" title="' + esc(title) + '">' + esc(g.index) + ' <span class="mem">' +
      esc(g.memory_used_mb) + "/" + esc(g.memory_total_mb) + " MB</span>" +
      shards.map((s) => '<br><span class="sh">' + esc(s.label) + "</span>").join("") + "</span>";
  }).join("");
  const flags = (n.cordoned ? '<span class="flag">cordoned</span>' : "") + (n.draining ? '<span class="flag">draining</span>' : "") +
    (n.connected === false ? '<span class="flag">disconnected</span>' : "") + certFlag(n.certificate_not_after);
  const actions = isOperator()
    ? (n.cordoned
      ? '<button data-act="uncordon" data-node="' + esc(n.id) + '" aria-label="uncordon ' + esc(n.id) + '">uncordon</button>'
      : '<button data-act="cordon" data-node="' + esc(n.id) + '" aria-label="cordon ' + esc(n.id) + '">cordon</button>') +
      '<button data-act="drain" data-node="' + esc(n.id) + '" aria-label="drain ' + esc(n.id) + '">drain</button>'
    : "";
  return ['<span class="nid">' + esc(n.id) + "</span>", '<span class="nstate">' + esc(n.state) + "</span>",
    "<span>" + flags + "</span>", '<span class="gpus">' + gpus + "</span>", '<span class="actions">' + actions + "</span>"];
}

// A node whose certificate ends within 7 days is flagged with the time left.
function certFlag(notAfter) {
  if (!notAfter) return "";
  const left = notAfter - Date.now() / 1000;
  if (left >= 7 * 86400) return "";
  const text = left <= 0 ? "certificate ended" : "certificate ends in " +
    (left >= 86400 ? (left / 86400).toFixed(1) + "d" : left >= 3600 ? Math.round(left / 3600) + "h" : Math.round(left) + "s");
  return '<span class="flag" title="it renews itself over its stream; without --signer: llmgw ctl csr approve">' + esc(text) + "</span>";
}

function nodeRow(n) {
  return makeRow(domId("node", n.id), "node n-" + (n.state || "unknown"), nodeCells(n));
}

function makeRow(id, cls, cells) {
  const div = document.createElement("div");
  div.id = id;
  div.className = cls;
  div.innerHTML = cells.join("");
  div.cells = cells;
  return div;
}

// Draw 'row' again with 'cells', replacing only the cells that changed.
function patchRow(row, cls, cells) {
  if (row.className !== cls) row.className = cls;
  const old = row.cells || [];
  for (let i = 0; i < cells.length; i++) {
    if (cells[i] === old[i]) continue;
    const child = row.children[i];
    if (child) child.outerHTML = cells[i]; else row.insertAdjacentHTML("beforeend", cells[i]);
  }
  row.cells = cells;
}

// -- the paged tables: nodes and replicas ---------------------------------------------

// Each shows PAGE_ROWS rows of its entries sorted by id, those matching its
// filter (words that must all appear in an entry's text). 'order' is the
// sorted ids (null when an entry came or went), 'shown' the ids drawn.
const tables = {
  nodes: {
    box: "nodes", kind: "node", map: () => state.nodes, row: nodeRow, prefix: "node",
    patch: (el, n) => patchRow(el, "node n-" + (n.state || "unknown"), nodeCells(n)), order: null, matched: null,
    page: 0, filter: [], shown: [],
    head: '<div class="node head"><span>node</span><span>state</span><span></span><span>GPUs: memory used, shards</span><span></span></div>',
    text: (n) => [n.id, n.state, n.cordoned ? "cordoned" : "", n.draining ? "draining" : "",
      n.connected === false ? "disconnected" : "", ...[...(nodeReplicas.get(n.id) || [])]].join(" "),
  },
  replicas: {
    box: "replicas", kind: "replica", map: () => state.replicas, row: replicaRow, prefix: "rep",
    patch: (el, r) => patchRow(el, "", replicaCells(r)), order: null, matched: null,
    page: 0, filter: [], shown: [],
    head: '<div class="head"><span>replica</span><span>model</span><span>state</span><span>shards (node:GPUs state)</span><span>engine signals</span></div>',
    text: (r) => [r.id, r.model, r.state, r.draining ? "draining" : "", ...(r.shards || []).map((x) => x.node)].join(" "),
  },
};

function replicaRow(r) {
  return makeRow(domId("rep", r.id), "", replicaCells(r));
}

// What identifies the control that has the focus inside 'box', to give
// it back once its row is drawn again; null when the focus is elsewhere.
function focusKey(box) {
  const f = document.activeElement;
  if (!f || f === document.body || !box.contains(f)) return null;
  const d = f.dataset || {};
  return { sel: f.tagName.toLowerCase() + (d.act ? '[data-act="' + CSS.escape(d.act) + '"]' : "") +
    (d.node ? '[data-node="' + CSS.escape(d.node) + '"]' : "") + (d.model ? '[data-model="' + CSS.escape(d.model) + '"]' : ""),
    start: f.selectionStart, end: f.selectionEnd };
}

function refocus(box, key) {
  if (!key) return;
  const el = box.querySelector(key.sel);
  if (!el) return;
  el.focus({ preventScroll: true });
  if (key.start !== null && key.start !== undefined && el.setSelectionRange) {
    try { el.setSelectionRange(key.start, key.end); } catch (e) { /* not a text input */ }
  }
}

function renderTable(t, changed) {
  const box = $(t.box);
  const map = t.map();
  let rebuild = changed === null || t.relayout;
  t.relayout = false;
  if (t.order === null) { t.order = [...map.keys()].sort(); t.matched = null; rebuild = true; }
  let list = t.order;
  if (t.filter.length) {
    if (t.matched === null || rebuild || (changed && changed.size)) {
      t.matched = t.order.filter((id) => {
        const text = t.text(map.get(id)).toLowerCase();
        return t.filter.every((w) => text.includes(w));
      });
    }
    list = t.matched;
  }
  const pages = Math.max(1, Math.ceil(list.length / PAGE_ROWS));
  t.page = Math.min(Math.max(t.page, 0), pages - 1);
  const first = t.page * PAGE_ROWS;
  const ids = list.slice(first, first + PAGE_ROWS);
  const key = focusKey(box);
  if (rebuild || ids.length !== t.shown.length || ids.some((id, i) => id !== t.shown[i])) {
    const frag = document.createDocumentFragment();
    const head = document.createElement("template");
    head.innerHTML = t.head;
    frag.appendChild(head.content);
    for (const id of ids) frag.appendChild(t.row(map.get(id)));
    box.replaceChildren(frag);
    t.shown = ids;
    t.shownSet = new Set(ids);
    watcher.postMessage({ op: "show", kind: t.kind, ids });
  } else {
    for (const id of changed) {
      if (!t.shownSet.has(id)) continue;
      const old = document.getElementById(domId(t.prefix, id));
      const item = map.get(id);
      if (old && item) t.patch(old, item);
    }
  }
  refocus(box, key);
  const pager = document.querySelector('.pager[data-table="' + t.box + '"]');
  if (pager) {
    pager.querySelector(".range").textContent = list.length
      ? (first + 1) + "\u2013" + (first + ids.length) + " of " + list.length + (t.filter.length ? " matching" : "")
      : (t.filter.length ? "none matching" : "none");
    pager.querySelector('[data-page="first"]').disabled = pager.querySelector('[data-page="prev"]').disabled = t.page === 0;
    pager.querySelector('[data-page="last"]').disabled = pager.querySelector('[data-page="next"]').disabled = t.page >= pages - 1;
  }
}

function renderDeployments() {
  const rows = ['<div class="head"><span>model</span><span>profile</span><span>desired</span><span>ready</span><span>replicas</span><span></span></div>'];
  for (const model of [...state.deployments.keys()].sort()) {
    const d = state.deployments.get(model);
    const scale = isOperator()
      ? '<input class="scale" type="number" min="0" value="' + esc(drafts.has(model) ? drafts.get(model) : d.desired) +
        '" data-model="' + esc(model) + '" aria-label="replicas of ' + esc(model) +
        '"><button data-act="scale" data-model="' + esc(model) + '">scale</button>'
      : "";
    const bad = d.last_failure ? ' <span class="flag" title="' + esc(JSON.stringify(d.last_failure)) + '">failing</span>' : "";
    // A rollout not yet done shows as "rollout STATE N/M" beside the profile.
    const ro = d.rollout && d.rollout.state !== "done"
      ? ' <span class="flag" title="' + esc(d.rollout.old_version + " -> " + d.rollout.new_version +
        (d.rollout.reason ? ": " + d.rollout.reason : "")) + '">rollout ' + esc(d.rollout.state) + " " +
        esc(d.rollout.updated) + "/" + esc(d.rollout.total) + "</span>"
      : "";
    rows.push('<div id="' + esc(domId("dep", model)) + '"><span>' + esc(model) + bad + "</span><span>" + esc(d.profile) + ro +
      '</span><span class="desired">' + esc(d.desired) + '</span><span class="ready">' + esc(d.ready) + "</span><span>" +
      esc(d.replicas !== undefined ? d.replicas : "") + "</span><span>" + scale + "</span></div>");
  }
  const box = $("deployments");
  const key = focusKey(box);
  box.innerHTML = rows.join("");
  refocus(box, key);
}

// Replica counts typed but not yet sent, by model: a render keeps them.
const drafts = new Map();
document.addEventListener("input", (e) => {
  if (e.target.matches("input.scale")) drafts.set(e.target.dataset.model, e.target.value);
});

function signalsText(shards) {
  for (const s of shards || []) {
    const g = s.signals;
    if (g && !g.error) {
      const parts = [];
      if (g.waiting !== undefined && g.waiting !== null) parts.push("waiting " + g.waiting);
      if (g.running !== undefined && g.running !== null) parts.push("running " + g.running);
      if (g.kv_cache_usage !== undefined && g.kv_cache_usage !== null) parts.push("KV " + Math.round(g.kv_cache_usage * 100) + "%");
      return parts.join(", ");
    }
  }
  return "";
}

function sizeText(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 || Math.abs(n) >= 10 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

// A fetching shard's progress: "41% 1.2 GiB/2.9 GiB 85 MiB/s".
function fetchText(f) {
  if (!f) return "";
  const parts = [];
  if (f.total) parts.push(Math.round((100 * f.done) / f.total) + "%", sizeText(f.done) + "/" + sizeText(f.total));
  else parts.push(sizeText(f.done || 0));
  if (f.rate) parts.push(sizeText(f.rate) + "/s");
  return parts.join(" ");
}

function replicaCells(r) {
  const shards = (r.shards || []).map((s) => s.node + ":" + (s.gpus || []).join(",") + " " + s.state +
    (s.fetch ? " " + fetchText(s.fetch) : "")).join("; ");
  const adapters = (r.adapters || []).length ? " + " + r.adapters.join(", ") : "";
  return ["<span>" + esc(r.id) + "</span>", "<span>" + esc(r.model + adapters) + "</span>", '<span class="rstate s-' + esc(r.state) + '">' +
    esc(r.state) + (r.draining ? " (draining)" : "") + (r.sleeping ? " (asleep)" : "") + "</span>", "<span>" + esc(shards) + "</span>",
    "<span>" + esc(signalsText(r.shards)) + "</span>"];
}

function renderEvents() {
  $("events").innerHTML = state.events.slice().reverse().map((e) => {
    const when = new Date((e.time || 0) * 1000).toLocaleTimeString();
    const where = [e.node, e.replica, e.shard].filter(Boolean).join(" ");
    return "<div>" + esc([when, e.kind, where].filter(Boolean).join(" ") + ": " + (e.reason || "")) + "</div>";
  }).join("");
}

function render() {
  scheduled = false;
  const t0 = lastRender = performance.now();
  if (dirty.all) {
    renderTable(tables.nodes, null); renderTable(tables.replicas, null); renderDeployments(); renderEvents();
  } else {
    if (dirty.nodes.size || tables.nodes.relayout) renderTable(tables.nodes, dirty.nodes);
    if (dirty.replicas.size || tables.replicas.relayout) renderTable(tables.replicas, dirty.replicas);
    if (dirty.deployments) renderDeployments();
    if (dirty.events) renderEvents();
  }
  dirty.all = false; dirty.nodes = new Set(); dirty.replicas = new Set(); dirty.deployments = false; dirty.events = false;
  $("rev").textContent = "revision " + state.revision;
  $("node-count").textContent = "(" + state.nodes.size + ")";
  $("replica-count").textContent = "(" + state.replicas.size + ")";
  stats.renders++;
  stats.lastRenderMs = performance.now() - t0;
  stats.maxRenderMs = Math.max(stats.maxRenderMs, stats.lastRenderMs);
}

// -- paging and filtering --------------------------------------------------------------

document.addEventListener("click", (e) => {
  const b = e.target.closest(".pager button[data-page]");
  if (!b) return;
  const t = tables[b.closest(".pager").dataset.table];
  const step = { first: -Infinity, prev: -1, next: 1, last: Infinity }[b.dataset.page];
  t.page = Number.isFinite(step) ? t.page + step : (step < 0 ? 0 : Number.MAX_SAFE_INTEGER);
  t.relayout = true;
  schedule(true);
});

document.addEventListener("input", (e) => {
  const box = e.target.closest("input[data-filter]");
  if (!box) return;
  const t = tables[box.dataset.filter];
  t.filter = box.value.toLowerCase().split(/\s+/).filter(Boolean);
  t.matched = null; t.page = 0; t.relayout = true;
  schedule(true);
});

// -- commands ------------------------------------------------------------------------

document.addEventListener("click", (e) => {
  const b = e.target.closest("button[data-act]");
  if (!b || !isOperator()) return;
  const act = b.dataset.act;
  const what = act + " " + (b.dataset.node || b.dataset.model || "");
  $("notice").textContent = what + ": sent";
  let done;
  if (act === "scale") {
    const input = document.querySelector('input.scale[data-model="' + CSS.escape(b.dataset.model) + '"]');
    done = request("POST", "/api/v1/deployments/" + encodeURIComponent(b.dataset.model) + "/scale",
      { replicas: parseInt(input.value, 10) });
  } else {
    done = request("POST", "/api/v1/nodes/" + encodeURIComponent(b.dataset.node) + "/" + act);
  }
  done.then(() => {
    $("notice").textContent = act + " done";
    if (act === "scale") drafts.delete(b.dataset.model);
  }, (err) => { $("notice").textContent = what + " refused: " + err.message; });
});

// -- login ---------------------------------------------------------------------------

function showLogin(message) {
  lostAt = null; showConn();
  $("login").hidden = false; $("logout").hidden = true;
  document.querySelector("main").hidden = true;
  $("login-error").textContent = message || "";
  $("login-user").focus();
}

function start() {
  // Over HTTP first: without a certificate or a session whoami names no
  // one, and the page asks for a login instead of opening the stream.
  fetch("/api/v1/whoami", { credentials: "same-origin" }).then((r) => {
    if (r.status === 401) { showLogin(); return null; }
    return r.json();
  }).then((w) => {
    if (!w) return;
    // Logins on and nobody logged in: whoami says so with a 200.
    if (w.login && !w.role) { showLogin(); return; }
    csrf = w.csrf || null;
    $("logout").hidden = !w.session;
    connect();
  }, () => setTimeout(start, 2000));
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  fetch("/api/v1/login", {
    method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ user: $("login-user").value, password: $("login-password").value }),
  }).then((r) => r.json().then((body) => {
    $("login-password").value = "";
    if (r.status !== 200) { showLogin(body.error || ("HTTP " + r.status)); return; }
    $("login").hidden = true; document.querySelector("main").hidden = false;
    start();
  }), () => showLogin("the control plane did not answer"));
});

$("logout").addEventListener("click", () => {
  fetch("/api/v1/logout", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf || "" },
  }).finally(() => location.reload());
});

start();
