"""
Which node holds which model's weights, as the agents report their caches.

Each agent lists its cache in its Register and again in a heartbeat when it
changed: per model its cache key, canonical source, size, state
(C{complete} or C{partial}: being fetched or left unfinished), last use and
revision, plus the cache's capacity and free room and the address of the
node's peer listener. L{ModelIndex} keeps the latest list per node and an
index from model key to the nodes holding it complete and those fetching
it, so placement and prefetch ask "who holds this?" without scanning every
node. A lost or removed node's report is dropped.

Plain data, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Models kept per node: a cache holds a handful; a buggy agent cannot grow
#: the index without bound.
MAX_MODELS_PER_NODE = 256
#: Characters kept of a key, source or revision.
MAX_MODEL_TEXT = 512
#: Peers named in a StartShard or PrefetchModel at most.
MAX_PEERS = 4

COMPLETE, PARTIAL = "complete", "partial"

#: Placement's preference for a node, best first: it holds the model
#: complete, it is fetching it, it has nothing of it.
HOLDS, FETCHING, LACKS = 0, 1, 2


@dataclass(frozen=True, slots=True)
class CachedCopy:
    """
    One model in one node's cache, as the node reported it. C{last_used} is
    the agent's clock (seconds since the epoch).
    """

    key: str
    source: str = ""
    size: int = 0
    state: str = PARTIAL
    last_used: float = 0.0
    revision: str = ""

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    def as_dict(self) -> dict[str, object]:
        return {"key": self.key, "source": self.source, "size": self.size, "state": self.state,
                "last_used": self.last_used, "revision": self.revision}


def bounded(copies: Iterable[CachedCopy]) -> dict[str, CachedCopy]:
    """
    C{copies} by key: the first L{MAX_MODELS_PER_NODE} with a key, texts
    cut at L{MAX_MODEL_TEXT}, any state but C{complete} read as C{partial}.
    """
    out: dict[str, CachedCopy] = {}
    for c in copies:
        if len(out) >= MAX_MODELS_PER_NODE:
            break
        if not c.key:
            continue
        key = c.key[:MAX_MODEL_TEXT]
        out[key] = CachedCopy(key, c.source[:MAX_MODEL_TEXT], max(c.size, 0),
                              COMPLETE if c.state == COMPLETE else PARTIAL, c.last_used,
                              c.revision[:MAX_MODEL_TEXT])
    return out


@dataclass(frozen=True, slots=True)
class CacheRoom:
    """
    A node's cache: its capacity and free room in bytes (0: unknown, an
    agent without a cache or an older one).
    """

    capacity: int = 0
    free: int = 0


#: A node's cache before it says anything of it (shared: frozen).
_NO_ROOM = CacheRoom()


class ModelIndex:
    """
    The nodes' cache reports and the index over them.
    """

    def __init__(self) -> None:
        self._by_node: dict[str, dict[str, CachedCopy]] = {}
        self._room: dict[str, CacheRoom] = {}
        self._peer: dict[str, str] = {}
        #: model key -> nodes holding it complete, and nodes with a part.
        self._complete: dict[str, set[str]] = {}
        self._partial: dict[str, set[str]] = {}

    # -- writes ------------------------------------------------------------------

    def report(self, node_id: str, copies: Iterable[CachedCopy] | None,
               room: CacheRoom | None = None, peer_address: str | None = None) -> bool:
        """
        Take C{node_id}'s report: its whole cache (C{None}: unchanged), its
        room and its peer address (C{None}: unchanged). Returns whether
        anything placement looks at changed (which nodes hold which model
        and in what state, or the cache's capacity).
        """
        changed = False
        if copies is not None:
            new = bounded(copies) if copies else {}
            old = self._by_node.get(node_id)
            # Else an empty cache, as before: the report of most nodes most of the time.
            if old or new:
                old = old or {}
                if {k: c.state for k, c in old.items()} != {k: c.state for k, c in new.items()}:
                    changed = True
                self._unindex(node_id, old)
                if new:
                    self._by_node[node_id] = new
                else:
                    self._by_node.pop(node_id, None)
                for key, c in new.items():
                    (self._complete if c.complete else self._partial).setdefault(key, set()).add(node_id)
        if room is not None:
            before = self._room.get(node_id, _NO_ROOM)
            changed = changed or before.capacity != room.capacity
            self._room[node_id] = room
        if peer_address is not None:
            if peer_address:
                self._peer[node_id] = peer_address
            else:
                self._peer.pop(node_id, None)
        return changed

    def drop(self, node_id: str) -> bool:
        """
        Forget C{node_id}'s report (it is lost or removed); whether there
        was one.
        """
        old = self._by_node.pop(node_id, None)
        had = old is not None or node_id in self._room or node_id in self._peer
        if old is not None:
            self._unindex(node_id, old)
        self._room.pop(node_id, None)
        self._peer.pop(node_id, None)
        return had

    def _unindex(self, node_id: str, copies: dict[str, CachedCopy]) -> None:
        for key, c in copies.items():
            index = self._complete if c.complete else self._partial
            nodes = index.get(key)
            if nodes is not None:
                nodes.discard(node_id)
                if not nodes:
                    del index[key]

    # -- reads -------------------------------------------------------------------

    def rank(self, key: str, node_id: str) -> int:
        """
        L{HOLDS}, L{FETCHING} or L{LACKS}: how far C{node_id} is from having
        the model C{key} (L{LACKS} for an empty key).
        """
        if not key:
            return LACKS
        if node_id in self._complete.get(key, ()):
            return HOLDS
        if node_id in self._partial.get(key, ()):
            return FETCHING
        return LACKS

    def holders(self, key: str) -> set[str]:
        """
        The nodes holding C{key} complete (the index's own set: do not change it).
        """
        return self._complete.get(key, set())

    def fetching(self, key: str) -> set[str]:
        """
        The nodes holding part of C{key} (the index's own set: do not change it).
        """
        return self._partial.get(key, set())

    def size(self, key: str) -> int | None:
        """
        C{key}'s size in bytes as a node holding it complete reported it, or
        C{None} when no node does.
        """
        for node_id in self._complete.get(key, ()):
            return self._by_node[node_id][key].size
        return None

    def room(self, node_id: str) -> CacheRoom:
        return self._room.get(node_id, _NO_ROOM)

    def too_small(self, key: str, node_id: str) -> bool:
        """
        Whether C{node_id}'s cache cannot hold C{key} whatever it evicts:
        its capacity is known and below the model's known size.
        """
        if not key:
            return False
        capacity = self._room.get(node_id, _NO_ROOM).capacity
        if not capacity:
            return False
        size = self.size(key)
        return size is not None and size > capacity

    def peer_address(self, node_id: str) -> str:
        return self._peer.get(node_id, "")

    def peers(self, key: str, exclude: str = "", limit: int = MAX_PEERS) -> list[str]:
        """
        The peer addresses of at most C{limit} nodes holding C{key}
        complete, never C{exclude}'s, by node id (nothing says which is
        nearer, so the order is only stable).
        """
        if not key:
            return []
        out = []
        for node_id in sorted(self._complete.get(key, ())):
            address = self._peer.get(node_id)
            if node_id != exclude and address:
                out.append(address)
                if len(out) >= limit:
                    break
        return out

    def copies(self, node_id: str) -> list[CachedCopy]:
        """
        What C{node_id} reported, by key.
        """
        return [c for _, c in sorted(self._by_node.get(node_id, {}).items())]

    def nodes(self) -> list[str]:
        """
        The nodes with a report of any model, by id.
        """
        return sorted(self._by_node)

    def keys(self) -> list[str]:
        """
        Every model key some node holds, complete or in part.
        """
        return sorted(set(self._complete) | set(self._partial))
