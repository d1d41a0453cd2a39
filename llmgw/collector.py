"""
Tuning CPython's cyclic garbage collector for a server process of llmgw's
own (the control plane, the standalone gateway), never for an embedder's.
"""

from __future__ import annotations

import gc
from typing import Any

from twisted.application.service import Service

#: The cyclic collector's young-generation threshold in a control-plane
#: process (Python's is 700): see L{CollectorTuning}.
DEFAULT_GC_THRESHOLD = 50_000


class CollectorTuning(Service):
    """
    Tunes CPython's cyclic garbage collector for a process that holds tens
    of thousands of long-lived connections.

    With Python's thresholds, a registration storm (10,000 agents, each
    leaving a few hundred tracked objects behind) sets off a full collection
    each time the heap grows by a quarter, every one of them scanning every
    connection so far: over a second of CPU in a 10,000-agent storm on a
    2-core machine, about a tenth of the control plane's work. So, at start:
    one full collection, then C{gc.freeze()}, which takes the start-up heap
    (modules, the catalog, the TLS contexts) out of every later scan; and a
    young generation of C{threshold} objects instead of 700, so that a storm
    runs few young collections and next to no full ones. Garbage cycles wait
    a little longer to be freed; memory held by live objects is unchanged.
    On stop, Python's thresholds come back and the heap is unfrozen.

    C{threshold=None} freezes the start-up heap and keeps Python's
    thresholds (the standalone gateway: its requests make no cyclic garbage,
    and a full collection walking its start-up heap cost tens of
    milliseconds of a proxied request's tail latency); 0 or less turns the
    tuning off.

    Only for a process of its own (C{makeService} without a reactor, as
    twistd calls it): the collector is process-wide.
    """

    def __init__(self, threshold: int | None = DEFAULT_GC_THRESHOLD):
        self.threshold = threshold
        self._previous: tuple[int, ...] | None = None

    def startService(self) -> None:
        super().startService()
        if self.threshold is not None and self.threshold <= 0:
            return
        self._previous = gc.get_threshold()
        gc.collect()
        gc.freeze()
        if self.threshold is not None:
            gc.set_threshold(self.threshold, *self._previous[1:])

    @property
    def tuned(self) -> bool:
        return self._previous is not None

    def freeze_grown(self) -> None:
        """
        Take what the heap grew by since the last freeze out of every later
        scan (C{gc.freeze()}), while tuned: the reconciler calls this after
        its fleet grew by a thousand shards or more. Without it, a cold fill
        of 10,000 nodes set off young and full collections of 20 to 150 ms
        inside passes whose budget is 20 ms, each scanning every record
        made so far; a freeze itself costs microseconds.

        Frozen objects are still freed by reference counting when dropped
        (the fleet's records hold no reference cycles); only cyclic garbage
        that happens to be pending at a freeze waits until the heap is
        unfrozen at stop. Freezes come only with net growth of the fleet,
        so their number is bounded by its size, not by its churn.
        """
        if self._previous is not None:
            gc.freeze()

    def stopService(self) -> Any:
        super().stopService()
        if self._previous is not None:
            gc.set_threshold(*self._previous)
            gc.unfreeze()
            self._previous = None
        return None
