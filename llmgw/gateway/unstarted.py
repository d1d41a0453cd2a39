"""
Requests sent to a replica that have had no byte of its answer yet, per
replica (DESIGN §23). When a replica leaves the routing table (the control
plane found it wedged, or it failed), each of them is told so and goes to
another replica at once, rather than waiting out the first-byte timeout on
an engine that may never answer: a request that had not started costs its
client no error.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from twisted.logger import Logger


class IReplicaLeft(Protocol):
    def replica_left(self) -> None:
        """
        The replica this request waits on left the routing table.
        """


class Unstarted:
    """
    Replica id -> the requests waiting for its first byte.
    """

    log = Logger()

    def __init__(self) -> None:
        self._by_replica: dict[str, set[IReplicaLeft]] = {}
        #: Told of each first byte (L{llmgw.gateway.firstbyte.FirstByteWatch.answered}).
        self.on_answer: Callable[[str, IReplicaLeft], None] | None = None

    def add(self, replica_id: str, call: IReplicaLeft) -> None:
        calls = self._by_replica.get(replica_id)
        if calls is None:
            calls = self._by_replica[replica_id] = set()
        calls.add(call)

    def discard(self, replica_id: str, call: IReplicaLeft) -> None:
        # A replica's set stays when it empties (it is made once, not per
        # request); L{left} drops those of replicas gone from the table.
        calls = self._by_replica.get(replica_id)
        if calls is not None:
            calls.discard(call)

    def answered(self, replica_id: str, call: IReplicaLeft) -> None:
        """
        The first byte of C{call}'s answer came from C{replica_id}.
        """
        calls = self._by_replica.get(replica_id)
        if calls is not None:
            calls.discard(call)
        if self.on_answer is not None:
            self.on_answer(replica_id, call)

    def waiting(self, replica_id: str) -> int:
        return len(self._by_replica.get(replica_id, ()))

    def by_replica(self) -> list[tuple[str, list[IReplicaLeft]]]:
        """
        Each replica with requests waiting, and those requests (a copy).
        """
        return [(r, list(calls)) for r, calls in self._by_replica.items() if calls]

    def move(self, replica_id: str) -> int:
        """
        Send every request waiting on C{replica_id} elsewhere; returns how many.
        """
        calls = self._by_replica.pop(replica_id, set())
        for call in list(calls):
            try:
                call.replica_left()
            except Exception:
                self.log.failure("moving a request off replica {replica} failed",
                                 replica=replica_id)
        return len(calls)

    def left(self, keep: Collection[str]) -> int:
        """
        Tell every request waiting on a replica not in C{keep} (the routing
        table's replicas now) that its replica left; returns how many.
        """
        told = 0
        for replica_id in [r for r in self._by_replica if r not in keep]:
            if not self._by_replica[replica_id]:
                del self._by_replica[replica_id]
                continue
            self.log.warn("replica {replica} left the routing table with {n} request(s) "
                          "not answered yet: sending them elsewhere", replica=replica_id,
                          n=self.waiting(replica_id))
            told += self.move(replica_id)
        return told
