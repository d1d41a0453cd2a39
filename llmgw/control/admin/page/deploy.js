// The console's deploy view: add a deployment (model, source, profile with
// its engine and GPUs, replicas or autoscaling bounds), change, scale or
// delete one. Writes go to PUT/DELETE /api/v1/deployments/MODEL, which
// validate as the catalog file does and answer with its message; what the
// fleet then does (fetching, placing, ready) is read from the watch
// stream's state that page.js keeps (window.llmgwPage.state).
"use strict";

(() => {
  const con = window.llmgwConsole;
  const $ = (id) => document.getElementById(id);
  const esc = (v) => String(v === null || v === undefined ? "" : v).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  // Fields the form writes; the rest of an entry is kept as it was.
  const AUTOSCALE = ["min_replicas", "max_replicas", "target_in_flight", "target_waiting",
    "scale_to_zero_after_s", "stabilization_s"];
  let catalog = { profiles: [], deployments: {} };
  let editing = null;

  const section = $("deploy");
  section.innerHTML =
    '<h2>Deploy</h2>' +
    '<form id="deploy-form" class="deploy-form" autocomplete="off">' +
    '<label>Model <input id="dep-model" required placeholder="name clients ask for"></label>' +
    '<label>Source <input id="dep-source" placeholder="hf://ORG/REPO[@REV], https://…, file:///…"></label>' +
    '<label>File <input id="dep-file" placeholder="NAME.gguf (llama.cpp, hf source)"></label>' +
    '<label>Profile (engine, GPUs) <select id="dep-profile" required></select></label>' +
    '<fieldset class="dep-scale"><legend>Replicas</legend>' +
    '<label><input type="radio" name="dep-mode" id="dep-fixed" value="fixed" checked> fixed ' +
    '<input id="dep-replicas" type="number" min="0" value="1" class="num"></label>' +
    '<label><input type="radio" name="dep-mode" id="dep-auto" value="auto"> autoscale from ' +
    '<input id="dep-min" type="number" min="0" value="0" class="num"> to ' +
    '<input id="dep-max" type="number" min="1" value="2" class="num"></label></fieldset>' +
    '<button type="submit" id="dep-submit">Deploy</button> ' +
    '<button type="button" id="dep-new" hidden>New deployment</button>' +
    '<p id="deploy-status" class="deploy-status" role="status"></p></form>' +
    '<div id="deploy-list" class="grid deploy-list"></div>';

  function say(text, bad) {
    const p = $("deploy-status");
    p.textContent = text; p.className = "deploy-status" + (bad ? " bad" : "");
  }

  function loadCatalog() {
    return con.call("GET", "/api/v1/catalog").then((c) => {
      catalog = c;
      const sel = $("dep-profile"), kept = sel.value;
      sel.innerHTML = c.profiles.map((p) => '<option value="' + esc(p.name) + '">' + esc(p.name) + " (" +
        esc(p.engine) + ", " + esc(p.shards * p.gpus_per_shard) + " GPU" + (p.shards * p.gpus_per_shard === 1 ? "" : "s") +
        (p.gpu_memory_mb ? " of " + esc(p.gpu_memory_mb) + " MB" : "") + (p.needs_source ? ", needs a source" : "") +
        ")</option>").join("");
      if (kept) sel.value = kept;
      renderList();
    }, (e) => say("the catalog could not be read: " + e.message, true));
  }

  // What the fleet does with a deployment now, from the watch stream.
  function progress(model) {
    const page = window.llmgwPage;
    if (!page) return "";
    const d = page.state.deployments.get(model);
    const parts = d ? ["ready " + d.ready + "/" + d.desired] : ["not placed yet"];
    for (const r of page.state.replicas.values()) {
      if (r.model !== model) continue;
      const fetch = (r.shards || []).map((s) => s.fetch).find(Boolean);
      const where = (r.shards || []).map((s) => s.node).join(",");
      parts.push(r.id + " " + r.state + (where ? " on " + where : "") +
        (fetch && fetch.total ? " " + Math.round((100 * fetch.done) / fetch.total) + "%" : ""));
    }
    return parts.join("; ");
  }

  function renderList() {
    const rows = ['<div class="head"><span>model</span><span>profile</span><span>replicas</span><span>fleet</span><span></span></div>'];
    for (const [model, e] of Object.entries(catalog.deployments)) {
      const auto = e.min_replicas !== undefined || e.max_replicas !== undefined;
      const scale = auto
        ? '<input class="num" type="number" min="0" data-min="' + esc(model) + '" value="' + esc(e.min_replicas ?? 0) + '">–' +
          '<input class="num" type="number" min="1" data-max="' + esc(model) + '" value="' + esc(e.max_replicas ?? 1) + '">'
        : '<input class="num" type="number" min="0" data-replicas="' + esc(model) + '" value="' + esc(e.replicas ?? 1) + '">';
      rows.push('<div data-model="' + esc(model) + '"><span>' + esc(model) + "</span><span>" + esc(e.profile || "") +
        "</span><span>" + scale + '<button type="button" data-dep="scale" data-model="' + esc(model) + '">scale</button></span>' +
        '<span class="dep-progress" data-progress="' + esc(model) + '">' + esc(progress(model)) + "</span>" +
        '<span><button type="button" data-dep="edit" data-model="' + esc(model) + '">change</button>' +
        '<button type="button" data-dep="delete" data-model="' + esc(model) + '">delete</button></span></div>');
    }
    $("deploy-list").innerHTML = rows.join("");
  }

  function fillForm(model) {
    const e = catalog.deployments[model] || {};
    editing = model;
    $("dep-model").value = model; $("dep-model").readOnly = true;
    $("dep-source").value = e.source || ""; $("dep-file").value = e.file || "";
    const first = e.variants && e.variants.length ? e.variants[0].profile : e.profile;
    if (first) $("dep-profile").value = first;
    const auto = e.min_replicas !== undefined || e.max_replicas !== undefined;
    $(auto ? "dep-auto" : "dep-fixed").checked = true;
    $("dep-replicas").value = e.replicas ?? 1;
    $("dep-min").value = e.min_replicas ?? 0; $("dep-max").value = e.max_replicas ?? 2;
    $("dep-submit").textContent = "Change " + model; $("dep-new").hidden = false;
    $("dep-model").focus();
  }

  function clearForm() {
    editing = null;
    $("deploy-form").reset(); $("dep-model").readOnly = false;
    $("dep-submit").textContent = "Deploy"; $("dep-new").hidden = true;
  }

  // The entry to PUT: the one in the catalog (when changing it) with what
  // the form says written over it.
  function entryFromForm(model) {
    const entry = Object.assign({}, catalog.deployments[model] || {});
    delete entry.model;
    for (const [field, id] of [["source", "dep-source"], ["file", "dep-file"]]) {
      const v = $(id).value.trim();
      if (v) entry[field] = v; else delete entry[field];
    }
    const profile = $("dep-profile").value;
    // A deployment with variants keeps them unless another profile is picked.
    if (!(entry.variants && entry.variants.length && entry.variants[0].profile === profile)) {
      delete entry.variants;
      entry.profile = profile;
    }
    if ($("dep-auto").checked) {
      delete entry.replicas;
      entry.min_replicas = parseInt($("dep-min").value, 10);
      entry.max_replicas = parseInt($("dep-max").value, 10);
    } else {
      for (const f of AUTOSCALE) delete entry[f];
      entry.replicas = parseInt($("dep-replicas").value, 10);
    }
    return entry;
  }

  const path = (model) => "/api/v1/deployments/" + encodeURIComponent(model);

  function changed(what) {
    return (r) => {
      const c = r.changes || {};
      const list = ["added", "changed", "removed"].filter((k) => c[k] && c[k].length).map((k) => k + " " + c[k].join(", "));
      say(what + (list.length ? ": " + list.join("; ") : "") + (r.stored ? " (stored in " + r.stored + ")" : ""));
      return loadCatalog();
    };
  }

  $("deploy-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const model = $("dep-model").value.trim();
    if (!model) { say("name the model", true); return; }
    say("saving " + model + "…");
    con.call("PUT", path(model), entryFromForm(model)).then(changed((editing ? "changed " : "deployed ") + model))
      .then(() => { if (!editing) clearForm(); }, (e) => say("refused: " + e.message, true));
  });
  $("dep-new").addEventListener("click", clearForm);

  $("deploy-list").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-dep]");
    if (!b) return;
    const model = b.dataset.model, act = b.dataset.dep;
    const q = (attr) => document.querySelector("#deploy-list input[data-" + attr + '="' + CSS.escape(model) + '"]');
    if (act === "edit") { fillForm(model); return; }
    if (act === "delete") {
      if (!window.confirm("Delete the deployment " + model + "? Its replicas stop.")) return;
      con.call("DELETE", path(model), {}).then(changed("deleted " + model), (e) => say("refused: " + e.message, true));
      if (editing === model) clearForm();
      return;
    }
    const body = q("replicas") ? { replicas: parseInt(q("replicas").value, 10) }
      : { min: parseInt(q("min").value, 10), max: parseInt(q("max").value, 10) };
    con.call("POST", path(model) + "/scale", body).then(() => say("scaled " + model),
      (e) => say("scale refused: " + e.message, true));
  });

  // The fleet column follows the watch stream; rows are few, text only.
  setInterval(() => {
    if (section.hidden) return;
    for (const span of document.querySelectorAll("#deploy-list [data-progress]")) {
      const text = progress(span.dataset.progress);
      if (span.textContent !== text) span.textContent = text;
    }
  }, 500);

  con.whenKnown(() => {
    section.hidden = !con.mayChange();
    if (!section.hidden) loadCatalog();
  });
})();
