"""
What every follower of etcd shares (L{EtcdFollowing}): started, it reads,
then watches from the revision it read at; a failed read or an ended watch
reads again after C{retry_interval}; stopped, it cancels what is under way.
Each start or stop begins a new generation, and an answer from an older
one is dropped, so a late read can never undo a stop.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime


class EtcdFollowing:
    """
    The start, stop and retry of a follower; subclasses implement
    L{_read} (one read of a generation, which starts the watch it keeps in
    C{_watch}) and may extend L{_starting}.
    """

    def __init__(self, clock: IReactorTime, store: Any, retry_interval: float = 1.0):
        self.clock = clock
        self.store = store
        self.retry_interval = retry_interval
        #: Whether it is started.
        self.following = False
        self._generation = 0
        self._watch: Any = None
        self._retry: IDelayedCall | None = None
        self._reading: defer.Deferred[Any] | None = None

    def start(self) -> None:
        if self.following:
            return
        self.following = True
        self._starting()
        self._generation += 1
        self._read(self._generation)

    def stop(self) -> None:
        self.following = False
        self._generation += 1
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._reading is not None and not self._reading.called:
            self._reading.cancel()
        self._reading = None
        if self._watch is not None:
            w, self._watch = self._watch, None
            w.cancel()

    def _starting(self) -> None:
        """Called at each start, before the first read."""

    def _current(self, generation: int) -> bool:
        return self.following and generation == self._generation

    def _later(self, generation: int) -> None:
        if self._current(generation) and self._retry is None:
            self._retry = self.clock.callLater(self.retry_interval, self._again, generation)

    def _again(self, generation: int) -> None:
        self._retry = None
        self._read(generation)

    def _read(self, generation: int) -> None:
        raise NotImplementedError
