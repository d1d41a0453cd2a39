// What the console's deploy and playground views share: who the person is
// (GET /api/v1/whoami, asked again until it names someone: before a login
// its role is null) and JSON calls over HTTP that carry the session's CSRF token.
"use strict";

window.llmgwConsole = (() => {
  const me = { role: null, name: null, csrf: null, known: false };
  const waiting = [];
  const mayChange = () => me.role === "operator" || me.role === "admin";

  function ask() {
    fetch("/api/v1/whoami", { credentials: "same-origin" }).then((r) => {
      if (r.status !== 200) throw new Error("HTTP " + r.status);
      return r.json();
    }).then((w) => {
      if (!w.role) throw new Error("not logged in yet");
      Object.assign(me, { role: w.role, name: w.name, csrf: w.csrf || null, known: true });
      for (const f of waiting.splice(0)) f(me);
    }).catch(() => setTimeout(ask, 2000));
  }

  // A JSON call; resolves to the body of a 2xx, rejects with the API's
  // own error message otherwise.
  function call(method, path, body) {
    const headers = { "Content-Type": "application/json" };
    if (me.csrf && method !== "GET") headers["X-CSRF-Token"] = me.csrf;
    return fetch(path, {
      method, credentials: "same-origin", headers,
      body: body === undefined || method === "GET" ? undefined : JSON.stringify(body),
    }).then((r) => r.json().catch(() => ({})).then((b) => {
      if (r.ok) return b;
      throw new Error(b.error && b.error.message ? b.error.message : (b.error || ("HTTP " + r.status)));
    }));
  }

  ask();
  return {
    me, call, mayChange,
    // Runs f(me) once the person is known.
    whenKnown: (f) => { if (me.known) f(me); else waiting.push(f); },
    headers: () => {
      const h = { "Content-Type": "application/json" };
      if (me.csrf) h["X-CSRF-Token"] = me.csrf;
      return h;
    },
  };
})();
