"""
A node renewing its certificate in real processes on loopback: a control
plane with C{--signer --cert-lifetime 1m} and a catalog of one fake-model
replica, and an agent that joined with a token. The agent asks for its new
certificate over its stream (the renewal share set to 0.3 through
L{llmgw.agent.renewal.FRACTION_ENV}, so it comes 18 s in rather than 40),
writes it, and keeps its stream; the shard keeps its pid.

Bounded: every wait has a deadline and every process started is killed in
cleanup.
"""

from __future__ import annotations

import os
import signal

from cryptography import x509
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater

from llmgw.agent.renewal import FRACTION_ENV
from llmgw.agent.state import StateDir
from llmgw.testing.procs import free_port
from tests.test_join_processes import STEP, JoinProcessCase, ctl

CATALOG = """
[ports]
first = {port}
last = {port}

[profiles.fake]
shards = 1
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = ""
command = ["{{python}}", "-m", "llmgw.testing.fakemodel", "--port", "{{port}}", "--model", "{{model}}",
           "--host", "{{host}}"]
env = {{}}
health_path = "/health"
startup_timeout_s = 60
drain_timeout_s = 5
stop_grace_s = 5

[[deployments]]
model = "demo"
profile = "fake"
replicas = 1
"""


def kill_groups(pids: list[int]) -> None:
    """
    Kill each shard's process group (a shard leads its own).
    """
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class RenewalProcessTests(JoinProcessCase):
    agent_env = {FRACTION_ENV: "0.3"}

    def control_args(self) -> tuple[str, ...]:
        catalog = self.dir / "catalog.toml"
        self.dir.mkdir(parents=True, exist_ok=True)
        catalog.write_text(CATALOG.format(port=free_port()))
        return ("--cert-lifetime", "1m", "--catalog", str(catalog))

    def shard_pids(self) -> dict[str, int]:
        return {r.spec.shard_id: r.pid for r in StateDir(self.dir / "state-node-r").load_all()}

    async def _renew(self) -> None:
        agent = self.agent("node-r", self.token())
        cert_path = self.dir / "state-node-r" / "certs" / "agent-node-r.pem"

        async def shard_ready() -> bool:
            if not agent.alive:
                raise AssertionError(f"the agent exited:\n{agent.out.text()[-3000:]}")
            replicas = (await self.get("/api/v1/replicas"))["replicas"]
            return any(r.get("state") == "ready" for r in replicas)

        await self.wait_for("the shard ready", shard_ready)
        first = x509.load_pem_x509_certificate(cert_path.read_bytes())
        pids = self.shard_pids()
        self.assertEqual(len(pids), 1)
        # An agent's stop leaves its shards running, by design: the test
        # ends them itself.
        self.addCleanup(kill_groups, list(pids.values()))

        async def renewed() -> bool:
            if not agent.alive:
                raise AssertionError(f"the agent exited:\n{agent.out.text()[-3000:]}")
            return "renewed its certificate" in agent.out.text()

        await self.wait_for("the certificate renewed", renewed, timeout=STEP)
        second = x509.load_pem_x509_certificate(cert_path.read_bytes())
        self.assertNotEqual(second.serial_number, first.serial_number)
        self.assertNotEqual(second.public_key().public_numbers(), first.public_key().public_numbers())  # type: ignore[union-attr]
        key_path = cert_path.with_name("agent-node-r.key")
        self.assertEqual(key_path.stat().st_mode & 0o777, 0o600)
        text = agent.out.text()
        self.assertEqual(text.count("registered with the control plane"), 1, "the stream was not dropped")
        self.assertNotIn("stream to the control plane", text)
        self.assertIn("renewed the certificate of node node-r", self.control.out.text())
        self.assertEqual(self.shard_pids(), pids)
        for pid in pids.values():
            os.kill(pid, 0)  # still running
        nodes = {n["id"]: n for n in (await self.get("/api/v1/nodes"))["nodes"]}
        self.assertEqual(nodes["node-r"]["certificate_not_after"], second.not_valid_after_utc.timestamp())

    def test_renewal_keeps_stream_and_shard(self) -> defer.Deferred[None]:
        """
        With a one-minute lifetime the agent renews over its stream: a new
        key (0600) and certificate on disk, the control plane's inventory
        shows the new expiry, the stream was never dropped (one
        registration) and the shard keeps its pid.
        """
        return defer.Deferred.fromCoroutine(self._renew())

    async def _revoked(self) -> None:
        agent = self.agent("node-v", self.token())
        cert_path = self.dir / "state-node-v" / "certs" / "agent-node-v.pem"
        await self.wait_for("node-v registered", self._connected_node_v)
        before = cert_path.read_bytes()
        ctl("cert", "revoke", "node-v", "--certs", str(self.certs))
        self.control.proc.signalProcess("HUP")

        async def closed() -> bool:
            return "node-v" not in await self.connected()

        await self.wait_for("the revoked node's stream closed", closed)
        # Past the time its renewal was due (18 s after it joined) and more.
        await deferLater(reactor, 25, lambda: None)
        self.assertTrue(agent.alive)
        self.assertEqual(cert_path.read_bytes(), before)
        self.assertNotIn("node-v", await self.connected())
        self.assertNotIn("renewed the certificate of node node-v", self.control.out.text())
        self.assertNotIn("renewed its certificate", agent.out.text())

    async def _connected_node_v(self) -> bool:
        return "node-v" in await self.connected()

    def test_revoked_node_cannot_renew(self) -> defer.Deferred[None]:
        """
        A node revoked (`ctl cert revoke`, SIGHUP) loses its stream, cannot
        register again, and gets no new certificate when its renewal comes
        due: its files stay as they were.
        """
        return defer.Deferred.fromCoroutine(self._revoked())
