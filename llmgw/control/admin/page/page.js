// The fleet page: the admin API's watch stream, rendered. No build step.
// State is kept in Maps keyed by id; a message marks what it touched, and
// one animation frame later only those rows are rebuilt, so 10,000 nodes
// stay responsive. Commands (cordon, drain, scale) go over the same
// socket as requests the admin API answers with its own handlers.
"use strict";

const state = {
  nodes: new Map(), replicas: new Map(), deployments: new Map(), events: [],
  revision: null, epoch: null, role: null, name: null,
};
// node id -> Set of replica ids with a shard there
const nodeReplicas = new Map();
const dirty = { all: true, nodes: new Set(), replicas: new Set(), deployments: false, events: false };
const pending = new Map();
const stats = { renders: 0, lastRenderMs: 0, messages: 0 };
window.llmgwPage = { state, stats, redraw: () => { dirty.all = true; schedule(); } };
let socket = null, nextId = 1, scheduled = false, backoff = 500;
const MAX_EVENTS = 50;

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

function connect() {
  let url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/api/v1/watch";
  if (state.revision !== null && state.epoch) {
    url += "?since=" + state.revision + "&epoch=" + encodeURIComponent(state.epoch);
  }
  socket = new WebSocket(url);
  socket.onopen = () => {
    backoff = 500;
    $("conn").textContent = "live"; $("conn").className = "conn up";
    request("GET", "/api/v1/whoami").then((w) => {
      state.role = w.role; state.name = w.name;
      $("who").textContent = (w.name ? w.name + " " : "") + "(" + w.role + ")";
      dirty.all = true; schedule();
    }, () => {});
  };
  socket.onmessage = (e) => handle(JSON.parse(e.data));
  socket.onclose = () => {
    $("conn").textContent = "reconnecting"; $("conn").className = "conn down";
    for (const [, p] of pending) p.reject(new Error("the connection closed"));
    pending.clear();
    // A session may have ended: ask again who we are, which shows the login.
    setTimeout(csrf ? start : connect, backoff);
    backoff = Math.min(backoff * 2, 30000);
  };
}

