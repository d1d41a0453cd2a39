"""
Lending a sleeping replica's GPUs to another model (DESIGN §22), as a pure
choice over plain data.

A GPU is lent only when every shard holding it belongs to a replica whose
engine sleeps; which GPUs those are, and how much memory a borrower may
take on each, is the core's to say (L{llmgw.control.core.lending}). Given
them, the choice for one replica that found no free GPUs enough:

  - on each node the free GPUs placement would give come first (all of
    them: with enough it would not borrow), then lent ones, so no more is
    lent than the replica lacks;
  - a lent GPU only to a borrower no more important (C{priority}) than
    every replica holding it, so that its lenders can always have it back
    by taking the borrower;
  - among lent GPUs, those of a more preferred type, then of the least
    important lenders, then of the longest asleep;
  - among nodes, as placement spreads a deployment's replicas, the one
    with the fewest of its shards already; then the one that lends the
    fewest GPUs, then whose GPUs taken are all of a more preferred type,
    then the least important lenders, then the longest asleep, then by
    node id, so the same inputs give the same answer;
  - a multi-shard replica on distinct nodes that share its fabric;
  - only GPUs of the profile's C{gpu_types} where it names some.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.control.state.placement import NodeCapacity, Request
from llmgw.gputypes import matches, preference


@dataclass(frozen=True, slots=True)
class LentGPU:
    """
    A GPU that only sleeping replicas hold: what a borrower may take of its
    memory, the lowest priority among its holders' deployments, since when
    the holder that fell asleep last sleeps, and the holders' replica ids.
    """

    index: int
    free_mb: int
    priority: int
    asleep_since: float
    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Lender:
    """
    A node with GPUs to lend, and its free GPUs as placement sees them.
    """

    node: NodeCapacity
    lent: tuple[LentGPU, ...]


@dataclass(frozen=True, slots=True)
class Borrowing:
    """
    Where one shard goes: all its GPUs, and those of them that are lent.
    """

    node_id: str
    host: str
    gpus: tuple[int, ...]
    lent: tuple[LentGPU, ...]


def _typed(node: NodeCapacity, index: int, req: Request) -> bool:
    return not req.gpu_types or matches(node.names.get(index, ""), req.gpu_types)


def choose(lenders: Iterable[Lender], req: Request, priority: int,
           spread: Mapping[str, int] | None = None) -> list[Borrowing] | None:
    """
    The shards of one replica of C{req} by rank, each with at least one
    lent GPU, for a borrower of C{priority}; C{None} when they do not fit.
    C{spread}: the shards of C{req}'s group already on each node.
    """
    if req.shards > 1 and not req.fabric:
        return None
    spread = spread or {}
    prefer = req.prefer_gpu_types
    options: list[tuple[tuple[int, int, int, int, float, str], Borrowing]] = []
    for lender in lenders:
        node = lender.node
        if req.shards > 1 and req.fabric not in node.fabrics:
            continue

        def liked(index: int, node: NodeCapacity = node) -> int:
            return preference(node.names.get(index, ""), prefer) if prefer else 0

        free = [i for mb, i in node.free if mb >= req.gpu_memory_mb and _typed(node, i, req)]
        need = req.gpus_per_shard - len(free)
        if need <= 0:
            # It fits without lending: placement's refusal of it stands.
            continue
        lent = sorted((g for g in lender.lent if g.free_mb >= req.gpu_memory_mb and g.priority >= priority
                       and _typed(node, g.index, req)),
                      key=lambda g: (liked(g.index), g.priority, g.asleep_since, g.index))
        if len(lent) < need:
            continue
        took = tuple(lent[:need])
        gpus = free + [g.index for g in took]
        cost = (spread.get(node.id, 0), need, max(map(liked, gpus)), max(g.priority for g in took),
                max(g.asleep_since for g in took), node.id)
        options.append((cost, Borrowing(node.id, node.host, tuple(sorted(gpus)), took)))
    if len(options) < req.shards:
        return None
    options.sort(key=lambda o: o[0])
    return [b for _, b in options[: req.shards]]
