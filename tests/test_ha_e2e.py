"""
End to end, on loopback: a real 3-member etcd cluster, three control-plane
members (real C{twistd llmgw control --etcd ...} processes) and three
agents (real C{twistd llmgw agent} with every member's address) running
fake-model shards. Three faults, in turn: the leader
killed (-9), the leader frozen (SIGSTOP) and woken, etcd losing its quorum
and getting it back; after each, the shard processes are the same pids, no
replica is duplicated, and the shards keep answering.

Bounded: every wait has a deadline and every process started is killed in
cleanup. Skipped when etcd is not installed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

import llmgw
from llmgw.agent.state import StateDir
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster
from llmgw.testing.pki import make_pki
from llmgw.testing.ports import port_block, with_ports
from llmgw.testing.procs import ProcessOutput, free_port, process_alive

ROOT = str(Path(llmgw.__file__).resolve().parent.parent)
EXAMPLE = Path(ROOT) / "llmgw" / "demo-catalog.toml"
NODES = ("node-1", "node-2", "node-3")
MEMBERS = ("c1", "c2", "c3")
HEARTBEAT = 0.5
TTL = 4


def twistd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
            "llmgw", *args]


class Proc:
    def __init__(self, name: str, args: list[str]):
        self.name = name
        self.args = args
        self.out = ProcessOutput()
        self.proc: Any = None

    def start(self) -> None:
        self.out = ProcessOutput()
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.proc = reactor.spawnProcess(self.out, sys.executable, self.args, env=env, path=ROOT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.out.ended.called

    def signal(self, name: str) -> None:
        if self.alive:
            os.kill(self.proc.pid, getattr(signal, f"SIG{name}"))


class HAProcessCase(TestCase):
    """
    Real control-plane members and agents on loopback around a real etcd
    of C{etcd_members}: certificates for L{NODES}, the processes started
    kept in C{members} and C{agents}, and every one of them (stopped ones
    woken first) killed, with the shards the agents recorded in
    C{states}, and etcd stopped, at the end.
    """

    skip = ETCD_MISSING
    etcd_members = 3
    #: Whether each node gets a state directory (its agent runs shards).
    shard_states = True

    def setUp(self) -> defer.Deferred[None]:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, NODES, ["127.0.0.1"])
        self.states: dict[str, Path] = (
            {n: Path(self.mktemp()).resolve() for n in NODES} if self.shard_states else {})
        self.members: dict[str, Proc] = {}
        self.admin: dict[str, str] = {}
        self.agents: list[Proc] = []
        self.cluster = EtcdCluster(self.etcd_members)
        self.addCleanup(self.cleanup)
        return defer.Deferred.fromCoroutine(self.cluster.start(reactor))

    async def _cleanup(self) -> None:
        for p in [*self.members.values(), *self.agents]:
            if p.alive:
                try:
                    p.signal("CONT")
                    p.signal("KILL")
                except OSError:
                    pass
                await p.out.ended
        for state in self.states.values():
            if state.exists():
                for record in StateDir(state).load_all():
                    try:
                        os.killpg(record.pid, signal.SIGKILL)
                    except OSError:
                        pass
        await self.cluster.stop()

    def cleanup(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._cleanup())


class HAEndToEndTests(HAProcessCase):
    timeout = 300

    def catalog(self) -> Path:
        path = Path(self.mktemp()).resolve()
        text = EXAMPLE.read_text().replace("env = {}", f'env = {{ PYTHONPATH = "{ROOT}" }}')
        text = with_ports(text, *port_block(self))
        text = text.replace("replicas = 2", "replicas = 3")
        path.write_text(text)
        return path

    def start_members(self) -> list[str]:
        catalog = self.catalog()
        ports = {m: free_port() for m in MEMBERS}
        for m in MEMBERS:
            admin = free_port()
            self.admin[m] = f"http://127.0.0.1:{admin}"
            p = Proc(m, twistd(
                "control", "--certs", str(self.dir), "--agent-listen", f"127.0.0.1:{ports[m]}",
                "--admin", f"127.0.0.1:{admin}", "--gateway", "off", "--catalog", str(catalog),
                "--heartbeat", str(HEARTBEAT), "--pass-interval", "0.2",
                "--adoption-grace", "2", "--etcd", ",".join(self.cluster.urls),
                "--etcd-ttl", str(TTL), "--member-id", m, "--advertise-admin", self.admin[m],
            ))
            p.start()
            self.members[m] = p
        return [f"127.0.0.1:{ports[m]}" for m in MEMBERS]

    def start_agents(self, controls: list[str]) -> None:
        for node in NODES:
            args = ["agent"]
            for c in controls:
                args += ["--control", c]
            args += ["--certs", str(self.dir), "--node", node, "--gpus", "sim:1x24GiB",
                     "--state-dir", str(self.states[node]), "--heartbeat", str(HEARTBEAT)]
            p = Proc(node, twistd(*args))
            p.start()
            self.agents.append(p)

    async def get(self, member: str, path: str) -> Any:
        try:
            r = await treq.get(self.admin[member] + path, timeout=1.0, persistent=False)
            return await r.json()
        except Exception:  # noqa: BLE001 - frozen, dead or starting: no answer
            return None

    async def statuses(self) -> dict[str, Any]:
        out = {}
        for m, p in self.members.items():
            if p.alive:
                st = await self.get(m, "/api/v1/status")
                if st is not None:
                    out[m] = st
        return out

    async def wait(self, what: str, check: Any, timeout: float = 60) -> Any:
        deadline = reactor.seconds() + timeout
        while True:
            value = await check()
            if value:
                return value
            for p in self.agents:
                if not p.alive:
                    self.fail(f"agent {p.name} exited while waiting for {what}:\n{p.out.text()[-3000:]}")
            if reactor.seconds() > deadline:
                logs = "\n".join(
                    f"--- {p.name}\n{self.tail(p)}" for p in [*self.members.values(), *self.agents]
                )
                self.fail(f"timed out waiting for {what}\n{logs}")
            await deferLater(reactor, 0.2, lambda: None)

    @staticmethod
    def tail(p: Proc) -> str:
        lines = [line for line in p.out.text().splitlines() if '"GET /api/v1/' not in line]
        return "\n".join(lines[-25:])

    async def leader_with_all(self, exclude: tuple[str, ...] = ()) -> str | None:
        """The one leading member, once all three agents are on it."""
        sts = await self.statuses()
        leaders = [m for m, st in sts.items() if st.get("role") == "leader" and m not in exclude]
        if len(leaders) != 1:
            return None
        st = sts[leaders[0]]
        return leaders[0] if st.get("agents_connected") == len(NODES) else None

    def shard_pids(self) -> dict[str, int]:
        pids = {}
        for state in self.states.values():
            for record in StateDir(state).load_all():
                if process_alive(record.pid):
                    pids[record.spec.shard_id] = record.pid
        return pids

    async def ready_replicas(self, leader: str) -> list[dict[str, Any]]:
        body = await self.get(leader, "/api/v1/replicas")
        reps = [r for r in (body or {}).get("replicas", []) if r["state"] == "ready"]
        return reps if len(reps) == 3 else []

    async def check_unchanged(self, leader: str, pids: dict[str, int], what: str) -> None:
        """Same shard pids, three replicas (no duplicate), shards answering."""
        reps = await self.wait(f"three ready replicas on {leader} after {what}",
                               lambda: self.ready_replicas(leader))
        # Two more passes' time, past the adoption grace, to see nothing placed.
        await deferLater(reactor, 3.0, lambda: None)
        self.assertEqual(self.shard_pids(), pids, f"shard processes changed after {what}")
        body = await self.get(leader, "/api/v1/replicas")
        self.assertEqual(len(body["replicas"]), 3, f"replicas after {what}: {body['replicas']}")
        self.assertEqual({r["id"] for r in body["replicas"]}, {r["id"] for r in reps})
        for rep in reps:
            for shard in rep["shards"]:
                addr = shard.get("address") or f"127.0.0.1:{shard['port']}"
                r = await treq.get(f"http://{addr}/v1/models", timeout=2.0, persistent=False)
                self.assertEqual(r.code, 200, f"shard {shard['id']} not answering after {what}")
                await r.content()

    def test_failover_restarts_nothing(self) -> Any:
        """
        The three faults (leader killed, leader frozen, quorum lost), each leaving the same shard
        processes, three replicas and answering shards.
        """
        async def go() -> None:
            controls = self.start_members()
            self.start_agents(controls)
            leader = await self.wait("a leader with all agents", self.leader_with_all)
            reps = await self.wait("three ready replicas", lambda: self.ready_replicas(leader))
            self.assertEqual(len({r["shards"][0]["node"] for r in reps}), 3)
            pids = await self.wait("three shard processes", lambda: defer.succeed(
                self.shard_pids() if len(self.shard_pids()) == 3 else None))
            first_epoch = (await self.statuses())[leader]["epoch"]

            # 1. kill -9 the leader.
            self.members[leader].signal("KILL")
            await self.members[leader].out.ended
            second = await self.wait("a new leader with all agents after kill -9", self.leader_with_all)
            self.assertNotEqual(second, leader)
            second_epoch = (await self.statuses())[second]["epoch"]
            self.assertGreater(second_epoch, first_epoch)
            await self.check_unchanged(second, pids, "kill -9 of the leader")

            # 2. SIGSTOP the leader; the last member takes over; wake it.
            self.members[second].signal("STOP")
            third = await self.wait("a leader after SIGSTOP", lambda: self.leader_with_all(exclude=(second,)))
            await self.check_unchanged(third, pids, "SIGSTOP of the leader")
            self.members[second].signal("CONT")
            await deferLater(reactor, 3.0, lambda: None)
            woken = await self.get(second, "/api/v1/status")
            self.assertEqual(woken["role"], "follower")
            self.assertIn("stepped down", self.members[second].out.text())
            self.assertEqual(self.shard_pids(), pids)

            # 3. etcd loses its quorum: the leader steps down, nothing is torn down.
            stopped = self.cluster.members[1:]
            for m in stopped:
                await m.stop(reactor)

            async def no_leader() -> bool:
                sts = await self.statuses()
                return bool(sts) and all(st["role"] == "follower" for st in sts.values())

            await self.wait("every member a follower without quorum", no_leader, timeout=30)
            await deferLater(reactor, 2.0, lambda: None)
            self.assertEqual(self.shard_pids(), pids, "shards changed while etcd had no quorum")
            for m in stopped:
                await self.cluster.restart(m)
            fourth = await self.wait("a leader once the quorum is back", self.leader_with_all, timeout=60)
            await self.check_unchanged(fourth, pids, "etcd's quorum lost and regained")
        return defer.Deferred.fromCoroutine(go())
