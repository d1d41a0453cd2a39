"""
One model's waiters in the admission queue (L{llmgw.gateway.admission}):
a L{Waiter} per request, held in a L{FairQueue} that serves client keys in
turn. Every operation is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from twisted.internet.interfaces import IDelayedCall

from llmgw.gateway import errors


class Waiter:
    """
    One request in a queue. C{go} sends it on (to a replica); C{refuse}
    answers it with an error; C{request} has the C{on_lost} hook its
    connection calls if the client goes away; C{size} is the bytes it holds
    while it waits (its body), counted against the queue's byte budgets.
    """

    __slots__ = ("model", "who", "request", "go", "refuse", "since", "size", "timer", "done", "kept")

    def __init__(
        self,
        model: str,
        who: str,
        request: Any,
        go: Callable[[], None],
        refuse: Callable[[errors.GatewayError], None],
        since: float,
        size: int = 0,
    ):
        self.model = model
        self.who = who
        self.request = request
        self.go = go
        self.refuse = refuse
        self.since = since
        self.size = size
        self.timer: IDelayedCall | None = None
        self.done = False
        #: Kept past its queue timeout while room was made for its model.
        self.kept = False


class FairQueue:
    """
    One model's waiters: a sub-queue per key, served one key at a time in
    turn (round robin), each sub-queue first come, first served.
    """

    def __init__(self) -> None:
        #: key -> its waiters, oldest first; keys in the order of their turn
        self._keys: OrderedDict[str, dict[Waiter, None]] = OrderedDict()
        #: n -> the keys holding exactly n waiters
        self._by_size: dict[int, dict[str, None]] = {}
        self._longest = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def count(self, key: str) -> int:
        sub = self._keys.get(key)
        return len(sub) if sub is not None else 0

    def _resize(self, key: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_size[old]
            del bucket[key]
            if not bucket:
                del self._by_size[old]
        if new:
            self._by_size.setdefault(new, {})[key] = None
        if new > self._longest:
            self._longest = new
        while self._longest and self._longest not in self._by_size:
            self._longest -= 1

    def push(self, w: Waiter) -> None:
        sub = self._keys.get(w.who)
        if sub is None:
            sub = self._keys[w.who] = {}
        sub[w] = None
        self.size += 1
        self._resize(w.who, len(sub) - 1, len(sub))

    def pop(self) -> Waiter | None:
        """
        The next waiter in fair order, removed; C{None} when empty.
        """
        if not self._keys:
            return None
        key, sub = next(iter(self._keys.items()))
        w = next(iter(sub))
        del sub[w]
        self.size -= 1
        if sub:
            self._keys.move_to_end(key)
        else:
            del self._keys[key]
        self._resize(key, len(sub) + 1, len(sub))
        return w

    def remove(self, w: Waiter) -> bool:
        sub = self._keys.get(w.who)
        if sub is None or w not in sub:
            return False
        del sub[w]
        self.size -= 1
        if not sub:
            del self._keys[w.who]
        self._resize(w.who, len(sub) + 1, len(sub))
        return True

    def longest(self) -> tuple[str, int] | None:
        """
        A key holding the most waiters, and how many; C{None} when empty.
        """
        if not self._longest:
            return None
        return next(iter(self._by_size[self._longest])), self._longest

    def newest(self, key: str) -> Waiter:
        return next(reversed(self._keys[key]))

    def __iter__(self) -> Iterator[Waiter]:
        for sub in list(self._keys.values()):
            yield from list(sub)
