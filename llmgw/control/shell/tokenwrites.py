"""
Writing what joins leave on disk without holding the reactor: the
join-token book (a whole-file rewrite, two fsyncs) and the certificates'
lines for C{issued.jsonl} (appended, one fsync), in one group commit run in
a thread when one is given. Everything changed while one commit is under
way, or within L{WINDOW} seconds of the start of the last one, goes into the
next: a burst of joins costs a few commits rather than one each, and a lone
join is written at once.

A join's answer waits for L{TokenWrites.written}: a node is told it joined
only once its token's use and its certificate's record are on disk. A
renewal's certificate waits the same way for its record.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.control.core.jointokens import TokenFile

#: Runs a function in a thread; fires with its result.
InThread = Callable[[Callable[[], Any]], "Deferred[Any]"]
#: Seconds from the start of one commit before the next may start: what
#: comes within it is written together. A commit costs about a millisecond
#: of CPU (three fsyncs) and, on a busy disk, over ten of wall time; at 200
#: joins a second this makes ten joins a commit, each answered at most
#: this much later.
WINDOW = 0.05


def append_lines(path: Path, lines: list[str]) -> None:
    """Append C{lines} (each ending in a newline) to C{path} and flush them to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


class TokenWrites:
    """
    Group commits of C{tokens}' book and of C{issued.jsonl} lines, one at a
    time, at most one per C{window} seconds of C{clock}. Without
    C{in_thread} each commit is done at once, on the caller's thread (what
    tests and tools want); without C{clock} there is no window.
    """

    log = Logger()

    def __init__(self, tokens: TokenFile, in_thread: InThread | None = None,
                 clock: IReactorTime | None = None, window: float = WINDOW):
        self.tokens = tokens
        self.in_thread = in_thread
        self.clock = clock
        self.window = window
        #: Commits done since start.
        self.writes = 0
        # Told when the commit under way ends (None: no commit under way).
        self._current: list[Deferred[None]] | None = None
        # Told when the next commit ends; it starts when the current one does.
        self._next: list[Deferred[None]] = []
        self._dirty = False
        # issued.jsonl lines not handed to a commit yet, by file.
        self._lines: dict[Path, list[str]] = {}
        self._timer: IDelayedCall | None = None
        self._started = float("-inf")

    @property
    def busy(self) -> bool:
        """Whether a change is not on disk yet (the file on disk is older than the book)."""
        return self._current is not None or self._dirty or bool(self._lines)

    def save(self) -> None:
        """The book changed: write it, now or with the next commit."""
        self._dirty = True
        self._kick()

    def record(self, path: Path, line: str) -> None:
        """
        Append C{line} (ending in a newline) to C{path} with the next commit,
        which L{save} or L{written} starts (so that a join's record and its
        token's use go in one).
        """
        self._lines.setdefault(path, []).append(line)

    def written(self) -> Deferred[None]:
        """
        Fires once every change L{save}d and line L{record}ed so far is on
        disk; fails if the commit that carries the book's latest change
        failed (a change whose write failed is written again for the next
        caller). A line that cannot be appended is logged, not failed: a
        node is not refused for it.
        """
        if not self.busy:
            return succeed(None)
        d: Deferred[None] = Deferred()
        if self._dirty or self._lines:
            self._next.append(d)
            self._kick()
        else:
            assert self._current is not None
            self._current.append(d)
        return d

    def _kick(self) -> None:
        if self._current is not None or self._timer is not None:
            return  # the commit under way, or the one timed, takes it
        wait = 0.0 if self.clock is None else self._started + self.window - self.clock.seconds()
        if wait > 0:
            assert self.clock is not None
            self._timer = self.clock.callLater(wait, self._timed)
        else:
            self._write()

    def _timed(self) -> None:
        self._timer = None
        if self._dirty or self._lines:
            self._write()

    def _write(self) -> None:
        # Taken here, on the reactor: the book is not thread-safe.
        text = self.tokens.text() if self._dirty else None
        lines, self._lines = self._lines, {}
        self._dirty = False
        self._current, self._next = self._next, []
        if self.clock is not None:
            self._started = self.clock.seconds()

        def commit() -> tuple[list[str], Exception | None]:
            unrecorded = []
            for path, batch in lines.items():
                try:
                    append_lines(path, batch)
                except OSError as e:
                    # The lines go in the log: revoking a node by name needs its serial.
                    unrecorded.append(f"cannot record {len(batch)} issued certificates in {path} ({e}); "
                                      f"their lines: {''.join(batch).strip()}")
            if text is not None:
                try:
                    self.tokens.write(text)
                except Exception as e:
                    # Returned, not raised: the unrecorded lines are logged all the same.
                    return unrecorded, e
            return unrecorded, None

        if self.in_thread is None:
            d = maybeDeferred(commit)
        else:
            d = self.in_thread(commit)
        d.addBoth(self._done, text is not None)

    def _done(self, outcome: tuple[list[str], Exception | None] | Failure, had_book: bool) -> None:
        waiting, self._current = self._current or [], None
        self.writes += 1
        result: None | Failure = outcome if isinstance(outcome, Failure) else None
        if isinstance(outcome, tuple):
            unrecorded, book_error = outcome
            for error in unrecorded:
                # Not a reason to refuse the nodes.
                self.log.error("{error}", error=error)
            if book_error is not None:
                result = Failure(book_error)
        failed = result is not None
        if failed and had_book:
            self._dirty = True  # what it carried is not on disk
        for d in waiting:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(None)
        # After a failure, written again only for someone who waits: a
        # full disk is not retried in a loop.
        if (self._dirty or self._lines) and (not failed or self._next):
            self._kick()
