"""
Large request bodies parsed in slices, so that none holds the reactor.

A body that L{sliced} picks (over L{AT_ONCE_BYTES} bytes, or with more
than L{AT_ONCE_COMMAS} commas) is parsed by
L{llmgw.jsonslices.load_json_sliced}, one slice a reactor turn, while its
request waits; one body at a time (the reactor runs every due call of a
turn together, so two at once would double the stall), the others queued
in arrival order up to L{MAX_WAITING_BYTES}. Past that a body is refused
(503 with C{Retry-After}) rather than held.

Of a sliced body only a bounded sample of each kept top-level value is
built (L{KEPT_ITEMS} values, L{KEPT_CHARS} characters): what the gateway
reads from it (C{model}, C{user}, the head of C{messages} or C{prompt})
comes first, and millions of small values would cost their building, the
garbage collector's passes over them and their freeing, each in one turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Generator
from typing import Any, Final

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.jsonslices import load_json_sliced
from llmgw.untrusted import JSONInputError

#: Bodies up to this size with few commas (so few values: a value but the
#: first of its container follows one) are parsed at once: a few
#: milliseconds at most, the prefix policy's key included; their bytes
#: are in long strings, which the C parser reads quickly.
AT_ONCE_BYTES: Final = 256 * 1024
AT_ONCE_COMMAS: Final = 4096
#: Values put in the containers of each kept top-level value of a sliced
#: body, at most (see L{llmgw.jsonslices.load_json_sliced}).
KEPT_ITEMS: Final = 2048
#: Characters of the strings of each kept top-level value, at most.
KEPT_CHARS: Final = 1024 * 1024
#: Bytes of bodies waiting for their turn to be parsed, at most.
MAX_WAITING_BYTES: Final = 64 * 1024 * 1024


def sliced(raw: bytes) -> bool:
    """
    Whether C{raw} is parsed in slices (L{SlicedParses}) rather than at
    once: parsing it at once could hold the reactor for more than a few
    milliseconds.
    """
    return len(raw) > AT_ONCE_BYTES or raw.count(b",") > AT_ONCE_COMMAS


class _Job:
    __slots__ = ("size", "parse", "done", "failed", "cancelled")

    def __init__(
        self,
        size: int,
        parse: Generator[None, None, Any],
        done: Callable[[Any], None],
        failed: Callable[[JSONInputError], None],
    ):
        self.size = size
        self.parse = parse
        self.done = done
        self.failed = failed
        self.cancelled = False


class SlicedParses:
    """
    Parses large JSON bodies one slice a reactor turn, one body at a time.
    """

    def __init__(self, clock: IReactorTime, max_waiting_bytes: int = MAX_WAITING_BYTES):
        self.clock = clock
        self.max_waiting_bytes = max_waiting_bytes
        self._waiting: deque[_Job] = deque()
        self._waiting_bytes = 0
        self._running: _Job | None = None
        self._next: IDelayedCall | None = None

    @property
    def waiting_bytes(self) -> int:
        return self._waiting_bytes

    def parse(
        self,
        raw: bytes,
        done: Callable[[Any], None],
        failed: Callable[[JSONInputError], None],
        unique: Collection[str] | None = (),
        keep: Collection[str] | None = None,
    ) -> Callable[[], None] | None:
        """
        Parse C{raw} as L{llmgw.untrusted.load_json} does (C{keep}: as
        L{load_json_sliced}, each kept value sampled to L{KEPT_ITEMS} and
        L{KEPT_CHARS}), in later reactor turns, and call C{done} with the
        value or C{failed} with the refusal.

        @return: a function that forgets the body (its client has gone), or
            C{None} when the queue holds too many bytes to take it: nothing
            will be called.
        """
        if self._running is not None and self._waiting_bytes + len(raw) > self.max_waiting_bytes:
            return None
        parse = load_json_sliced(raw, unique=unique, keep=keep, kept_items=KEPT_ITEMS, kept_chars=KEPT_CHARS)
        job = _Job(len(raw), parse, done, failed)
        self._waiting.append(job)
        self._waiting_bytes += job.size
        if self._running is None:
            self._start_next()

        def cancel() -> None:
            job.cancelled = True
            job.parse.close()

        return cancel

    def _start_next(self) -> None:
        while self._waiting:
            job = self._waiting.popleft()
            self._waiting_bytes -= job.size
            if not job.cancelled:
                self._running = job
                self._next = self.clock.callLater(0, self._step)
                return
        self._running = None

    def _step(self) -> None:
        self._next = None
        job = self._running
        assert job is not None
        if job.cancelled:
            self._start_next()
            return
        try:
            next(job.parse)
        except StopIteration as stop:
            value = stop.value
            # The next body starts in a later turn, after this one's answer.
            self._start_next()
            job.done(value)
        except JSONInputError as e:
            self._start_next()
            job.failed(e)
        else:
            self._next = self.clock.callLater(0, self._step)
