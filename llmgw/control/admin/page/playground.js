// The console's playground: chat with a ready model through the gateway,
// streamed. POST /api/v1/playground/chat sends the chat on with an API key
// the person's role was given (its secret stays in the control plane) and
// streams the gateway's answer back; the replica that answered comes in
// x-llmgw-replica, and time to first token and tokens per second are
// measured here, from the request to the first and last text.
"use strict";

(() => {
  const con = window.llmgwConsole;
  const $ = (id) => document.getElementById(id);
  const section = $("playground");
  const history = [];
  let busy = null;
  const stats = { chats: 0, lastReplica: null, lastTtftMs: null, lastTokensPerS: null, text: "" };
  window.llmgwPlayground = stats;

  section.innerHTML =
    '<h2>Playground</h2>' +
    '<form id="pg-form" class="pg-form" autocomplete="off">' +
    '<label>Model <select id="pg-model" required></select></label>' +
    '<label id="pg-key-label" hidden>API key <select id="pg-key"></select></label>' +
    '<label>Max tokens <input id="pg-max" class="num" type="number" min="1" max="8192" value="256"></label>' +
    '<button type="button" id="pg-clear">Clear</button>' +
    '<div id="pg-log" class="pg-log" aria-live="polite"></div>' +
    '<textarea id="pg-input" rows="3" placeholder="Say something (Ctrl+Enter sends)"></textarea>' +
    '<button type="submit" id="pg-send">Send</button> <button type="button" id="pg-stop" hidden>Stop</button>' +
    '<p id="pg-route" class="pg-route" role="status"></p></form>';

  let keysRequired = false;

  // Ready models, from the watch stream's state page.js keeps.
  function refreshModels() {
    const page = window.llmgwPage, sel = $("pg-model");
    if (!page) return;
    const ready = [...page.state.deployments.values()].filter((d) => d.ready > 0).map((d) => d.model).sort();
    const have = [...sel.options].map((o) => o.value);
    if (ready.join("\n") === have.join("\n")) return;
    const kept = sel.value;
    sel.replaceChildren(...ready.map((m) => { const o = document.createElement("option"); o.value = o.textContent = m; return o; }));
    if (ready.includes(kept)) sel.value = kept;
    $("pg-send").disabled = !ready.length || busy !== null;
  }

  function line(role, text) {
    const div = document.createElement("div");
    div.className = "pg-msg pg-" + role;
    const who = document.createElement("b");
    who.textContent = role === "user" ? "you" : role;
    const body = document.createElement("span");
    body.textContent = text;
    div.append(who, " ", body);
    $("pg-log").appendChild(div);
    $("pg-log").scrollTop = $("pg-log").scrollHeight;
    return body;
  }

  function route(text, bad) {
    $("pg-route").textContent = text; $("pg-route").className = "pg-route" + (bad ? " bad" : "");
  }

  // Reads an event stream's "data:" lines as they come; onData(obj) each.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const l = buf.slice(0, nl).replace(/\r$/, "");
        buf = buf.slice(nl + 1);
        if (!l.startsWith("data:")) continue;
        const data = l.slice(5).trim();
        if (data === "[DONE]") return;
        try { onData(JSON.parse(data)); } catch (e) { /* not JSON: skipped */ }
      }
    }
  }

  async function send(text) {
    const model = $("pg-model").value;
    if (!model) { route("no model is ready", true); return; }
    history.push({ role: "user", content: text });
    line("user", text);
    const out = line(model, "");
    const body = { model, messages: history.slice(), max_tokens: parseInt($("pg-max").value, 10) || 256 };
    if (keysRequired) body.key = $("pg-key").value;
    busy = new AbortController();
    $("pg-send").disabled = true; $("pg-stop").hidden = false;
    route("waiting for " + model + "…");
    const t0 = performance.now();
    let first = null, last = null, chunks = 0, usage = null, answer = "";
    try {
      const r = await fetch("/api/v1/playground/chat", {
        method: "POST", credentials: "same-origin", headers: con.headers(), body: JSON.stringify(body), signal: busy.signal,
      });
      const replica = r.headers.get("x-llmgw-replica");
      if (!r.ok) {
        const b = await r.json().catch(() => ({}));
        const msg = b.error && b.error.message ? b.error.message : (b.error || "HTTP " + r.status);
        history.pop();
        out.parentNode.remove();
        route("refused (" + r.status + "): " + msg + (r.headers.get("retry-after") ? "; retry after " + r.headers.get("retry-after") + " s" : ""), true);
        return;
      }
      await readEvents(r, (ev) => {
        if (ev.usage) usage = ev.usage;
        const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (delta && delta.content) {
          const now = performance.now();
          if (first === null) first = now;
          last = now; chunks++;
          answer += delta.content;
          out.textContent = answer;
          stats.text = answer;
          route("replica " + (replica || "?") + " · first token " + Math.round(first - t0) + " ms · streaming…");
        }
      });
      history.push({ role: "assistant", content: answer });
      const tokens = usage && usage.completion_tokens ? usage.completion_tokens : chunks;
      const secs = first !== null && last > first ? (last - first) / 1000 : null;
      const tps = secs ? (tokens - 1) / secs : null;
      Object.assign(stats, { chats: stats.chats + 1, lastReplica: replica, lastTtftMs: first === null ? null : first - t0,
        lastTokensPerS: tps });
      route("replica " + (replica || "?") + " · first token " + (first === null ? "–" : Math.round(first - t0) + " ms") +
        " · " + tokens + " tokens" + (tps ? " · " + tps.toFixed(1) + " tokens/s" : ""));
    } catch (e) {
      route(e.name === "AbortError" ? "stopped" : "failed: " + e.message, e.name !== "AbortError");
      if (answer) history.push({ role: "assistant", content: answer }); else history.pop();
    } finally {
      busy = null;
      $("pg-stop").hidden = true;
      refreshModels();
      $("pg-send").disabled = !$("pg-model").value;
    }
  }

  $("pg-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("pg-input").value.trim();
    if (!text || busy) return;
    $("pg-input").value = "";
    send(text);
  });
  $("pg-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); $("pg-form").requestSubmit(); }
  });
  $("pg-stop").addEventListener("click", () => { if (busy) busy.abort(); });
  $("pg-clear").addEventListener("click", () => { history.length = 0; $("pg-log").replaceChildren(); route(""); });

  con.whenKnown(() => {
    con.call("GET", "/api/v1/playground").then((p) => {
      keysRequired = p.keys_required;
      if (!p.gateway) { section.hidden = true; return; }
      const sel = $("pg-key");
      sel.replaceChildren(...p.keys.map((k) => { const o = document.createElement("option"); o.value = o.textContent = k; return o; }));
      $("pg-key-label").hidden = !keysRequired;
      if (keysRequired && !p.keys.length) {
        route("no API key is given to your role (the operator names roles in a key's console_roles)", true);
        $("pg-send").disabled = true;
      }
      section.hidden = false;
    }, () => { section.hidden = true; });
  });
  setInterval(refreshModels, 1000);
  refreshModels();
})();
