"""
Real etcd members for integration tests: each on free loopback ports with
its own temporary data directory, started with C{reactor.spawnProcess},
waited for through its C{/health} endpoint, and always torn down (TERM,
then KILL after a grace).

Tests that use these skip when the C{etcd} binary is not installed
(L{ETCD_MISSING} says why); CI installs Debian's C{etcd-server}.

With C{tls=True} an L{EtcdCluster} serves its clients over TLS with client
certificates required (C{--cert-file --key-file --trusted-ca-file
--client-cert-auth}) and speaks TLS between its members (C{--peer-*}, peer
certificates required), every certificate made at run time by llmgw's own
CA code in a CA directory of its own (L{EtcdCluster.client_files} issues a
client's).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer
from twisted.internet.task import deferLater

from llmgw.testing.ports import free_port, in_use
from llmgw.testing.procs import ProcessOutput, process_alive

ETCD = shutil.which("etcd")
#: Why etcd tests are skipped, or None when they can run.
ETCD_MISSING = (
    None if ETCD else "etcd is not installed (apt-get install etcd-server): etcd tests need a real member"
)


@dataclass(frozen=True)
class EtcdTLS:
    """An etcd member's client-facing TLS: its certificate, key, and the CA
    whose client certificates it takes."""

    cert: str
    key: str
    ca: str


class EtcdMember:
    """One etcd process; C{client_url} is where clients speak to it."""

    def __init__(self, name: str, data_root: str, client_port: int, peer_port: int,
                 tls: EtcdTLS | None = None):
        self.name = name
        self.data_dir = os.path.join(data_root, name)
        self.client_port = client_port
        self.peer_port = peer_port
        self.tls = tls
        scheme = "https" if tls else "http"
        self.client_url = f"{scheme}://127.0.0.1:{client_port}"
        self.peer_url = f"{scheme}://127.0.0.1:{peer_port}"
        self.output: ProcessOutput | None = None
        self.process: Any = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def spawn(self, reactor: Any, initial_cluster: str, state: str = "new") -> None:
        assert ETCD is not None, ETCD_MISSING
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.output = ProcessOutput()
        args = [
            "etcd",
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", "llmgw-test",
            # Small timings keep elections in a test's time scale.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
            "--logger", "zap",
        ]
        if self.tls is not None:
            args += ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                     "--trusted-ca-file", self.tls.ca, "--client-cert-auth",
                     # Peers too, with the same certificate (server and client use).
                     "--peer-cert-file", self.tls.cert, "--peer-key-file", self.tls.key,
                     "--peer-trusted-ca-file", self.tls.ca, "--peer-client-cert-auth"]
        self.process = reactor.spawnProcess(
            self.output, ETCD, args, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )

    def running(self) -> bool:
        return self.pid is not None and process_alive(self.pid) and not (
            self.output is not None and self.output.ended.called
        )

    def signal(self, sig: int) -> None:
        if self.pid is not None and self.running():
            os.kill(self.pid, sig)

    async def stop(self, reactor: Any, grace: float = 5.0) -> None:
        """TERM, then KILL after C{grace}; returns once the process ended."""
        if self.output is None or self.output.ended.called or self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        ended = self.output.ended
        kill = reactor.callLater(grace, lambda: self.signal(signal.SIGKILL))
        try:
            await ended
        finally:
            if kill.active():
                kill.cancel()


class EtcdCluster:
    """
    C{size} etcd members on loopback forming one cluster. C{urls} are their
    client URLs. Use C{await start(reactor)} and always C{await stop()}
    (a test's C{addCleanup}).
    """

    def __init__(self, size: int = 1, tls: bool = False):
        self.data_root = tempfile.mkdtemp(prefix="llmgw-etcd-")
        self.ca: Any = None
        member_tls = None
        if tls:
            from llmgw.tlsconf.ca import CertificateAuthority

            self.ca = CertificateAuthority.init(Path(self.data_root) / "pki")
            issued = self.ca.issue_etcd("etcd", ["127.0.0.1"])
            member_tls = EtcdTLS(str(issued.cert_path), str(issued.key_path), str(self.ca.cert_path))
        self.size, self.member_tls = size, member_tls
        self.members = self._new_members()
        self.reactor: Any = None
        self._http: Any = None

    def _new_members(self) -> list[EtcdMember]:
        return [
            EtcdMember(f"m{i}", self.data_root, free_port(), free_port(), self.member_tls)
            for i in range(self.size)
        ]

    def client_files(self, name: str) -> Any:
        """
        A client certificate for C{name} from this cluster's CA (its
        C{--etcd-ca/--etcd-cert/--etcd-key}), as L{TLSFiles}.
        """
        from llmgw.tlsconf.options import TLSFiles

        issued = self.ca.issue_etcd(name, [])
        return TLSFiles.load(self.ca.cert_path, issued.cert_path, issued.key_path)

    def http(self) -> Any:
        """A treq client that etcd's members take (their CA and a client certificate)."""
        if self._http is None:
            if self.ca is None:
                self._http = treq
            else:
                from twisted.web.client import Agent

                from llmgw.tlsconf.options import ClientTLSPolicy

                self._http = treq.client.HTTPClient(Agent(
                    self.reactor, contextFactory=ClientTLSPolicy(self.client_files("health"))))
        return self._http

    @property
    def urls(self) -> list[str]:
        return [m.client_url for m in self.members]

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    async def start(self, reactor: Any, timeout: float = 30.0, attempts: int = 3) -> None:
        """
        Start every member and wait until each is healthy. A member that
        could not bind its port (another process took it after it was
        picked) has the whole cluster started afresh on new ports, at most
        C{attempts} times in all: the members' peer URLs name each other.
        """
        self.reactor = reactor
        for attempt in range(attempts):
            for m in self.members:
                m.spawn(reactor, self.initial_cluster)
            try:
                await self.wait_healthy(self.members, timeout)
                return
            except RuntimeError:
                refused = any(m.output is not None and in_use(m.output.text()) for m in self.members)
                if not refused or attempt == attempts - 1:
                    raise
            await defer.gatherResults([
                defer.Deferred.fromCoroutine(m.stop(reactor)) for m in self.members
            ])
            for m in self.members:
                shutil.rmtree(m.data_dir, ignore_errors=True)
            self.members = self._new_members()

    async def restart(self, member: EtcdMember, timeout: float = 30.0) -> None:
        """Start a stopped member again on its data directory."""
        member.spawn(self.reactor, self.initial_cluster, state="existing")
        await self.wait_healthy([member], timeout)

    async def wait_healthy(self, members: list[EtcdMember], timeout: float) -> None:
        deadline = self.reactor.seconds() + timeout
        pending = list(members)
        while pending:
            # Any member gone ends the wait: the others may wait on it forever.
            for gone in pending:
                if not gone.running():
                    out = gone.output.text()[-2000:] if gone.output else ""
                    raise RuntimeError(f"etcd member {gone.name} exited while starting:\n{out}")
            m = pending[0]
            try:
                http = self.http()
                kw = {"persistent": False} if http is treq else {}
                r = await http.get(m.client_url + "/health", timeout=1.0, **kw)
                body = await r.json()
                if r.code == 200 and body.get("health") == "true":
                    pending.pop(0)
                    continue
            except Exception:  # noqa: BLE001 - not up yet: try again
                pass
            if self.reactor.seconds() > deadline:
                out = m.output.text()[-2000:] if m.output else ""
                raise TimeoutError(f"etcd member {m.name} not healthy within {timeout}s:\n{out}")
            await deferLater(self.reactor, 0.1, lambda: None)

    async def stop(self) -> None:
        await defer.gatherResults([
            defer.Deferred.fromCoroutine(m.stop(self.reactor)) for m in self.members
        ])
        shutil.rmtree(self.data_root, ignore_errors=True)


async def until(predicate: Any, timeout: float, what: str, clock: Any = None) -> None:
    """
    Wait, polling every 50 ms on C{clock} (the global reactor by default),
    until C{predicate()} is true.

    @raise TimeoutError: not within C{timeout} seconds; says C{what}.
    """
    if clock is None:
        from twisted.internet import reactor as clock
    deadline = clock.seconds() + timeout
    while not predicate():
        if clock.seconds() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        await deferLater(clock, 0.05, lambda: None)
