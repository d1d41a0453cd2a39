"""
Prefetch (DESIGN §19): a deployment's C{prefetch = N} keeps its weights
cached on N nodes beyond those that run it, so a scale-up or a failover
skips the fetch; and an operator's pull stages them by hand.

L{step} runs in a pass, now and then (L{INTERVAL}): for each deployment it
keeps a set of nodes told to keep its weights under the pin
C{prefetch:MODEL} (L{PrefetchState}), sends a C{PrefetchModel} to each node
it adds (again to one that registered since: an agent's pins do not outlive
it) and a C{DropModel} to each it takes out (the weights are then evicted
by LRU as any unused model). Nodes are chosen as placement prefers them:
one that holds the weights complete, then one fetching them, then the
others, by id; each eligible (connected, neither suspect, lost nor
cordoned), with the GPUs the profile needs, not running the deployment and
with a cache big enough for a model of known size. The choice reads the
model index, and walks the whole fleet only when the nodes holding the
weights are too few.

Pure: it reads no clock and sends nothing; it appends commands and events
to an L{Outcome}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet

from llmgw.control.core.catalog import Deployment, Profile
from llmgw.control.core.commands import DropModel, Prefetch, weights_key
from llmgw.control.core.context import Context, Copy, PrefetchState
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.interfaces import AdminError, UnknownDeployment, UnknownNode

#: Seconds between prefetch steps: copies are for the next failover, not
#: this second's.
INTERVAL = 5.0
#: Nodes a pull without named nodes stages at least.
PULL_DEFAULT = 1
#: Nodes one pull may name at most.
MAX_PULL_NODES = 256


def pin_for(model: str) -> str:
    """
    The cache pin under which C{model}'s prefetched weights are kept.
    """
    return f"prefetch:{model}"


def _fits(ctx: Context, node_id: str, profile: Profile) -> bool:
    """
    Whether C{node_id} has the GPUs C{profile} needs per shard (healthy,
    with the memory it asks), whatever runs on them now.
    """
    node = ctx.inventory.peek(node_id)
    if node is None:
        return False
    good = sum(1 for g in node.gpus if not g.problems and g.memory_total_mb >= profile.gpu_memory_mb)
    return good >= profile.gpus_per_shard


def candidates(ctx: Context, dep: Deployment, key: str, connected: AbstractSet[str],
               exclude: AbstractSet[str]) -> Iterator[str]:
    """
    Nodes that may take a copy of C{dep}'s weights (cache key C{key}), best
    first: holding them complete, then fetching them, then the others, each
    group by id. None in C{exclude}, none running C{dep}.
    """
    st = ctx.state
    models = ctx.inventory.models
    profile = ctx.catalog.profiles.get(dep.profile)
    running = st.spread.get(dep.model, {})
    seen: set[str] = set()

    def groups() -> Iterable[Iterable[str]]:
        yield sorted(models.holders(key))
        yield sorted(models.fetching(key))
        yield ctx.inventory.ids()

    for group in groups():
        for node_id in group:
            if node_id in seen:
                continue
            seen.add(node_id)
            if (node_id in exclude or running.get(node_id) or not st.eligible(node_id, connected)
                    or models.too_small(key, node_id)
                    or (profile is not None and not _fits(ctx, node_id, profile))):
                continue
            yield node_id


def _registered_at(ctx: Context, node_id: str) -> float:
    node = ctx.inventory.peek(node_id)
    return node.registered_at if node is not None else 0.0


def _prefetch(ctx: Context, dep: Deployment, node_id: str, pin: str) -> Prefetch:
    assert dep.source is not None
    peers = ctx.inventory.models.peers(weights_key(dep.source), exclude=node_id)
    return Prefetch(node_id, dep.source, pin, tuple(peers))


def step(ctx: Context, state: PrefetchState, connected: Callable[[], AbstractSet[str]], now: float,
         out: Outcome) -> None:
    """
    Bring every deployment's prefetch copies to what its C{prefetch} asks,
    at most once every L{INTERVAL}; C{connected} is asked only when there
    is something to do (it costs a look at every stream).
    """
    if now < state.next_step or now < ctx.grace_end:
        # Before the grace ends nothing is placed: copies chosen then could
        # land where the deployment is about to run.
        return
    state.next_step = now + INTERVAL
    deployments = ctx.catalog.deployments
    wanted = {m for m, d in deployments.items() if d.prefetch and weights_key(d.source)}
    models = sorted(wanted | set(state.copies))
    if not models:
        return
    nodes = connected()
    for model in models:
        _one(ctx, state, model, deployments.get(model), nodes, out)


def _one(ctx: Context, state: PrefetchState, model: str, dep: Deployment | None,
         connected: AbstractSet[str], out: Outcome) -> None:
    st = ctx.state
    key = weights_key(dep.source) if dep is not None else ""
    want = dep.prefetch if dep is not None and key else 0
    pin = pin_for(model)
    held = state.copies.setdefault(model, {})
    for node_id in sorted(held):
        copy = held[node_id]
        gone = node_id not in ctx.inventory or node_id in st.lost
        if copy.key != key or not want or gone or node_id in st.cordoned:
            del held[node_id]
            if not gone:
                out.send(DropModel(node_id, copy.key, pin))
        elif node_id in connected and _registered_at(ctx, node_id) != copy.registered_at:
            # The agent restarted since it was told: its pins are gone.
            assert dep is not None
            copy.registered_at = _registered_at(ctx, node_id)
            out.send(_prefetch(ctx, dep, node_id, pin))
    running = st.spread.get(model, {})
    extra = [n for n in held if not running.get(n)]
    if len(extra) > want:
        models = ctx.inventory.models
        # The surplus that has the least of the weights goes first.
        for node_id in sorted(extra, key=lambda n: (-models.rank(key, n), n))[: len(extra) - want]:
            out.send(DropModel(node_id, held.pop(node_id).key, pin))
    elif len(extra) < want and dep is not None:
        added = []
        for node_id in candidates(ctx, dep, key, connected, set(held)):
            held[node_id] = Copy(key, _registered_at(ctx, node_id))
            out.send(_prefetch(ctx, dep, node_id, pin))
            added.append(node_id)
            if len(extra) + len(added) >= want:
                break
        if added:
            out.event("prefetch", reason=f"deployment {model}: weights kept on {', '.join(added)}")
    if not held:
        del state.copies[model]


def refused(state: PrefetchState, cmd: Prefetch | DropModel, why: str, out: Outcome) -> None:
    """
    A C{PrefetchModel} or C{DropModel} could not be sent: a prefetch copy
    is forgotten (the next step picks a node again); a drop is not retried
    (the agent's pins end with its stream anyway).
    """
    if isinstance(cmd, Prefetch) and cmd.pin:
        model = cmd.pin.removeprefix("prefetch:")
        held = state.copies.get(model)
        if held is not None:
            held.pop(cmd.node_id, None)
    out.event("dispatch_refused", level="warn", node=cmd.node_id,
              reason=f"{type(cmd).__name__} ({cmd.pin or 'pull'}): {why}")


def pull(ctx: Context, state: PrefetchState, model: str, nodes: list[str],
         connected: AbstractSet[str], out: Outcome) -> list[str]:
    """
    Stage C{model}'s weights on C{nodes} (each known and connected), or,
    with none named, on the nodes prefetch would choose (C{prefetch} of
    them, at least one); the copies are not pinned, so LRU may evict them
    later. Returns the nodes told.

    @raise UnknownDeployment: no deployment serves C{model}.
    @raise UnknownNode: a named node is not known.
    @raise AdminError: the deployment names no source to fetch (a path on
        the node or a command of its own), a named node is not connected,
        too many nodes are named, or no node may take the weights.
    """
    dep = ctx.catalog.deployments.get(model)
    if dep is None:
        raise UnknownDeployment(f"no deployment serves model {model!r}")
    key = weights_key(dep.source)
    if dep.source is None or not key:
        raise AdminError(f"deployment {model} has no weights to fetch: it names no hf:// or https:// "
                         "source")
    if len(nodes) > MAX_PULL_NODES:
        raise AdminError(f"at most {MAX_PULL_NODES} nodes may be named at once, not {len(nodes)}")
    chosen = list(dict.fromkeys(nodes))
    for node_id in chosen:
        if node_id not in ctx.inventory:
            raise UnknownNode(f"no node {node_id!r}")
        if node_id not in connected:
            raise AdminError(f"node {node_id} is not connected: it cannot fetch now")
    if not chosen:
        held = set(state.copies.get(model, {}))
        exclude = held | ctx.inventory.models.holders(key)
        count = max(dep.prefetch, PULL_DEFAULT)
        for node_id in candidates(ctx, dep, key, connected, exclude):
            chosen.append(node_id)
            if len(chosen) >= count:
                break
        if not chosen:
            raise AdminError(f"no eligible node lacks the weights of {model}: name nodes with --node")
    for node_id in chosen:
        out.send(_prefetch(ctx, dep, node_id, ""))
    out.event("model_pull", reason=f"deployment {model}: weights staged on {', '.join(chosen)}")
    return chosen
