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
    The requests waiting for a replica's first byte, and which replica each
    waits on.

    Kept by request, not by replica: a request comes and goes with one
    store and one pop, on every request's path; the by-replica views are
    made when asked (once a second, and when the routing table changes).
    """

    log = Logger()

    def __init__(self) -> None:
        #: Each request waiting and the replica it waits on. A proxied
        #: request stores and pops its own entry here itself (L{add} and
        #: L{answered} inline, on every request's path).
        self.calls: dict[IReplicaLeft, str] = {}
        #: Told of each first byte (L{llmgw.gateway.firstbyte.FirstByteWatch.answered}).
        self.on_answer: Callable[[str, IReplicaLeft], None] | None = None

    def add(self, replica_id: str, call: IReplicaLeft) -> None:
        self.calls[call] = replica_id

    def discard(self, replica_id: str, call: IReplicaLeft) -> None:
        if self.calls.get(call) == replica_id:
            del self.calls[call]

    def answered(self, replica_id: str, call: IReplicaLeft) -> None:
        """
        The first byte of C{call}'s answer came from C{replica_id}.
        """
        calls = self.calls
        waits_on = calls.pop(call, replica_id)
        if waits_on != replica_id:
            # It waits on another replica (a later attempt): it still does.
            calls[call] = waits_on
        if self.on_answer is not None:
            self.on_answer(replica_id, call)

    def waiting(self, replica_id: str) -> int:
        return sum(1 for r in self.calls.values() if r == replica_id)

    def by_replica(self) -> list[tuple[str, list[IReplicaLeft]]]:
        """
        Each replica with requests waiting, and those requests (a copy).
        """
        out: dict[str, list[IReplicaLeft]] = {}
        for call, replica_id in self.calls.items():
            out.setdefault(replica_id, []).append(call)
        return list(out.items())

    def move(self, replica_id: str) -> int:
        """
        Send every request waiting on C{replica_id} elsewhere; returns how many.
        """
        calls = [c for c, r in self.calls.items() if r == replica_id]
        for call in calls:
            del self.calls[call]
        for call in calls:
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
        for replica_id in sorted({r for r in self.calls.values() if r not in keep}):
            self.log.warn("replica {replica} left the routing table with {n} request(s) "
                          "not answered yet: sending them elsewhere", replica=replica_id,
                          n=self.waiting(replica_id))
            told += self.move(replica_id)
        return told
