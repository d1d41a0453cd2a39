"""
The reconciler's event log: every decision that changes something, kept in
a bounded ring so that a long-running control plane holds a fixed amount.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from twisted.logger import Logger

#: How much of a failed shard's last output an event keeps.
MAX_OUTPUT = 4096


@dataclass(frozen=True)
class Event:
    """
    One decision. C{time} is the control plane's clock (wall-clock seconds
    under the reactor); C{seq} increases by one per event, so a reader can
    ask for what follows the last event it saw even when times repeat.
    """

    seq: int
    time: float
    kind: str
    node: str = ""
    replica: str = ""
    shard: str = ""
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    last_output: str | None = None
    #: A failure's crash class (C{shard_failed}); absent from other events.
    crash_class: str | None = None

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        if self.crash_class is None:
            del out["crash_class"]
        return out


class EventLog:
    """
    The newest C{limit} events, and a count of every event ever logged by
    kind (for metrics; the counts are not bounded by the ring).
    """

    def __init__(self, limit: int = 10000):
        self._ring: collections.deque[Event] = collections.deque(maxlen=limit)
        self._seq = 0
        self.counts: collections.Counter[str] = collections.Counter()

    def add(
        self,
        time: float,
        kind: str,
        node: str = "",
        replica: str = "",
        shard: str = "",
        reason: str = "",
        exit_code: int | None = None,
        signal: int | None = None,
        last_output: str | None = None,
        crash_class: str | None = None,
    ) -> Event:
        self._seq += 1
        if last_output is not None and len(last_output) > MAX_OUTPUT:
            last_output = last_output[-MAX_OUTPUT:]
        event = Event(self._seq, time, kind, node, replica, shard, reason, exit_code, signal, last_output,
                      crash_class)
        self._ring.append(event)
        self.counts[kind] += 1
        return event

    def since(self, time: float = 0.0, seq: int = 0) -> list[Event]:
        """
        Events newer than C{time} and after C{seq}, oldest first.
        """
        out: list[Event] = []
        for event in reversed(self._ring):
            if event.time <= time or event.seq <= seq:
                break
            out.append(event)
        out.reverse()
        return out

    def __iter__(self) -> Iterator[Event]:
        return iter(self._ring)

    def __len__(self) -> int:
        return len(self._ring)


def log_event(log: Logger, level: str, ev: Event) -> None:
    """
    Log C{ev} at C{level} ("info", "warn", ...): one line naming its
    node, replica and shard where it has them, with every field structured.
    """
    parts = [f"{k}={{{k}}}" for k in ("node", "replica", "shard") if getattr(ev, k)]
    if ev.reason:
        parts.append("({reason})")
    getattr(log, level)(
        " ".join([f"{ev.kind}:", *parts]), kind=ev.kind, node=ev.node, replica=ev.replica,
        shard=ev.shard, reason=ev.reason, exit_code=ev.exit_code, signal=ev.signal,
    )