function request(method, path, body) {
  return new Promise((resolve, reject) => {
    const id = nextId++;
    pending.set(id, { resolve, reject });
    const m = { type: "request", id, method, path };
    if (csrf && method !== "GET") m.csrf = csrf;
    if (body !== undefined) m.body = body;
    socket.send(JSON.stringify(m));
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
      dirty.all = true;
      break;
    case "node":
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

function schedule() {
  if (!scheduled) { scheduled = true; requestAnimationFrame(render); }
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

function nodeHtml(n) {
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
      ? '<button data-act="uncordon" data-node="' + esc(n.id) + '">uncordon</button>'
      : '<button data-act="cordon" data-node="' + esc(n.id) + '">cordon</button>') +
      '<button data-act="drain" data-node="' + esc(n.id) + '">drain</button>'
    : "";
  return '<span class="nid">' + esc(n.id) + '</span><span class="nstate">' + esc(n.state) + "</span><span>" + flags +
    '</span><span class="gpus">' + gpus + '</span><span class="actions">' + actions + "</span>";
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
  const div = document.createElement("div");
  div.id = domId("node", n.id);
  div.className = "node n-" + (n.state || "unknown");
  div.innerHTML = nodeHtml(n);
  return div;
}

function renderNodes(ids) {
  const box = $("nodes");
  if (ids === null) {
    const frag = document.createDocumentFragment();
    const head = document.createElement("div");
    head.className = "node head";
    head.innerHTML = "<span>node</span><span>state</span><span></span><span>GPUs: memory used, shards</span><span></span>";
    frag.appendChild(head);
    for (const id of [...state.nodes.keys()].sort()) frag.appendChild(nodeRow(state.nodes.get(id)));
    box.replaceChildren(frag);
  } else {
    for (const id of ids) {
      const old = document.getElementById(domId("node", id));
      const n = state.nodes.get(id);
      if (!n) { if (old) old.remove(); continue; }
      const row = nodeRow(n);
      if (old) old.replaceWith(row);
      else box.appendChild(row); // new nodes go last until the next full render
    }
  }
  $("node-count").textContent = "(" + state.nodes.size + ")";
}

function renderDeployments() {
  const rows = ['<div class="head"><span>model</span><span>profile</span><span>desired</span><span>ready</span><span>replicas</span><span></span></div>'];
  for (const model of [...state.deployments.keys()].sort()) {
    const d = state.deployments.get(model);
    const scale = isOperator()
      ? '<input class="scale" type="number" min="0" value="' + esc(d.desired) + '" data-model="' + esc(model) +
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
  $("deployments").innerHTML = rows.join("");
}

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

function replicaHtml(r) {
  const shards = (r.shards || []).map((s) => s.node + ":" + (s.gpus || []).join(",") + " " + s.state +
    (s.fetch ? " " + fetchText(s.fetch) : "")).join("; ");
  return "<span>" + esc(r.id) + "</span><span>" + esc(r.model) + '</span><span class="rstate s-' + esc(r.state) + '">' +
    esc(r.state) + (r.draining ? " (draining)" : "") + (r.sleeping ? " (asleep)" : "") + "</span><span>" + esc(shards) + "</span><span>" + esc(signalsText(r.shards)) + "</span>";
}

function renderReplicas(ids) {
  const box = $("replicas");
  if (ids === null) {
    const rows = ['<div class="head"><span>replica</span><span>model</span><span>state</span><span>shards (node:GPUs state)</span><span>engine signals</span></div>'];
    for (const id of [...state.replicas.keys()].sort()) {
      rows.push('<div id="' + esc(domId("rep", id)) + '">' + replicaHtml(state.replicas.get(id)) + "</div>");
    }
    box.innerHTML = rows.join("");
    return;
  }
  for (const id of ids) {
    const old = document.getElementById(domId("rep", id));
    const r = state.replicas.get(id);
    if (!r) { if (old) old.remove(); continue; }
    if (old) old.innerHTML = replicaHtml(r);
    else {
      const div = document.createElement("div");
      div.id = domId("rep", id); div.innerHTML = replicaHtml(r); box.appendChild(div);
    }
  }
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
  const t0 = performance.now();
  if (dirty.all) {
    renderNodes(null); renderReplicas(null); renderDeployments(); renderEvents();
  } else {
    if (dirty.nodes.size) renderNodes(dirty.nodes);
    if (dirty.replicas.size) renderReplicas(dirty.replicas);
    if (dirty.deployments) renderDeployments();
    if (dirty.events) renderEvents();
  }
  dirty.all = false; dirty.nodes = new Set(); dirty.replicas = new Set(); dirty.deployments = false; dirty.events = false;
  $("rev").textContent = "revision " + state.revision;
  stats.renders++;
  stats.lastRenderMs = performance.now() - t0;
}

// -- commands ------------------------------------------------------------------------

document.addEventListener("click", (e) => {
  const b = e.target.closest("button[data-act]");
  if (!b || !isOperator()) return;
  const act = b.dataset.act;
  let done;
  if (act === "scale") {
    const input = document.querySelector('input.scale[data-model="' + CSS.escape(b.dataset.model) + '"]');
    done = request("POST", "/api/v1/deployments/" + encodeURIComponent(b.dataset.model) + "/scale",
      { replicas: parseInt(input.value, 10) });
  } else {
    done = request("POST", "/api/v1/nodes/" + encodeURIComponent(b.dataset.node) + "/" + act);
  }
  done.then(() => { $("notice").textContent = act + " done"; },
    (err) => { $("notice").textContent = act + " refused: " + err.message; });
});

// -- login ---------------------------------------------------------------------------

function showLogin(message) {
  $("login").hidden = false; $("logout").hidden = true;
  document.querySelector("main").hidden = true;
  $("login-error").textContent = message || "";
  $("login-user").focus();
}

function start() {
  // Over HTTP first: without a certificate or a session the API says 401,
  // and the page asks for a login instead of opening the stream.
  fetch("/api/v1/whoami", { credentials: "same-origin" }).then((r) => {
    if (r.status === 401) { showLogin(); return null; }
    return r.json();
  }).then((w) => {
    if (!w) return;
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
