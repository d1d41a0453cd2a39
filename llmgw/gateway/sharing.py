"""
How the prompts a gateway sent lately share a model's replicas, and what
C{cache_aware} (L{llmgw.gateway.policy}) does with it: a new application
goes where the fewest were placed lately, and an application is moved off
a replica whose share of the sends is well over the mean. The figures are
kept by the gateway's prefix index (L{llmgw.gateway.prefixindex}).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.routing import Route


@dataclass
class Shares:
    """
    How the prompts the index was sent share the replicas lately, each
    send weighed by how recent it is (an exponential window of about
    L{llmgw.gateway.prefixindex.BALANCE_WINDOW} sends): a replica's
    figure over some replicas' total is its share among them. Read, never
    changed, by the caller; replicas with none are left out.

    @ivar sent: per replica, the prompts sent to it; C{None} until that
        many have been sent, and for as many sends after a prompt's
        beginning went to a replica other than its last one (a move or a
        spill), whose effect on the shares is not told yet.
    @ivar placed: per replica, the prompts whose first chunk was sent to
        it first, or moved to it: roughly, the applications placed there.
    """

    sent: Mapping[str, float] | None = None
    placed: dict[str, float] = field(default_factory=dict)


def least_share(
    by_id: Mapping[str, Route],
    loads: Mapping[str, int],
    walk: Sequence[str],
    bound: int,
    figures: Mapping[str, float],
    other_than: str | None = None,
) -> tuple[Route, float]:
    """
    Of C{by_id} under C{bound} (load + 1 at most C{bound}; not
    C{other_than}), the one with the least of C{figures} (missing: 0), ties
    in C{walk}'s order (replica ids), and its figure; the least loaded,
    with an infinite figure, when none is.
    """
    target: str | None = None
    low = 0.0
    for rid in walk:
        if rid == other_than or rid not in by_id or loads[rid] + 1 > bound:
            continue
        figure = figures.get(rid, 0.0)
        if target is None or figure < low:
            target, low = rid, figure
    if target is None:
        return min(by_id.values(), key=lambda r: (loads[r.replica_id], r.replica_id)), math.inf
    return by_id[target], low


def move_target(
    by_id: Mapping[str, Route],
    loads: Mapping[str, int],
    walk: Sequence[str],
    bound: int,
    best: str,
    sent: Mapping[str, float],
    balance: float,
) -> Route | None:
    """
    Where a match on C{best} moves to, or C{None} to keep it there: when
    C{best}'s share of C{sent} (over C{by_id}'s total) is over C{1 +
    balance} times the mean and some candidate has less in flight, the
    candidate under C{bound} with the least share (ties in C{walk}'s
    order), if that is under the mean.
    """
    total = 0.0
    for rid in by_id:
        total += sent.get(rid, 0.0)
    mean = total / len(by_id)
    if sent.get(best, 0.0) <= (1.0 + balance) * mean:
        return None
    if all(loads[rid] >= loads[best] for rid in by_id):
        return None  # none less busy right now: an idle gateway moves nothing
    target, low = least_share(by_id, loads, walk, bound, sent, best)
    return None if low >= mean else target
