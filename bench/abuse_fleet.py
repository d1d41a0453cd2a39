"""
The processes L{bench.abuse} attacks, started as an operator starts them:

* C{twistd -n llmgw control}: the agent stream on mutual TLS, the admin API
  on mutual TLS (C{--admin-tls}, admin certificates), the embedded gateway
  with an API keys file, and a catalog of one deployment of C{replicas}
  fake model servers (L{llmgw.testing.fakemodel}) on simulated GPUs;
* C{twistd -n llmgw agent} with simulated GPUs, which runs those replicas;
* with C{standalone=True}, C{twistd -n llmgw gateway} following the control
  plane's routes over the admin API (a C{gateway} role certificate).

Certificates come from llmgw's own CA code at run time (L{make_certs}, once
a run); ports from L{llmgw.testing.ports}. Every process is started in its
own session and L{Fleet.stop} ends each one, then every shard the agent
started (found by its state directory): nothing is left behind.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw.testing.ports import free_port, port_block
from llmgw.testing.procs import processes_marked
from llmgw.tlsconf.ca import CertificateAuthority

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
API_KEY = "sk-bench-well-behaved-0123456789"
#: The admin certificate the well-behaved client and the admin attacks use.
VIEWER = "bench-viewer"
#: The standalone gateway's admin certificate.
GATEWAY_CERT = "bench-gateway"

CATALOG = """
[ports]
first = {first}
last = {last}

[profiles.fake]
shards = 1
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = ""
command = ["{{python}}", "-m", "llmgw.testing.fakemodel", "--port", "{{port}}", "--model", "{{model}}",
           "--host", "{{host}}", "--tokens", "4"]
env = {{ PYTHONPATH = "{root}" }}
health_path = "/health"
startup_timeout_s = 60
drain_timeout_s = 5
stop_grace_s = 2

