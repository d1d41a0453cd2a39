"""
Which replicas were lately sent prompts that begin with which text: a
gateway's bounded guess at what each engine's prefix cache holds.

A prompt is known by its chained chunk hashes (L{llmgw.gateway.policy.chunk_hashes},
concatenated, C{HASH_BYTES} each): the i-th covers the prompt's first i + 1
chunks, so two prompts share the i-th hash exactly when they share that
much text. The index maps each hash to the replicas most lately sent a
prompt starting with it (a flattened radix tree: each node is one chunk
deeper than its parent), evicting the least recently used hashes beyond
C{max_entries}. A prompt's shorter prefixes are refreshed after its longer
ones, so eviction takes a path's deepest chunks first and a held prefix
keeps its ancestors.

It is a guess: an engine evicts on its own, and this gateway does not see
the other gateways' requests. A wrong guess costs a prefill, never a
wrong answer.

The index also weighs what it was sent per replica over the last
C{BALANCE_WINDOW} or so sends (an exponential window, L{PrefixIndex.shares}):
how the applications it keeps on their replicas share the load between
them, which C{cache_aware} evens out by placing new ones where fewer were
placed lately, and by moving one at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Final

from llmgw.gateway.sharing import Shares

#: The length of each chained hash in a chain.
HASH_BYTES: Final = 8
#: Hashes kept (about 200 bytes each): 100,000 chunks of 256 characters
#: cover some six million tokens of distinct prompt text, more than a
#: small fleet's engines cache between them.
MAX_ENTRIES: Final = 100_000
#: Replicas remembered per hash, most recent last: a prefix sent to more
#: replicas than this (a system prompt every replica holds) is matched on
#: the latest ones only, which is enough to keep it off the others.
MAX_HOLDERS: Final = 8
#: Sends the replicas' shares are weighed over (L{PrefixIndex.shares}):
#: each weighs 1 / (1 - 1 / BALANCE_WINDOW) times the one before it. Also
#: the sends after a prompt's beginning went to a replica other than its
#: last one before the shares are told again, so that one move shows in
#: them before the next is made. Over fewer, an even split of eight
#: applications on two replicas reads as over 1.2 times the mean often
#: enough to move applications back and forth for nothing.
BALANCE_WINDOW: Final = 256
_GROW: Final = 1.0 / (1.0 - 1.0 / BALANCE_WINDOW)
#: Weights are scaled down when the next one would pass this.
_RESCALE: Final = 1e100


class PrefixIndex:
    """
    A bounded map from chained chunk hashes to the replicas lately sent
    them. Not thread-safe (the reactor thread's, like the router).
    """

    def __init__(self, max_entries: int = MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, list[str]] = OrderedDict()
        #: every replica id added since the last forget that dropped one
        self._known: set[str] = set()
        #: per replica, its sends, each weighed by when (see shares)
        self._work: dict[str, float] = {}
        self._weight = 1.0
        self._adds = 0
        #: the add at which a prompt's beginning last went to a replica
        #: other than its last one
        self._switched_at = 0
        self._shares = Shares()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, chain: bytes, candidates: Collection[str] | Mapping[str, object]) -> dict[str, int]:
        """
        Per replica of C{candidates} that this index says holds a prefix
        of C{chain}, how many chunks of it (at least 1); replicas holding
        none are left out. Those holding the most come in the order they
        were last sent it, the latest last. Reading does not refresh: only
        what is sent is.
        """
        entries = self._entries
        depths: dict[str, int] = {}
        n = len(chain) // HASH_BYTES
        deepest: list[str] = []
        for i in range(n):
            holders = entries.get(chain[i * HASH_BYTES : (i + 1) * HASH_BYTES])
            if holders is None:
                break
            found = False
            for rid in holders:
                if rid in candidates:
                    depths[rid] = i + 1
                    found = True
            if not found:
                break
            deepest = holders
        if len(depths) > 1:
            # The first chunk's order may differ from the deepest's: put the
            # deepest holders last, in theirs.
            top = max(depths.values())
            for rid in deepest:
                if depths.get(rid) == top:
                    depths[rid] = depths.pop(rid)
        return depths

    def shares(self) -> Shares:
        """
        How the prompts sent lately share the replicas (L{Shares}); the
        same object each time, brought up to date.
        """
        shares = self._shares
        shares.sent = self._work if self._adds - self._switched_at >= BALANCE_WINDOW else None
        return shares

    def add(self, chain: bytes, replica_id: str) -> None:
        """
        C{replica_id} was sent a prompt whose chained hashes are C{chain}:
        it holds every prefix of it now.
        """
        entries = self._entries
        n = len(chain) // HASH_BYTES
        if replica_id not in self._known:
            self._known.add(replica_id)
        self._adds += 1
        weight = self._weight * _GROW
        work = self._work
        if weight > _RESCALE:
            for figures in (work, self._shares.placed):
                for rid in figures:
                    figures[rid] /= weight
            weight = 1.0
        self._weight = weight
        work[replica_id] = work.get(replica_id, 0.0) + weight
        # Deepest first: the shorter prefixes end up the most recent, so
        # eviction never leaves a chunk without its ancestors.
        for i in range(n - 1, -1, -1):
            h = chain[i * HASH_BYTES : (i + 1) * HASH_BYTES]
            holders = entries.get(h)
            if holders is None:
                entries[h] = [replica_id]
                if i == 0:
                    placed = self._shares.placed
                    placed[replica_id] = placed.get(replica_id, 0.0) + weight
                continue
            if holders[-1] != replica_id:
                if i == 0:
                    self._switched_at = self._adds
                    placed = self._shares.placed
                    placed[replica_id] = placed.get(replica_id, 0.0) + weight
                if replica_id in holders:
                    holders.remove(replica_id)
                holders.append(replica_id)
                if len(holders) > MAX_HOLDERS:
                    del holders[0]
            entries.move_to_end(h)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def forget(self, keep: Collection[str]) -> None:
        """
        Drop replicas not in C{keep} (gone from the routing table), and the
        hashes only they held. Cheap when none of them is gone (the
        routing table changes far more often than its replicas).
        """
        gone = [rid for rid in self._known if rid not in keep]
        if not gone:
            return
        self._known.difference_update(gone)
        for rid in gone:
            self._work.pop(rid, None)
            self._shares.placed.pop(rid, None)
        entries = self._entries
        for h in list(entries):
            holders = entries[h]
            kept = [rid for rid in holders if rid in keep]
            if not kept:
                del entries[h]
            elif len(kept) != len(holders):
                entries[h] = kept
