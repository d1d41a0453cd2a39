"""
A status sink that records everything and claims every adopted shard.

Tests use it as a fake reconciler; a control plane without a catalog uses
it too, so that nothing an agent runs is stopped by accident.
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from llmgw.control.state.interfaces import IDispatcher, IStatusSink, ReportedShard, ShardReport


@implementer(IStatusSink)
class RecordingSink:
    def __init__(self, claim: bool = True) -> None:
        #: Whether adopted shards are claimed (C{True}) or all handed back.
        self.claim = claim
        self.adopted: list[tuple[str, list[ReportedShard]]] = []
        self.statuses: list[ShardReport] = []
        self.registered: list[str] = []
        self.owners: dict[str, str] = {}
        #: With both set, shards not claimed are stopped through
        #: C{dispatcher} once the handler has returned, as the reconciler
        #: does.
        self.dispatcher: IDispatcher | None = None
        self.clock: IReactorTime | None = None

    def adopt(self, node_id: str, shards: list[ReportedShard]) -> list[ReportedShard]:
        # A node that runs nothing is not recorded: tests count real reports.
        if shards:
            self.adopted.append((node_id, list(shards)))
        if not self.claim:
            dispatcher, clock = self.dispatcher, self.clock
            if dispatcher is not None and clock is not None and shards:
                ids = [s.shard_id for s in shards]

                def stop() -> None:
                    for shard_id in ids:
                        dispatcher.stop_shard(node_id, shard_id)

                clock.callLater(0, stop)
            return list(shards)
        for s in shards:
            self.owners[s.shard_id] = node_id
        return []

    def on_shard_status(self, report: ShardReport) -> None:
        self.statuses.append(report)

    def shard_node(self, shard_id: str) -> str | None:
        return self.owners.get(shard_id)

    def node_registered(self, node_id: str) -> None:
        self.registered.append(node_id)

    def place(self, shard_id: str, node_id: str) -> None:
        """
        Record that the control plane put C{shard_id} on C{node_id}.
        """
        self.owners[shard_id] = node_id
