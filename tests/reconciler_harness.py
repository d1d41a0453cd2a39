"""
A fleet of simulated nodes around a L{Reconciler}, driven by a C{Clock}
and a fake dispatcher, for the reconciler's tests.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from typing import Any

from twisted.internet.task import Clock

from llmgw.control.core.catalog import Catalog, parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import ReportedShard, ShardCommand, ShardReport
from llmgw.control.state.inventory import Inventory
from llmgw.routing import Demand
from llmgw.testing.simfleet import FakeDispatcher, sim_fleet

ONE_GPU = """
[profiles.one]
gpus_per_shard = 1
gpu_memory_mb = 1000
command = ["{python}", "-m", "llmgw.testing.fakemodel", "--port", "{port}", "--model", "{model}"]
startup_timeout_s = 60
drain_timeout_s = 10
stop_grace_s = 5

[profiles.two-node]
shards = 2
gpus_per_shard = 4
gpu_memory_mb = 1000
fabric = "ib0"
command = ["{python}", "-m", "srv", "--rank", "{rank}", "--world", "{world_size}", "--leader", "{leader}", "--gpus", "{gpus}"]
env = { MASTER = "{leader}" }
startup_timeout_s = 60
drain_timeout_s = 10
"""


def catalog(deployments: dict[str, tuple[str, int]], extra: str = "", path: str | None = None) -> Catalog:
    text = ONE_GPU + extra
    for model, (profile, replicas) in deployments.items():
        text += f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{profile}"\nreplicas = {replicas}\n'
    return parse_catalog(tomllib.loads(text), path=path)


class Fleet:
    """
    C{nodes} simulated nodes, each connected and registered.
    """

    def __init__(
        self,
        deployments: dict[str, tuple[str, int]],
        nodes: int = 4,
        gpus: int = 8,
        fabric: str = "ib0",
        grace: float = 30.0,
        inventory: Inventory | None = None,
        clock: Clock | None = None,
        register: bool = True,
        epoch: int = 1,
        fleet_state: KeptState | None = None,
        cat: Catalog | None = None,
        **kwargs: Any,
    ):
        self.clock = clock or Clock()
        self.inventory = inventory if inventory is not None else Inventory()
        if inventory is None:
            self.ids = sim_fleet(self.inventory, nodes, gpus=gpus, fabric=fabric, now=self.clock.seconds())
        else:
            self.ids = self.inventory.ids()
        self.dispatcher = FakeDispatcher(connected=set(self.ids))
        self.rec = Reconciler(
            cat or catalog(deployments),
            self.inventory,
            self.clock,
            self.dispatcher,
            epoch=epoch,
            adoption_grace=grace,
            fleet_state=fleet_state or KeptState(None),
            **kwargs,
        )
        self.alive: set[str] = set(self.ids)
        if register:
            for node_id in self.ids:
                self.rec.adopt(node_id, [])
                self.rec.node_registered(node_id)

    def register(self, node_id: str, shards: list[ReportedShard] | None = None) -> list[ReportedShard]:
        """
        What the agent service does on a node's Register: adoption, then
        the registration; the commands they decide go out after.
        """
        unclaimed = self.rec.adopt(node_id, shards or [])
        self.rec.node_registered(node_id)
        self.clock.advance(0)
        return unclaimed

    def step(self, seconds: float = 1.0, passes: int = 1) -> None:
        """
        Let C{passes} passes of C{seconds} each go by, the alive nodes
        heartbeating all along.
        """
        for _ in range(passes):
            self.clock.advance(seconds)
            now = self.clock.seconds()
            for node_id in self.alive:
                self.inventory.touch(node_id, now)
            self.rec.run_pass()
            # A pass that stopped at its budget is continued at once (the
            # service schedules that itself; tests do not start it).
            while self.rec.pass_unfinished:
                self.rec.run_pass()

    def past_grace(self) -> None:
        self.step(1.0, int(self.rec.adoption_grace) + 1)

    def report(self, cmd: ShardCommand | tuple[str, str], state: str, **kw: Any) -> None:
        if isinstance(cmd, ShardCommand):
            node_id, shard_id = cmd.node_id, cmd.shard_id
        else:
            node_id, shard_id = cmd
        shard = self.rec.shard_recs[shard_id]
        self.rec.on_shard_status(ShardReport(node_id, shard.replica_id, shard_id, state, **kw))
        # What the report decided is sent once the handler has returned.
        self.clock.advance(0)

    def make_ready(self, commands: Iterable[ShardCommand] | None = None) -> None:
        for cmd in list(commands if commands is not None else self.dispatcher.starts):
            shard = self.rec.shard_recs.get(cmd.shard_id)
            if shard is not None and shard.state != "ready" and not shard.stopping:
                self.report(cmd, "starting")
                self.report(cmd, "ready")

    def confirm_stops(self) -> None:
        for node_id, shard_id in list(self.dispatcher.stops):
            if shard_id in self.rec.shard_recs:
                self.report((node_id, shard_id), "stopped")

    def running(self, node_id: str) -> list[ReportedShard]:
        """
        What the node's agent would list in a Register now.
        """
        out = []
        for sid in sorted(self.rec.state.node_shards.get(node_id, ())):
            s = self.rec.shard_recs[sid]
            rep = self.rec.replica_recs[s.replica_id]
            out.append(
                ReportedShard(
                    node_id=node_id,
                    shard_id=sid,
                    replica_id=rep.id,
                    model=rep.model,
                    profile=rep.profile,
                    rank=s.rank,
                    gpu_indices=s.gpus,
                    port=s.port,
                    state=s.state,
                    world_size=rep.world_size,
                )
            )
        return out

    def ready_replicas(self, model: str) -> list[str]:
        return [r.replica_id for r in self.rec.routes(model) if not r.draining]

    def bring_up(self, model: str) -> str:
        """Ask for C{model} (a gateway's demand), report its one replica ready: its id."""
        self.step()
        self.rec.report_demand("gw", {model: Demand(1, 0)})
        self.step()
        self.make_ready()
        self.step(passes=5)
        [rid] = self.ready_replicas(model)
        return rid