[[deployments]]
model = "{model}"
profile = "fake"
replicas = {replicas}
"""


def make_certs(directory: Path) -> Path:
    """
    A CA in C{directory} with the control plane's certificate for
    127.0.0.1, node-1's agent certificate, a viewer's and a gateway's admin
    certificates; returns C{directory}.
    """
    ca = CertificateAuthority.init(directory)
    ca.issue_server(["127.0.0.1"])
    ca.issue_agent("node-1")
    ca.issue_admin(VIEWER, "viewer")
    ca.issue_admin(GATEWAY_CERT, "gateway")
    return directory


class _Holder:
    """
    What L{port_block} wants of a test case: somewhere to put the release
    of the block it holds.
    """

    def __init__(self) -> None:
        self.cleanups: list[Callable[[], None]] = []

    def addCleanup(self, f: Callable[..., Any], *args: Any) -> None:  # noqa: N802 (port_block's name)
        self.cleanups.append(lambda: f(*args))


def twistd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=", *args]


class Fleet:
    """
    One target: its processes, their ports and the files a client needs.
    """

    def __init__(self, work: Path, certs: Path, replicas: int = 2, standalone: bool = False) -> None:
        self.work = work
        self.certs = certs
        self.replicas = replicas
        self.standalone = standalone
        self.state = work / "state"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.holder = _Holder()
        self.agent_port = free_port()
        self.admin_port = free_port()
        self.gateway_port = free_port()
        self.standalone_port = free_port() if standalone else 0

    # -- what clients need ------------------------------------------------------------

    @property
    def target_pid(self) -> int:
        """
        The process under attack: the standalone gateway when there is
        one, else the control plane.
        """
        return self.procs["gateway" if self.standalone else "control"].pid

    @property
    def front_port(self) -> int:
        """
        The gateway port of the process under attack.
        """
        return self.standalone_port if self.standalone else self.gateway_port

    def admin_files(self) -> dict[str, str]:
        return {
            "ca": str(self.certs / "ca.pem"),
            "cert": str(self.certs / f"admin-{VIEWER}.pem"),
            "key": str(self.certs / f"admin-{VIEWER}.key"),
        }

    # -- life -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"{name}.out", "wb")  # noqa: SIM115 (the child's for its life)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.work,
            env=env, start_new_session=True,
        )
        log.close()

    def start(self, timeout: float = 120.0) -> dict[str, Any]:
        """
        Start every process and wait until a chat completion through the
        gateway under attack answers 200; returns how long that took.
        """
        t0 = time.monotonic()
        self.work.mkdir(parents=True, exist_ok=True)
        first, last = port_block(self.holder, 20)
        (self.work / "catalog.toml").write_text(CATALOG.format(
            first=first, last=last, root=ROOT, model=MODEL, replicas=self.replicas))
        (self.work / "keys.toml").write_text(f'[keys]\nbench = "{API_KEY}"\n')
        os.chmod(self.work / "keys.toml", 0o600)
        self._spawn("control", twistd(
            "--logfile", str(self.work / "control.log"), "llmgw", "control",
            "--certs", str(self.certs), "--agent-listen", f"127.0.0.1:{self.agent_port}",
            "--admin", f"127.0.0.1:{self.admin_port}", "--admin-tls",
            "--gateway", f"127.0.0.1:{self.gateway_port}", "--api-keys", str(self.work / "keys.toml"),
            "--catalog", str(self.work / "catalog.toml"), "--adoption-grace", "0", "--heartbeat", "1",
            # More options for the control plane, to compare settings in one run.
            *os.environ.get("LLMGW_ABUSE_CONTROL_ARGS", "").split(),
        ))
        self._wait_port(self.agent_port, "control", timeout)
        self._spawn("agent", twistd(
            "--logfile", str(self.work / "agent.log"), "llmgw", "agent",
            "--control", f"127.0.0.1:{self.agent_port}", "--certs", str(self.certs), "--node", "node-1",
            "--gpus", f"sim:{max(2, self.replicas)}x24GiB", "--state-dir", str(self.state),
            "--heartbeat", "1",
        ))
        if self.standalone:
            self._spawn("gateway", twistd(
                "--logfile", str(self.work / "gateway.log"), "llmgw", "gateway",
                "--gateway", f"127.0.0.1:{self.standalone_port}",
                "--admin-url", f"https://127.0.0.1:{self.admin_port}", "--certs", str(self.certs),
                "--as", GATEWAY_CERT, "--api-keys", str(self.work / "keys.toml"), "--metrics", "off",
                "--poll-interval", "0.5",
            ))
        self._wait_answers(timeout - (time.monotonic() - t0))
        return {"start_s": round(time.monotonic() - t0, 1)}

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.work / f"{name}.log")
                text = tail.read_text()[-3000:] if tail.exists() else ""
                out = (self.work / f"{name}.out").read_text()[-2000:]
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{out}\n{text}")

    def _wait_port(self, port: int, name: str, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{name} did not listen on {port} within {timeout:.0f} s")

    def _wait_answers(self, timeout: float) -> None:
        # Until the control plane routes to every replica and a chat
        # completion through the gateway under attack answers 200: the
        # baseline is then measured with the whole deployment in the routes.
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                routes = self.admin_get("/api/v1/routes")
                ready = [r for r in routes.get("routes", []) if not r.get("draining")]
                if len(ready) < self.replicas:
                    last = f"{len(ready)} of {self.replicas} replicas routed"
                else:
                    status, text, _ = chat_once(self.front_port)
                    if status == 200:
                        return
                    last = f"{status} {text[:200]}"
            except (OSError, http.client.HTTPException, ValueError) as e:
                last = repr(e)
            time.sleep(0.5)
        raise RuntimeError(f"the gateway on {self.front_port} did not answer 200 within the wait: {last}")

    def admin_get(self, path: str) -> Any:
        """
        C{GET path} on the admin API as the viewer; the JSON answer.
        """
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        files = self.admin_files()
        ctx.load_cert_chain(files["cert"], files["key"])
        conn = http.client.HTTPSConnection("127.0.0.1", self.admin_port, timeout=5, context=ctx)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise ValueError(f"GET {path}: {r.status} {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stop(self) -> None:
        """
        End every process this fleet started (TERM, then KILL after 5 s),
        then every shard its agent started.
        """
        for name in ("gateway", "agent", "control"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        for pid in processes_marked(str(self.state)):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for f in self.holder.cleanups:
            f()
        self.holder.cleanups = []


def chat_body(content: str = "hello") -> bytes:
    return json.dumps({
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}],
    }).encode()


def chat_once(port: int) -> tuple[int, str, str]:
    """
    One small chat completion with the bench's key: status, body and the
    fake model server that answered.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/chat/completions", body=chat_body(), headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace"), r.getheader("X-Fakemodel-Instance", "")
    finally:
        conn.close()
