"""
Writing the join-token book without holding the reactor: each write (a
whole-file rewrite, two fsyncs) runs in a thread when one is given, and the
uses counted while one write is under way all go into the next, so a burst
of joins costs a few writes rather than one each.

A join's answer waits for L{TokenWrites.written}: a node is told it joined
only once its token's use is on disk, as when each join wrote the file
itself.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.python.failure import Failure

from llmgw.control.core.jointokens import TokenFile

#: Runs a function in a thread; fires with its result.
InThread = Callable[[Callable[[], None]], "Deferred[None]"]


class TokenWrites:
    """
    Writes of C{tokens}' book, one at a time, coalesced. Without
    C{in_thread} each write is done at once, on the caller's thread (what
    tests and tools want).
    """

    def __init__(self, tokens: TokenFile, in_thread: InThread | None = None):
        self.tokens = tokens
        self.in_thread = in_thread
        #: Writes done since start.
        self.writes = 0
        # Told when the write under way ends (None: no write under way).
        self._current: list[Deferred[None]] | None = None
        # Told when the next write ends; it starts when the current one does.
        self._next: list[Deferred[None]] = []
        self._dirty = False

    @property
    def busy(self) -> bool:
        """Whether a change is not on disk yet (the file on disk is older than the book)."""
        return self._current is not None or self._dirty

    def save(self) -> None:
        """The book changed: write it, now or once the write under way ends."""
        self._dirty = True
        if self._current is None:
            self._write()

    def written(self) -> Deferred[None]:
        """
        Fires once every change L{save}d so far is on disk; fails if the
        write that carries the latest one failed (a change whose write
        failed is written again for the next caller).
        """
        if not self.busy:
            return succeed(None)
        d: Deferred[None] = Deferred()
        if self._dirty:
            self._next.append(d)
            if self._current is None:
                self._write()
        else:
            assert self._current is not None
            self._current.append(d)
        return d

    def _write(self) -> None:
        # The text is taken here, on the reactor: the book is not thread-safe.
        text = self.tokens.text()
        self._dirty = False
        self._current, self._next = self._next, []
        if self.in_thread is None:
            d = maybeDeferred(self.tokens.write, text)
        else:
            d = self.in_thread(lambda: self.tokens.write(text))
        d.addBoth(self._done)

    def _done(self, result: None | Failure) -> None:
        waiting, self._current = self._current or [], None
        self.writes += 1
        failed = isinstance(result, Failure)
        if failed:
            self._dirty = True  # what it carried is not on disk
        for d in waiting:
            if failed:
                d.errback(result)
            else:
                d.callback(None)
        # After a failure, written again only for someone who waits: a
        # full disk is not retried in a loop.
        if self._dirty and (not failed or self._next):
            self._write()
