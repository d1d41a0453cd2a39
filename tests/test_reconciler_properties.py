"""
Property tests for the reconciler's decisions (DESIGN §6.7): random fleets
of simulated agents and random sequences of what can happen to them
(heartbeats, silence, returns, shard reports, scale, drain and cordon),
with invariants checked at every command and after every event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import (
    IDispatcher,
    NotConnected,
    ReportedShard,
    ShardCommand,
    ShardReport,
)
from llmgw.control.state.inventory import Inventory
from llmgw.testing.simfleet import sim_node
from tests.reconciler_harness import catalog


@dataclass
class Process:
    command: ShardCommand
    state: str = "starting"
    stopping: bool = False


@implementer(IDispatcher)
@dataclass
class Agents:
    """
    Simulated agents behind a dispatcher that checks every command as it
    is sent: it must name a node in the inventory, and a shard the control
    plane holds there (a start) or one it holds, reserves, or the agent
    runs (a stop or drain).
    """

    test: SynchronousTestCase
    inventory: Inventory
    connected: set[str] = field(default_factory=set)
    running: dict[str, dict[str, Process]] = field(default_factory=dict)
    rec: Reconciler | None = None

    def _check(self, node_id: str, shard_id: str, start: bool) -> None:
        assert self.rec is not None
        self.test.assertIn(node_id, self.inventory, f"command for unknown node {node_id}")
        held = self.rec.state.shards.get(shard_id)
        if start:
            self.test.assertIsNotNone(held, f"start of unknown shard {shard_id}")
            assert held is not None
            self.test.assertEqual(held.node_id, node_id)
        else:
            reserved = self.rec.state.reserved.get(shard_id)
            known = (
                (held is not None and held.node_id == node_id)
                or (reserved is not None and reserved.node_id == node_id)
                or shard_id in self.running.get(node_id, {})
            )
            self.test.assertTrue(known, f"stop or drain of {shard_id}, unknown on {node_id}")
        if node_id not in self.connected:
            raise NotConnected(f"{node_id} is not connected")

    def start_shard(self, command: ShardCommand) -> None:
        self._check(command.node_id, command.shard_id, True)
        procs = self.running.setdefault(command.node_id, {})
        if command.shard_id not in procs:
            procs[command.shard_id] = Process(command)

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._check(node_id, shard_id, False)
        proc = self.running.get(node_id, {}).get(shard_id)
        if proc is not None:
            proc.stopping = True

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._check(node_id, shard_id, False)

    def connected_nodes(self) -> list[str]:
        return sorted(self.connected)


NODES = 5
node_ix = st.integers(0, NODES - 1)
events = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 120)),
        st.tuples(st.just("ready"), st.integers(0, 40)),
        st.tuples(st.just("fail"), st.integers(0, 40)),
        st.tuples(st.just("confirm"), st.integers(0, 40)),
        st.tuples(st.just("silence"), node_ix),
        st.tuples(st.just("back"), node_ix),
        st.tuples(st.just("scale"), st.integers(0, 6)),
        st.tuples(st.just("drain"), node_ix),
        st.tuples(st.just("uncordon"), node_ix),
        st.tuples(st.just("long_silence"), node_ix),
    ),
    max_size=40,
)


class Scenario:
    def __init__(self, test: SynchronousTestCase, gpus: int, one: int, big: int):
        self.test = test
        self.clock = Clock()
        self.inventory = Inventory()
        self.ids = [f"n{i}" for i in range(NODES)]
        for i, n in enumerate(self.ids):
            # Two nodes share a host, as agents of a local fleet do.
            address = "127.0.0.1" if i < 2 else f"10.0.0.{i}"
            self.inventory.upsert(sim_node(n, gpus=gpus, address=address,
                                           fabrics={"ib0": f"192.168.0.{i}"}))
        self.agents = Agents(test, self.inventory, connected=set(self.ids))
        self.rec = Reconciler(
            catalog({"demo": ("one", one), "big": ("two-node", big)}),
            self.inventory, self.clock, self.agents, adoption_grace=5,
            fleet_state=KeptState(None), suspect_after=15, lost_after=60,
        )
        self.agents.rec = self.rec
        self.alive = set(self.ids)
        for n in self.ids:
            self.register(n)

    def register(self, node_id: str) -> None:
        procs = self.agents.running.get(node_id, {})
        listed = [
            ReportedShard(node_id, sid, p.command.replica_id, p.command.model, p.command.profile,
                          p.command.rank, p.command.gpu_indices, p.command.port, p.state,
                          p.command.world_size)
            for sid, p in sorted(procs.items()) if not p.stopping
        ]
        self.rec.adopt(node_id, listed)
        self.rec.node_registered(node_id)
        self.clock.advance(0)

    def procs(self, pred: Any) -> list[tuple[str, str, Process]]:
        return [
            (n, sid, p)
            for n in sorted(self.agents.running)
            for sid, p in sorted(self.agents.running[n].items())
            if pred(p) and n in self.alive
        ]

    def report(self, node_id: str, shard_id: str, proc: Process, state: str) -> None:
        self.rec.on_shard_status(ShardReport(node_id, proc.command.replica_id, shard_id, state,
                                             exit_code=1 if state == "failed" else 0))
        self.clock.advance(0)

    def apply(self, event: tuple[str, int]) -> None:
        kind, arg = event
        if kind == "step":
            for _ in range(arg):
                self.clock.advance(1)
                for n in self.alive:
                    self.inventory.touch(n, self.clock.seconds())
                self.rec.run_pass()
        elif kind in ("ready", "fail", "confirm"):
            if kind == "confirm":
                candidates = self.procs(lambda p: p.stopping)
            else:
                candidates = self.procs(lambda p: not p.stopping and p.state != "ready"
                                        if kind == "ready" else not p.stopping)
            if not candidates:
                return
            node_id, sid, proc = candidates[arg % len(candidates)]
            if kind == "ready":
                proc.state = "ready"
                self.report(node_id, sid, proc, "ready")
            else:
                del self.agents.running[node_id][sid]
                self.report(node_id, sid, proc, "stopped" if kind == "confirm" else "failed")
        elif kind in ("silence", "long_silence"):
            n = self.ids[arg]
            self.alive.discard(n)
            self.agents.connected.discard(n)
            if kind == "long_silence":
                self.apply(("step", 70))
        elif kind == "back":
            n = self.ids[arg]
            if n not in self.alive:
                self.alive.add(n)
                self.agents.connected.add(n)
                self.inventory.touch(n, self.clock.seconds())
                self.register(n)
        elif kind == "scale":
            self.rec.scale("demo", arg)
        elif kind == "drain":
            self.rec.drain_node(self.ids[arg])
            self.clock.advance(0)
        elif kind == "uncordon":
            self.rec.uncordon(self.ids[arg])
            self.clock.advance(0)

    def check(self) -> None:
        # No replica has two live copies of a shard anywhere in the fleet
        # (a process told to stop counts as live until it has ended).
        live: dict[tuple[str, int], list[str]] = {}
        for n, procs in self.agents.running.items():
            for sid, p in procs.items():
                live.setdefault((p.command.replica_id, p.command.rank), []).append(f"{n}/{sid}")
        for key, where in live.items():
            self.test.assertEqual(len(where), 1, f"replica {key[0]} rank {key[1]} runs at {where}")
        # The control plane holds at most one shard per rank of a replica,
        # each in the node index it names.
        st_ = self.rec.state
        for rep in st_.replicas.values():
            for rank, shard in rep.shards.items():
                self.test.assertEqual(shard.rank, rank)
                self.test.assertIn(shard.id, st_.node_shards.get(shard.node_id, ()))
        # No two processes on one host were given the same port, even where
        # the control plane forgot one that may still run.
        ports: dict[tuple[str, int], str] = {}
        for n, procs in self.agents.running.items():
            host = self.inventory.peek(n).address  # type: ignore[union-attr]
            for sid, p in procs.items():
                key = (host, p.command.port)
                self.test.assertNotIn(key, ports, f"{sid} on {n} got the port of {ports.get(key)}")
                ports[key] = sid
        # No two shards the control plane holds share a port on a host.
        seen: set[tuple[str, int]] = set()
        for shard in st_.shards.values():
            self.test.assertNotIn((shard.host, shard.port), seen)
            seen.add((shard.host, shard.port))


class ReconcilerProperties(SynchronousTestCase):
    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.integers(2, 8), st.integers(0, 4), st.integers(0, 1), events)
    def test_invariants(self, gpus: int, one: int, big: int, evs: list[tuple[str, int]]) -> None:
        """
        For random fleets and event sequences: no replica ever has two live
        copies of a shard, every command names a node and a shard that
        exist, and the control plane never holds two shards on one port of
        a host.
        """
        sc = Scenario(self, gpus, one, big)
        sc.apply(("step", 6))
        sc.check()
        for ev in evs:
            sc.apply(ev)
            sc.check()
