"""
The well-behaved client of L{bench.abuse}, in its own process so that no
attack shares its interpreter: open-loop streams of legitimate requests,
each at a fixed rate, each request timed from the moment it was due (so a
stalled server shows as latency, not as fewer requests).

Streams (C{sys.argv[1]} is a JSON config):

* C{chat}: C{POST /v1/chat/completions}, a small completion with a valid
  key, proxied to a fake model replica (C{chat_rate} a second);
* C{models}: C{GET /v1/models} with the key, answered by the gateway
  itself (C{models_rate} a second): with nothing upstream in its path, its
  latency is the gateway reactor's delay, the stall probe;
* C{admin} (when C{admin} is given): C{GET /api/v1/whoami} on the admin
  API over mutual TLS with a viewer certificate (C{admin_rate} a second):
  the admin side's stall probe.

Each stream has a few keep-alive connections (a worker thread each); a
connection the server closes is opened again. It prints C{ready}, runs
until its stdin says C{stop} (or closes), then prints one JSON document:
C{samples}, a list of C{[stream, due, done, status]} with
C{time.monotonic()} times (one clock for every process on the machine) and
the HTTP status or C{"error:NAME"}.
"""

from __future__ import annotations

import http.client
import json
import queue
import ssl
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Sample = tuple[str, float, float, int | str]


class Stream:
    """
    One open-loop stream: a scheduler thread that queues each due time and
    C{workers} threads that send the requests.
    """

    def __init__(
        self, name: str, rate: float, connect: Callable[[], http.client.HTTPConnection],
        method: str, path: str, body: bytes | None, headers: dict[str, str], workers: int,
        samples: list[Sample], stopping: threading.Event,
    ) -> None:
        self.name = name
        self.rate = rate
        self.connect = connect
        self.method, self.path, self.body, self.headers = method, path, body, headers
        self.samples = samples
        self.stopping = stopping
        self.due: queue.Queue[float | None] = queue.Queue()
        self.threads = [threading.Thread(target=self.schedule, daemon=True)]
        self.threads += [threading.Thread(target=self.work, daemon=True) for _ in range(workers)]
        self.workers = workers

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def schedule(self) -> None:
        interval = 1.0 / self.rate
        t = time.monotonic()
        while not self.stopping.is_set():
            wait = t - time.monotonic()
            if wait > 0:
                self.stopping.wait(wait)
                continue
            self.due.put(t)
            t += interval
        for _ in range(self.workers):
            self.due.put(None)

    def work(self) -> None:
        conn: http.client.HTTPConnection | None = None
        while True:
            due = self.due.get()
            if due is None:
                break
            status: int | str
            try:
                if conn is None:
                    conn = self.connect()
                conn.request(self.method, self.path, body=self.body, headers=self.headers)
                response = conn.getresponse()
                response.read()
                status = response.status
                if response.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                status = f"error:{type(e).__name__}"
                if conn is not None:
                    conn.close()
                conn = None
            self.samples.append((self.name, due, time.monotonic(), status))
        if conn is not None:
            conn.close()


def admin_context(files: dict[str, str]) -> ssl.SSLContext:
    """
    A client context that verifies the control plane's certificate against
    the bench CA and presents the viewer's admin certificate.
    """
    ctx = ssl.create_default_context(cafile=files["ca"])
    ctx.load_cert_chain(files["cert"], files["key"])
    return ctx


def streams(config: dict[str, Any], samples: list[Sample], stopping: threading.Event) -> list[Stream]:
    timeout = float(config.get("timeout", 10.0))
    port = int(config["gateway_port"])
    auth = {"Authorization": f"Bearer {config['key']}"}

    def gateway() -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    body = json.dumps({"model": config["model"], "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    out = [
        Stream("chat", float(config.get("chat_rate", 20)), gateway, "POST", "/v1/chat/completions", body,
               {**auth, "Content-Type": "application/json"}, 16, samples, stopping),
        Stream("models", float(config.get("models_rate", 20)), gateway, "GET", "/v1/models", None, auth,
               4, samples, stopping),
    ]
    admin = config.get("admin")
    if admin:
        ctx = admin_context(admin)
        admin_port = int(admin["port"])

        def admin_conn() -> http.client.HTTPConnection:
            return http.client.HTTPSConnection("127.0.0.1", admin_port, timeout=timeout, context=ctx)

        out.append(Stream("admin", float(config.get("admin_rate", 10)), admin_conn, "GET",
                          "/api/v1/whoami", None, {}, 8, samples, stopping))
    return out


def main() -> None:
    config = json.loads(sys.argv[1])
    samples: list[Sample] = []
    stopping = threading.Event()
    running = streams(config, samples, stopping)
    for s in running:
        s.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stopping.set()
    # Requests still out get their timeout to finish, then count as they are.
    deadline = time.monotonic() + float(config.get("timeout", 10.0)) + 2
    for s in running:
        for t in s.threads:
            t.join(max(0.0, deadline - time.monotonic()))
    print(json.dumps({"samples": list(samples)}), flush=True)


if __name__ == "__main__":
    main()
