"""
Which connected nodes' certificates the operator is told about, as a pure
decision: those that end within L{NOTICE_BEFORE}, each at most once per
L{NOTICE_EVERY}, however often the control plane looks.
"""

from __future__ import annotations

from collections.abc import Iterable

#: A node's certificate closer than this to its end is noticed, in seconds.
NOTICE_BEFORE = 7 * 86400.0
#: The same node is noticed again after this long, in seconds.
NOTICE_EVERY = 86400.0


class ExpiryNotices:
    """
    Remembers when each node was last noticed; forgets a node once it is no
    longer close to its end (renewed) or no longer given (disconnected).
    """

    def __init__(self, before: float = NOTICE_BEFORE, every: float = NOTICE_EVERY):
        self.before = before
        self.every = every
        self._last: dict[str, float] = {}

    def due(self, nodes: Iterable[tuple[str, float]], now: float) -> list[tuple[str, float]]:
        """
        The C{(node, not_after)} of C{nodes} (connected nodes and their
        certificates' ends, Unix seconds; 0: unknown) to tell of at C{now},
        soonest first.
        """
        out: list[tuple[str, float]] = []
        close: set[str] = set()
        for node_id, not_after in nodes:
            if not_after <= 0 or not_after - now >= self.before:
                continue
            close.add(node_id)
            last = self._last.get(node_id)
            if last is None or now - last >= self.every:
                self._last[node_id] = now
                out.append((node_id, not_after))
        for gone in set(self._last) - close:
            del self._last[gone]
        return sorted(out, key=lambda p: (p[1], p[0]))
