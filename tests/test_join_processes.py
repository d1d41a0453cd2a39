"""
Nodes joining a real control plane, all real processes on loopback:
C{twistd llmgw control --join-listen PORT --signer} with certificates from
C{llmgw ctl cert init} and C{ctl cert server}, and C{twistd llmgw agent
--join} processes (simulated GPUs, no shards). Ten join with one token of
ten uses and register; the eleventh, a name another connected node holds,
and a token naming another CA each stop their agent with a clear error and
a non-zero status; a second run with the same state directory reuses its
certificate and does not join again.

Bounded: every wait has a deadline and every process started is killed in
cleanup.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, reactor
from twisted.internet.error import ProcessTerminated
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

import llmgw
from llmgw.ctl.main import build_parser
from llmgw.testing.procs import ProcessOutput, free_port

ROOT = str(Path(llmgw.__file__).resolve().parent.parent)
#: How long one step (a control plane up, ten agents registered) may take.
STEP = 60.0


def twistd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
            "llmgw", *args]


def ctl(*argv: str) -> str:
    """Run C{llmgw ctl ...} in this process; its output, or a failure naming its error."""
    args: argparse.Namespace = build_parser().parse_args(["ctl", *argv])
    out, err = io.StringIO(), io.StringIO()
    rc = args.func(args, out=out, err=err)
    if rc != 0:
        raise AssertionError(f"llmgw ctl {' '.join(argv)} exited {rc}: {err.getvalue()}")
    return out.getvalue()


class Proc:
    """One child process and its output."""

    def __init__(self, name: str, args: list[str], extra_env: dict[str, str] | None = None):
        self.name = name
        self.out = ProcessOutput()
        env = dict(os.environ, PYTHONPATH=ROOT, **(extra_env or {}))
        self.proc: Any = reactor.spawnProcess(self.out, sys.executable, args, env=env, path=ROOT)

    @property
    def alive(self) -> bool:
        return not self.out.ended.called

    async def exit_status(self, timeout: float) -> int | None:
        """The exit status once it ends (None: a signal ended it); fails past C{timeout}."""
        deadline = reactor.seconds() + timeout
        while self.alive:
            if reactor.seconds() > deadline:
                raise AssertionError(f"{self.name} did not exit within {timeout}s:\n{self.out.text()[-3000:]}")
            await deferLater(reactor, 0.05, lambda: None)
        reason = await self.out.ended
        return reason.exitCode if isinstance(reason, ProcessTerminated) else 0

    async def stop(self) -> None:
        if self.alive:
            self.proc.signalProcess("TERM")
            deadline = reactor.seconds() + 10
            while self.alive and reactor.seconds() < deadline:
                await deferLater(reactor, 0.05, lambda: None)
            if self.alive:
                self.proc.signalProcess("KILL")
        await self.out.ended


class JoinProcessCase(TestCase):
    """A control plane process with a join listener; agents started with L{agent}, all killed at the end."""

    timeout = 240
    #: Whether the control plane signs requests itself.
    signer = True
    #: More environment for the agents.
    agent_env: dict[str, str] = {}

    def control_args(self) -> tuple[str, ...]:
        """More arguments for the control plane (made in setUp, once the directory exists)."""
        return ()

    def setUp(self) -> defer.Deferred[None]:
        self.dir = Path(self.mktemp()).resolve()
        self.certs = self.dir / "certs"
        ctl("cert", "init", "--certs", str(self.certs))
        ctl("cert", "server", "--certs", str(self.certs), "--host", "127.0.0.1")
        self.procs: list[Proc] = []
        self.addCleanup(self.cleanup)
        self.agent_port, self.join_port, self.admin_port = free_port(), free_port(), free_port()
        self.control = self.spawn("control", "control", "--certs", str(self.certs),
                                  "--agent-listen", f"127.0.0.1:{self.agent_port}",
                                  "--join-listen", f"127.0.0.1:{self.join_port}",
                                  *(["--signer"] if self.signer else []),
                                  "--admin", f"127.0.0.1:{self.admin_port}", "--gateway", "off",
                                  "--adoption-grace", "0", *self.control_args())
        return defer.Deferred.fromCoroutine(self.wait_for("the admin API", self.admin_up))

    async def _cleanup(self) -> None:
        for p in reversed(self.procs):
            await p.stop()

    def cleanup(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._cleanup())

    def spawn(self, name: str, *args: str) -> Proc:
        p = Proc(name, twistd(*args), self.agent_env if name != "control" else None)
        self.procs.append(p)
        return p

    def agent(self, node: str, token: str, state: Path | None = None) -> Proc:
        state = state or self.dir / f"state-{node}"
        return self.spawn(node, "agent", "--join", f"127.0.0.1:{self.join_port}", "--token", token,
                          "--node", node, "--gpus", "sim:1x24GiB", "--state-dir", str(state),
                          "--heartbeat", "1")

    async def get(self, path: str) -> Any:
        response = await treq.get(f"http://127.0.0.1:{self.admin_port}{path}",
                                   pool=HTTPConnectionPool(reactor, persistent=False))
        return json.loads(await response.content())

    async def admin_up(self) -> bool:
        if not self.control.alive:
            raise AssertionError(f"the control plane exited:\n{self.control.out.text()[-3000:]}")
        try:
            await self.get("/api/v1/nodes")
        except Exception:
            return False
        return True

    async def connected(self) -> set[str]:
        return {n["id"] for n in (await self.get("/api/v1/nodes"))["nodes"] if n["connected"]}

    async def wait_for(self, what: str, check: Any, timeout: float = STEP) -> None:
        deadline = reactor.seconds() + timeout
        while not await check():
            if reactor.seconds() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.out.text()[-1500:]}" for p in self.procs)
                raise AssertionError(f"timed out waiting for {what}:\n{logs}")
            await deferLater(reactor, 0.1, lambda: None)

    def token(self, uses: int = 1) -> str:
        return ctl("token", "create", "--certs", str(self.certs), "--uses", str(uses)).strip()


class JoinProcessTests(JoinProcessCase):
    async def _ten(self) -> None:
        token = self.token(uses=10)
        nodes = [f"node-{i}" for i in range(1, 11)]
        agents = {n: self.agent(n, token) for n in nodes}

        async def all_registered() -> bool:
            for n, a in agents.items():
                if not a.alive:
                    raise AssertionError(f"{n} exited:\n{a.out.text()[-3000:]}")
            return await self.connected() == set(nodes)

        await self.wait_for("ten agents registered", all_registered)
        for n in nodes:
            key = self.dir / f"state-{n}" / "certs" / f"agent-{n}.key"
            self.assertEqual(key.stat().st_mode & 0o777, 0o600)

        eleventh = self.agent("node-11", token)
        self.assertEqual(await eleventh.exit_status(STEP), 2)
        self.assertIn("could not join: the control plane at 127.0.0.1:"
                      f"{self.join_port} refused the join: join token", eleventh.out.text())
        self.assertIn("is used up", eleventh.out.text())
        self.assertIn("join refused for node node-11 from 127.0.0.1:", self.control.out.text())

        clash = self.agent("node-3", self.token(), state=self.dir / "state-clash")
        self.assertEqual(await clash.exit_status(STEP), 2)
        self.assertIn("node 'node-3' is connected now: another node holds that name", clash.out.text())
        response = await treq.get(f"http://127.0.0.1:{self.admin_port}/metrics",
                                  pool=HTTPConnectionPool(reactor, persistent=False))
        metrics = (await response.content()).decode()
        self.assertIn('llmgw_certificate_requests_total{kind="join",outcome="issued"} 10.0', metrics)
        self.assertIn('llmgw_certificate_requests_total{kind="join",outcome="refused"} 2.0', metrics)

        # A second run with the same state directory: its certificate, no join.
        listed = json.loads(ctl("token", "list", "--certs", str(self.certs), "--json"))
        before = {t["id"]: t["used"] for t in listed}
        await agents["node-1"].stop()
        again = self.agent("node-1", token)
        await self.wait_for("node-1 registered again",
                            lambda: self._registered_again(again))
        listed = json.loads(ctl("token", "list", "--certs", str(self.certs), "--json"))
        self.assertEqual({t["id"]: t["used"] for t in listed}, before)
        self.assertEqual(self.control.out.text().count("node node-1 joined from"), 1)

    async def _registered_again(self, again: Proc) -> bool:
        if not again.alive:
            raise AssertionError(f"node-1 exited on its second run:\n{again.out.text()[-3000:]}")
        return "registered with the control plane" in again.out.text() and "node-1" in await self.connected()

    def test_ten_join_with_one_token(self) -> defer.Deferred[None]:
        """
        Ten agents join with one token of ten uses and register (keys 0600);
        the eleventh is refused (token used up) and a name a connected node
        holds is refused, each agent exiting 2 with the reason; a second run
        of a joined node reuses its certificate: no use of the token, no join.
        """
        return defer.Deferred.fromCoroutine(self._ten())

    async def _wrong_ca(self) -> None:
        token = self.token()
        wrong = token.rsplit(".", 1)[0] + "." + "1" * 64
        agent = self.agent("node-x", wrong)
        self.assertEqual(await agent.exit_status(STEP), 2)
        text = agent.out.text()
        self.assertIn("the token's CA hash is sha256:" + "1" * 64, text)
        self.assertIn("the CA hashes it showed are sha256:" + token.rsplit(".", 1)[1], text)
        self.assertIn("nothing was sent", text)
        self.assertNotIn("node-x", self.control.out.text())
        self.assertFalse((self.dir / "state-node-x" / "certs" / "agent-node-x.pem").exists())

    def test_wrong_ca_hash_sends_nothing(self) -> defer.Deferred[None]:
        """
        An agent whose token names another CA stops (status 2) with a
        message naming both hashes, and the control plane hears nothing of
        it.
        """
        return defer.Deferred.fromCoroutine(self._wrong_ca())


class ManualApprovalProcessTests(JoinProcessCase):
    """The same control plane without C{--signer}: joins wait for C{llmgw ctl csr}."""

    signer = False

    def csr(self, *argv: str) -> str:
        return ctl("csr", *argv, "--admin-url", f"http://127.0.0.1:{self.admin_port}", "--ca", str(self.certs))

    async def _manual(self) -> None:
        token = self.token(uses=2)
        approved, denied = self.agent("node-a", token), self.agent("node-b", token)

        async def both_wait() -> bool:
            return "node-a" in self.csr("list") and "node-b" in self.csr("list")

        await self.wait_for("two requests listed", both_wait)
        listing = self.csr("list")
        self.assertIn("join     pending   ECDSA secp256r1", listing)
        self.assertIn("certificate request (join) of node node-a approved", self.csr("approve", "node-a"))
        self.csr("deny", "node-b", "--reason", "not one of ours")

        async def registered() -> bool:
            if not approved.alive:
                raise AssertionError(f"node-a exited:\n{approved.out.text()[-3000:]}")
            return "node-a" in await self.connected()

        await self.wait_for("node-a registered", registered)
        self.assertEqual(await denied.exit_status(STEP), 2)
        self.assertIn("an operator denied the request: not one of ours", denied.out.text())
        issued = [json.loads(line) for line in (self.certs / "issued.jsonl").read_text().splitlines()]
        self.assertIn(("agent", "CN=node-a"), [(e["kind"], e["subject"]) for e in issued])

    def test_manual_approval(self) -> defer.Deferred[None]:
        """
        Without --signer two joins wait; `ctl csr approve` signs one where
        the CA's key is and its agent registers; `ctl csr deny` stops the
        other with the operator's reason (exit 2).
        """
        return defer.Deferred.fromCoroutine(self._manual())
