"""
End to end: models fetched by real agents, each a process of its own
(C{twistd llmgw agent}, with its peer listener on loopback) under a real
control plane process, served by a real C{llama-server}: a second node
fetching from the first one's peer listener instead of the hub, a replica
moved off lost nodes to one without the weights whose named peers are dead
(it fetches from the hub), and an agent SIGKILLed mid-fetch that fetches on
from what it kept after its restart. The hub is C{olah} on loopback (see
L{tests.test_models_hub}); the https source a throttled server in a thread.
Skipped, saying why, when llama-server, olah or git is absent.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.agent.state import StateDir
from llmgw.testing.engines import find_llama_server, llama_server_missing_reason
from llmgw.testing.pki import make_pki
from llmgw.testing.ports import free_port, port_block, wait_bound, with_ports
from tests.test_models_hub import make_mirror, start_olah
from tests.test_real_engine import LLAMA_SOURCE_CATALOG, engine_processes

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0
HEARTBEAT = "0.5"
PEER_LINE = re.compile(r"tiny\.gguf fetched from peer (\S+)")


def twistd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
            "llmgw", *args]


def llama_server() -> Path:
    binary = find_llama_server()
    if binary is None:
        raise SkipTest(llama_server_missing_reason())
    return binary


class Process:
    """
    One llmgw process of the fleet, its output in C{log}, in a session of
    its own (so a SIGKILL of it leaves its shards running, as an agent's
    crash does).
    """

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str]):
        self.name, self.args, self.log, self.env = name, args, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ports: list[int]) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=self.log.parent, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        if not wait_bound(self.proc, ports, self.output, DEADLINE):
            raise RuntimeError(f"{self.name}: a port was taken:\n{self.output()[-2000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


class ProcessFleet:
    """
    A control plane and agents C{nodes} (one simulated GPU each, a peer
    listener each), real processes on loopback, with C{catalog}; every
    process, and every engine that names the fleet's directory, killed at
    the end of C{case}.
    """

    def __init__(self, case: SynchronousTestCase, catalog: str, nodes: list[str],
                 env: dict[str, str], lost_after: float = 3.0):
        self.case = case
        self.dir = Path(case.mktemp()).resolve()
        self.dir.mkdir(parents=True)
        self.certs = self.dir / "certs"
        make_pki(self.certs, nodes, ["127.0.0.1"])
        self.catalog = self.dir / "catalog.toml"
        self.catalog.write_text(with_ports(catalog, *port_block(case)))
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
        case.addCleanup(self.kill_everything)
        self.agent_port, self.admin_port, self.gateway_port = free_port(), free_port(), free_port()
        self.control = Process("control", twistd(
            "control", "--certs", str(self.certs), "--agent-listen", f"127.0.0.1:{self.agent_port}",
            "--admin", f"127.0.0.1:{self.admin_port}", "--gateway", f"127.0.0.1:{self.gateway_port}",
            "--catalog", str(self.catalog), "--heartbeat", HEARTBEAT, "--pass-interval", "0.2",
            "--adoption-grace", "1", "--suspect-after", "1", "--lost-after", str(lost_after),
            "--max-connections-per-address", "0"), self.dir / "control.log", self.env)
        self.agents: dict[str, Process] = {}
        self.peer_ports: dict[str, int] = {}
        self.control.start([self.agent_port, self.admin_port, self.gateway_port])
        for node in nodes:
            self.peer_ports[node] = free_port()
            self.agents[node] = Process(node, twistd(
                "agent", "--control", f"127.0.0.1:{self.agent_port}", "--certs", str(self.certs),
                "--node", node, "--gpus", "sim:1x24GiB", "--state-dir", str(self.state(node)),
                "--heartbeat", HEARTBEAT, "--peer-listen", f"127.0.0.1:{self.peer_ports[node]}",
            ), self.dir / f"{node}.log", self.env)
            self.agents[node].start([self.peer_ports[node]])

    def state(self, node: str) -> Path:
        return self.dir / f"state-{node}"

    def kill_everything(self) -> None:
        for process in [*self.agents.values(), self.control]:
            process.kill()
        for pid in engine_processes(self.dir):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def kill_node(self, node: str) -> None:
        """
        The node is lost: its agent and its shards SIGKILLed.
        """
        self.agents[node].kill()
        for record in StateDir(self.state(node)).load_all():
            try:
                os.killpg(record.pid, signal.SIGKILL)
            except OSError:
                pass

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.output()[-3000:]}"
                         for p in [self.control, *self.agents.values()])

    def wait(self, what: str, check: Callable[[], Any], timeout: float = DEADLINE,
             control_lives: bool = True) -> Any:
        """
        C{check()}'s first true value, asked every 0.2 s; the test fails
        after C{timeout} seconds, or at once when the control plane has
        exited while it should live (C{control_lives}).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except OSError:
                value = None
            if value:
                return value
            if control_lives and self.control.proc is not None and self.control.proc.poll() is not None:
                self.case.fail(f"the control plane exited while waiting for {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.case.fail(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.2)

    def admin(self, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def ready_on(self) -> dict[str, str]:
        """
        The ready replicas' nodes, by replica id.
        """
        replicas = self.admin("/api/v1/replicas")["replicas"]
        return {r["id"]: r["shards"][0]["node"] for r in replicas if r["state"] == "ready"}

    def chat(self, max_tokens: int = 4) -> int:
        """
        One chat through the gateway: the completion tokens it gave.
        """
        body = json.dumps({"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.gateway_port}/v1/chat/completions",
                                         body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(json.loads(response.read())["usage"]["completion_tokens"])

    def stop(self) -> None:
        """
        SIGTERM every agent left and the control plane, then kill every
        shard the agents leave running (an agent's stop leaves them, by
        design); no engine process may be left.
        """
        for process in self.agents.values():
            if process.proc is not None and process.proc.poll() is None:
                process.stop()
        self.control.stop()
        for node in self.agents:
            self.kill_node(node)
        # The control plane has stopped by now: only the engines are waited for.
        self.wait("no engine process left", lambda: not engine_processes(self.dir), control_lives=False)


class StallingServer(http.server.ThreadingHTTPServer):
    """
    An https server on loopback serving C{body} at C{/tiny.gguf}, whose
    first GET sends C{stall_at} bytes and then sends nothing more until
    C{release} is set (then ends the connection). C{ranges} lists each
    GET's Range header, C{sent} the body bytes sent in all.
    """

    daemon_threads = True

    def __init__(self, body: bytes, stall_at: int, context: ssl.SSLContext):
        super().__init__(("127.0.0.1", free_port()), _StallingHandler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.body, self.stall_at = body, stall_at
        self.ranges: list[str | None] = []
        self.sent = 0
        self.release = threading.Event()


class _StallingHandler(http.server.BaseHTTPRequestHandler):
    server: StallingServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _head(self, start: int) -> None:
        body = self.server.body
        if start:
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        self._head(0)

    def do_GET(self) -> None:  # noqa: N802
        ranged = self.headers.get("Range")
        first = not self.server.ranges
        self.server.ranges.append(ranged)
        start = int(ranged.removeprefix("bytes=").rstrip("-")) if ranged else 0
        self._head(start)
        body = self.server.body[start:]
        if first:
            body = body[: self.server.stall_at]
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            return
        self.server.sent += len(body)
        if first:
            self.server.release.wait(DEADLINE)
            self.close_connection = True


def hub_gets(top: Path) -> int:
    """
    How many times olah (logging under C{top}/logs) served tiny.gguf's bytes.
    """
    log = top / "logs" / "olah.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return len(re.findall(r'"GET /acme/tiny/resolve/\S+/tiny\.gguf HTTP', text))


class PeerFetchTests(SynchronousTestCase):
    def test_dead_peer_then_lost_node(self) -> None:
        """
        Three agents, one GPU each, and a deployment of an hf:// model:
        the first replica's node fetches it from the hub. That node then
        dies (agent and engine killed) and the deployment is scaled to two
        while it is not yet lost: the new replica's node is told to fetch
        from the dead node's peer listener, cannot connect, fetches from
        the hub instead and becomes ready. Once the dead node is lost, its
        replica is replaced on the third node, which has no weights and
        fetches them from the second node's peer listener: the hub serves
        the file no third time, and a chat answers.
        """
        binary = llama_server()
        if shutil.which("git") is None:
            raise SkipTest("git is not installed")
        from llmgw.testing.tinygguf import write

        top = Path(self.mktemp()).absolute()
        top.mkdir()
        gguf = write(top / "tiny.gguf").read_bytes()
        endpoint = start_olah(self, top, make_mirror(top / "mirrors", lfs={"tiny.gguf": gguf}))
        catalog = LLAMA_SOURCE_CATALOG.format(
            binary=json.dumps(str(binary)), source=json.dumps("hf://acme/tiny") + '\nfile = "tiny.gguf"')
        nodes = ["node-1", "node-2", "node-3"]
        fleet = ProcessFleet(self, catalog, nodes, {
            "HF_ENDPOINT": endpoint, "HF_HOME": str(top / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"})

        [first] = fleet.wait("a ready replica", fleet.ready_on).values()
        self.assertEqual(hub_gets(top), 1)
        self.assertIsNone(PEER_LINE.search(fleet.agents[first].output()))

        def holds_complete(node: str) -> bool:
            # Nodes report their caches in heartbeats: the control plane
            # names a peer only once it has heard that it holds the model.
            return any(n["node"] == node and n["state"] == "complete"
                       for m in fleet.admin("/api/v1/models")["models"] for n in m["nodes"])

        fleet.wait(f"{first}'s copy known to the control plane", lambda: holds_complete(first))

        # The first node dies. One of the others is cordoned so the new
        # replica goes to the other, and the dead node's replacement waits
        # for the uncordon: by then the second node holds the weights.
        second, third = sorted(set(nodes) - {first})
        fleet.kill_node(first)
        fleet.admin(f"/api/v1/nodes/{third}/cordon", {})
        fleet.admin("/api/v1/deployments/tiny/scale", {"replicas": 2})
        fleet.wait(f"a replica ready on {second}", lambda: second in fleet.ready_on().values())
        output = fleet.agents[second].output()
        self.assertIn(f"peer 127.0.0.1:{fleet.peer_ports[first]} did not serve tiny.gguf: cannot connect",
                      output)
        self.assertIsNone(PEER_LINE.search(output), output[-3000:])
        self.assertEqual(hub_gets(top), 2)

        # The dead node's replica moves to a node without the weights.
        fleet.wait(f"{second}'s copy known to the control plane", lambda: holds_complete(second))
        fleet.admin(f"/api/v1/nodes/{third}/uncordon", {})
        fleet.wait(f"a replica ready on {third}", lambda: third in fleet.ready_on().values())
        served = PEER_LINE.search(fleet.agents[third].output())
        self.assertIsNotNone(served, fleet.agents[third].output()[-3000:])
        assert served is not None
        self.assertEqual(served.group(1), f"127.0.0.1:{fleet.peer_ports[second]}")
        self.assertEqual(hub_gets(top), 2)
        self.assertEqual(set(fleet.ready_on().values()), {second, third})
        self.assertEqual(fleet.chat(4), 4)
        fleet.stop()


class ResumeTests(SynchronousTestCase):
    def test_agent_killed_mid_fetch(self) -> None:
        """
        An agent SIGKILLed while its shard fetches an https:// model (the
        server stalls after the first megabyte, which is on disk in the
        cache's .part) and started again on the same state directory
        fetches on from that part with a Range request, not from the
        start: the server sends less than the file and a half in all; the
        shard becomes ready and a chat answers.
        """
        binary = llama_server()
        from llmgw.testing.tinygguf import write
        from llmgw.tlsconf.ca import CertificateAuthority

        top = Path(self.mktemp()).absolute()
        top.mkdir()
        # Padded past the fetcher's one-megabyte reads (llama-server ignores
        # what follows the tensors), so a megabyte is kept before the stall.
        model = write(top / "tiny.gguf")
        body = model.read_bytes() + bytes(1 << 20)
        ca = CertificateAuthority.init(top / "ca")
        issued = ca.issue_server(["127.0.0.1"])
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(issued.cert_path), str(issued.key_path))
        server = StallingServer(body, (1 << 20) + 4096, context)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.addCleanup(thread.join, 10)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        self.addCleanup(server.release.set)
        source = json.dumps(f"https://127.0.0.1:{server.server_address[1]}/tiny.gguf")
        catalog = LLAMA_SOURCE_CATALOG.format(
            binary=json.dumps(str(binary)),
            source=source + f"\nsha256 = {json.dumps(hashlib.sha256(body).hexdigest())}")
        # Never lost while its agent restarts: the shard it runs is claimed.
        fleet = ProcessFleet(self, catalog, ["node-1"], {"SSL_CERT_FILE": str(ca.cert_path)},
                             lost_after=60)
        agent = fleet.agents["node-1"]

        def part_size() -> int:
            return sum(p.stat().st_size for p in fleet.state("node-1").rglob("*.part"))

        fleet.wait("the first megabyte in the cache", lambda: part_size() >= 1 << 20)
        agent.kill()
        server.release.set()
        kept = part_size()
        agent.start([fleet.peer_ports["node-1"]])
        [replica] = fleet.wait("a ready replica", fleet.ready_on)
        resumed = re.search(r"of replica (\S+) was fetching its weights when the agent stopped: "
                            r"fetching on", agent.output())
        self.assertIsNotNone(resumed, agent.output()[-3000:])
        assert resumed is not None
        self.assertEqual(resumed.group(1), replica)
        self.assertEqual(server.ranges, [None, f"bytes={kept}-"])
        self.assertLess(server.sent, len(body) * 3 // 2)
        self.assertNotIn("did not survive", agent.output())
        self.assertEqual(fleet.chat(4), 4)
        fleet.stop()
