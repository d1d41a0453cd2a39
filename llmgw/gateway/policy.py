"""
Routing policies: which of a model's replicas takes a request, as pure
functions of the candidates, their loads and the request's affinity key.

A replica's load (L{replica_load}) is what this gateway has in flight to it,
plus, with C{engine_load} on and the engine's signals fresh (younger than
C{PolicyConfig.stale_after_s}), the engine's waiting + running beyond what
this gateway had in flight when those signals arrived: the other gateways'
requests. (The engine's count lags; taken whole it makes a lone gateway
herd requests away from replicas that have already finished their work.
For the same reason KV-cache use is no tie-break: a stale figure would
send every tie to one replica until the next scrape.) Stale or
missing signals leave the gateway's count alone: a dead scrape degrades to
least-in-flight. A replica whose fresh signals say it is saturated (more
than C{saturated_waiting} queued, or KV use at or over C{saturated_kv}) is
avoided while any other candidate is not.

Policies (a deployment's C{routing}):

C{least_loaded}
    The candidate with the least load; ties go round in turn.
C{round_robin}
    Each candidate in turn, whatever its load.
C{prefix}
    Consistent hashing with bounded loads (Mirrokni et al., 2018) over an
    affinity key: the request's session (an C{X-Session-Id} header, else the
    body's C{user}) or the head of its prompt (L{affinity_key}). No replica
    takes a request that would put it over the bound
    C{ceil((1 + epsilon) * (L + 1) / n) + slack} (C{L} the candidates' total
    load, C{n} their number; C{slack} a few requests, since a batching
    engine takes a few more at little cost while a key moved off its
    replica pays the prefill of its whole history elsewhere). Under it, the request goes to the replica its key's
    last request went to (the router remembers that for recent keys), else
    to the first replica under the bound on a ring of C{vnodes} points per
    replica, hashed from replica ids alone, from the key's point. A chat's
    first turn (no assistant message), which nothing has cached yet, goes
    instead to the replica under the bound that was sent the fewest
    requests in the last C{spread_s} seconds, the least loaded of those,
    ties in the ring's order from its key (L{spread}; with C{spread_s} 0,
    to the least loaded): requests that reach an engine together are
    prefilled together, each waiting for the others' prompts, so a burst
    of independent prompts is dealt out rather than heaped on the one
    replica that just finished a batch. So a conversation stays on the
    replica whose engine holds its KV blocks while that replica's load
    allows.

C{cache_aware}
    C{prefix}, and before spread or the ring, a request without a home
    goes where its prompt's beginning was lately sent: the gateway's prefix
    index (L{llmgw.gateway.prefixindex}) tells, per replica, how many
    leading chunks of the prompt head it was sent (a chat's head chunked a
    message at a time, L{head_hashes}, so that a system prompt of any
    length is whole chunks); the replica under the bound with
    C{match_slack} holding the most (at least C{prefix_match} of the
    head's chunks), of those the one sent it last, takes it. So
    applications that each send one long system prompt with a different
    question each time keep to a replica, as conversations do, while its
    load allows, and one sent elsewhere (a spill) stays where it went. A
    first turn nothing holds is dealt out by L{spread} with ties in ring
    order from its first chunk: with the gateways idle, every request
    starting with the same text goes to the same replica, whichever
    gateway it reaches. Where the applications so kept leave a replica
    over C{1 + balance} times the mean share of the sends lately, one of
    them is moved to the replica with the least, one move per window of
    sends (L{bounded_prefix}'s C{shares}). (Not the default: on many
    short independent conversations it heaps first turns that share a
    beginning where C{prefix} deals them out.)

The ring and the key depend only on the routing table and the request:
two gateways with the same table and the same loads send a key neither has
seen to the same replica, with no state shared between them. (A first
turn, like C{least_loaded}, depends on the gateway's own figures: its loads
and its recent sends; a C{cache_aware} match, on its prefix index and its
shares.)
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from llmgw.gateway.sharing import Shares, least_share, move_target
from llmgw.routing import POLICIES, Route

#: The policy of a model the routing table names none for: the one
#: bench/routing.py measured best overall (see docs/operations.md).
DEFAULT_POLICY: Final = "prefix"
#: The policies that route by an affinity key (L{affinity_key}).
AFFINITY_POLICIES: Final = ("prefix", "cache_aware")


@dataclass(frozen=True)
class PolicyConfig:
    """
    The routing policies' knobs.

    @ivar stale_after_s: engine signals older than this are ignored.
    @ivar engine_load: whether fresh engine counts add to the load (other
        gateways' requests, L{replica_load}); off by default, since with a
        lone gateway their lag cost more than they told (bench/routing.py).
        Saturation is judged from fresh signals either way.
    @ivar saturated_waiting: a replica with more requests waiting than this
        in its engine is saturated.
    @ivar saturated_kv: a replica whose KV-cache use is at least this
        fraction is saturated.
    @ivar epsilon: the load bound of C{prefix}: no replica above
        C{(1 + epsilon)} times the mean (rounded up), plus C{slack}.
    @ivar slack: requests a replica may hold over C{(1 + epsilon)} times the
        mean before C{prefix} moves a key off it. A batching engine runs a
        few more requests at little cost, while a key moved off its replica
        pays the prefill of its whole history there; at low load, where the
        proportional bound is one or two requests, it would move
        conversations off their caches for nothing (bench/routing.py).
    @ivar chunk_chars: the prompt head is hashed in chunks of this many
        characters.
    @ivar max_chunks: at most this many chunks of the head count.
    @ivar vnodes: ring points per replica.
    @ivar prefix_match: under C{cache_aware}, a replica the prefix index says
        was sent at least this fraction of a request's prompt-head chunks
        (a shared system prompt) takes it, under the bound, before
        L{spread} or the ring; above 1: never.
    @ivar spread_s: under C{prefix}, a first turn goes to the replica (under
        the bound) sent the fewest requests in this many seconds, the least
        loaded of those; about the time an engine takes to start a prompt.
        0: to the least loaded, as C{least_loaded} does.
    @ivar match_slack: the slack of the load bound a prefix-index match is
        held to (C{cache_aware}), in place of C{slack}. A match sent
        elsewhere costs its whole prefix there and pushes out what that
        engine held, and (sticking where it was sent) moves its
        application, so it is held as a conversation is; the replicas'
        shares over time are evened out by C{balance} instead
        (bench/prefix.py).
    @ivar balance: under C{cache_aware}, a replica whose share of the
        sends lately is over C{1 + balance} times the mean has its next
        match moved to the replica with the least share, while it is
        busier than the least loaded (L{bounded_prefix}); one move per
        window of sends (L{llmgw.gateway.prefixindex.BALANCE_WINDOW}).
    """

    stale_after_s: float = 3.0
    engine_load: bool = False
    saturated_waiting: float = 16.0
    saturated_kv: float = 0.95
    epsilon: float = 0.25
    slack: int = 4
    chunk_chars: int = 256
    max_chunks: int = 64
    vnodes: int = 64
    spread_s: float = 0.1
    prefix_match: float = 0.5
    match_slack: int = 4
    balance: float = 0.2

    def __post_init__(self) -> None:
        if self.stale_after_s < 0 or self.saturated_waiting < 0:
            raise ValueError("stale_after_s and saturated_waiting must not be negative")
        if not 0 < self.saturated_kv <= 1:
            raise ValueError("saturated_kv must be a fraction in (0, 1]")
        if min(self.epsilon, self.slack, self.spread_s, self.prefix_match, self.match_slack, self.balance) < 0:
            raise ValueError("epsilon, slack, spread_s, prefix_match, match_slack and balance must not be negative")
        if self.chunk_chars < 1 or self.max_chunks < 1 or self.vnodes < 1:
            raise ValueError("chunk_chars, max_chunks and vnodes must be at least 1")


# -- load ---------------------------------------------------------------------------------


def fresh_signals(route: Route, now: float, config: PolicyConfig) -> bool:
    s = route.signals
    return s is not None and s.age(now) <= config.stale_after_s


def replica_load(
    route: Route, in_flight: int, now: float, config: PolicyConfig, in_flight_at_sample: int | None = None
) -> int:
    """
    The request count a replica is judged by: this gateway's in flight,
    plus, when the engine's signals are fresh, the engine's waiting +
    running beyond what this gateway had in flight when it first saw those
    signals (C{in_flight_at_sample}): the requests of other gateways. Without
    that figure, the larger of the two counts.
    """
    s = route.signals
    if not config.engine_load or s is None or s.age(now) > config.stale_after_s:
        return in_flight
    engine = int((s.waiting or 0.0) + (s.running or 0.0))
    if in_flight_at_sample is None:
        return max(in_flight, engine)
    return in_flight + max(0, engine - in_flight_at_sample)


def saturated(route: Route, now: float, config: PolicyConfig) -> bool:
    """
    Whether fresh signals say C{route}'s engine is full: too many waiting,
    or its KV cache (nearly) full.
    """
    s = route.signals
    if s is None or s.age(now) > config.stale_after_s:
        return False
    if s.waiting is not None and s.waiting > config.saturated_waiting:
        return True
    return s.kv_cache_usage is not None and s.kv_cache_usage >= config.saturated_kv


def unsaturated(routes: Sequence[Route], now: float, config: PolicyConfig) -> Sequence[Route]:
    """
    C{routes} less the saturated ones, unless all are.
    """
    keep = [r for r in routes if not saturated(r, now, config)]
    return keep if keep else routes


# -- affinity keys --------------------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Content parts: only the text ones say what the engine caches.
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def prompt_head(body: Mapping[str, Any]) -> str:
    """
    The part of a request's prompt that its next turns repeat: for a chat,
    the messages up to and including the first user message (system prompt
    and opening question, which every later turn of the conversation starts
    with); for a completion, its prompt. C{""} when there is none.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            parts.append(f"{role}\x00{_text(m.get('content'))}\x01")
            if role == "user":
                break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[0]
    return ""


def chunk_hashes(text: str, chunk_chars: int, max_chunks: int) -> list[bytes]:
    """
    Chained hashes of C{text}'s leading fixed-size chunks: the i-th hash
    covers chunks 0..i, so two texts share the i-th hash exactly when they
    share their first i + 1 chunks. A last partial chunk counts.
    """
    if len(text) <= chunk_chars:
        # One chunk (or none): most prompt heads.
        return [hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()] if text else []
    out = []
    h = b""
    for i in range(min(max_chunks, math.ceil(len(text) / chunk_chars))):
        chunk = text[i * chunk_chars : (i + 1) * chunk_chars]
        h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out.append(h)
    return out


def head_hashes(body: Mapping[str, Any], chunk_chars: int, max_chunks: int) -> list[bytes]:
    """
    The chained chunk hashes (as L{chunk_hashes}) of a request's prompt
    head (L{prompt_head}), at most C{max_chunks}: for a chat, each message
    chunked on its own, so that a chunk never spans two messages and
    requests that share a system prompt, whatever its length, share every
    hash of it; for a completion, its prompt's fixed chunks.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return chunk_hashes(prompt_head(body), chunk_chars, max_chunks)
    out: list[bytes] = []
    h = b""
    blake2b = hashlib.blake2b
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        part = f"{role}\x00{_text(m.get('content'))}\x01".encode("utf-8", "surrogatepass")
        # Chunked by bytes: one boundary rule for every gateway is what matters.
        for i in range(0, len(part), chunk_chars):
            if len(out) == max_chunks:
                return out
            h = blake2b(h + part[i : i + chunk_chars], digest_size=8).digest()
            out.append(h)
        if role == "user":
            break
    return out


def affinity_key(
    body: Mapping[str, Any], session: str | None, config: PolicyConfig, chain: bool = False
) -> bytes | None:
    """
    The key a request is routed by under C{prefix} and C{cache_aware}: its
    session when it names one (C{X-Session-Id}, else the body's C{user}),
    else the hash of its prompt head's leading chunks (with C{chain}, all
    of the head's chained chunk hashes, L{chunk_hashes}, concatenated: the
    chain L{key_chain} gives the prefix index, for C{cache_aware}); C{None}
    when it has neither. A chat with no earlier turn (no assistant message)
    gets a L{FIRST_TURN} mark, a later turn C{b"p\x00"}, a session
    C{b"s\x00"}. The ring point (L{key_point}) is the same either way.
    """
    if not session:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    if session:
        return b"s\x00" + hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    hashes = head_hashes(body, config.chunk_chars, config.max_chunks)
    if not hashes:
        return None
    messages = body.get("messages")
    if isinstance(messages, list) and not any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    ):
        # A first turn (or a one-off prompt): no replica holds its history
        # yet, so it goes to the least loaded (FIRST_TURN); the turns after
        # it, which repeat its head, follow it there while its load allows.
        return FIRST_TURN + (b"".join(hashes) if chain else hashes[-1])
    return b"p\x00" + (b"".join(hashes) if chain else hashes[-1])


#: The mark of a first turn's key (same ring point as its later turns).
FIRST_TURN: Final = b"f\x00"
#: The length of each hash in a key's chain.
HASH_BYTES: Final = 8


def key_point(key: bytes) -> bytes:
    """
    What places C{key} on the ring and names its conversation: a marked
    key less its mark (the same for every turn); an unmarked key whole.
    """
    return key[2:] if key[1:2] == b"\x00" else key


def split_chain(key: bytes) -> tuple[bytes, bytes]:
    """
    A prompt key made with its chain (C{affinity_key(..., chain=True)}) as
    the key C{prefix} would have made (the mark and the whole head's hash)
    and the chain for the prefix index; a session's key, unchanged, and
    C{b""}.
    """
    if key[1:2] == b"\x00" and key[:1] in (b"f", b"p") and len(key) > 2 + HASH_BYTES:
        return key[:2] + key[-HASH_BYTES:], key[2:]
    if key[1:2] == b"\x00" and key[:1] in (b"f", b"p"):
        return key, key[2:]
    return key, b""


def key_chain(key: bytes) -> bytes:
    """
    The chained chunk hashes of a prompt key (first or later turn), for
    the prefix index; C{b""} for a session's key or an unmarked one.
    """
    return split_chain(key)[1]


# -- the ring -------------------------------------------------------------------------------


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """
    A consistent-hash ring over replica ids: C{vnodes} points each, placed
    by the ids alone, so every gateway builds the same ring from the same
    routes.
    """

    def __init__(self, replica_ids: Collection[str], vnodes: int):
        points = sorted(
            (_point(f"{rid}#{i}".encode()), rid) for rid in replica_ids for i in range(vnodes)
        )
        self._keys = [p for p, _ in points]
        self._ids = [rid for _, rid in points]
        self.replica_ids = frozenset(replica_ids)

    def walk(self, key: bytes) -> list[str]:
        """
        Every replica id once, in ring order from C{key}'s point.
        """
        n = len(self._keys)
        if not n:
            return []
        # The mark (first turn, later turn, session) does not move the point.
        start = bisect.bisect_left(self._keys, _point(key_point(key))) % n
        seen: dict[str, None] = {}
        want = len(self.replica_ids)
        for i in range(n):
            rid = self._ids[(start + i) % n]
            if rid not in seen:
                seen[rid] = None
                if len(seen) == want:
                    break
        return list(seen)


def load_bound(total: int, n: int, epsilon: float, slack: int = 0) -> int:
    """
    The most requests (counting the one being placed) a replica may hold
    under C{prefix}: C{ceil((1 + epsilon) * (total + 1) / n) + slack}, at
    least 1.
    """
    return max(1, math.ceil((1.0 + epsilon) * (total + 1) / n - 1e-9) + slack)


# -- the policies ---------------------------------------------------------------------------


def least_loaded(candidates: Sequence[Route], loads: Mapping[str, int], turn: int) -> Route:
    """
    The candidate with the least load; ties go to the first from position
    C{turn} on, so that equal replicas take turns.
    """
    n = len(candidates)
    start = turn % n
    best = candidates[start]
    best_load = loads[best.replica_id]
    for i in range(1, n):
        r = candidates[(start + i) % n]
        load = loads[r.replica_id]
        if load < best_load:
            best, best_load = r, load
    return best


def round_robin(candidates: Sequence[Route], turn: int) -> Route:
    return candidates[turn % len(candidates)]


def spread(
    candidates: Sequence[Route],
    loads: Mapping[str, int],
    recent: Mapping[str, int],
    bound: int,
    order: Sequence[str] = (),
) -> Route:
    """
    Of the candidates under C{bound} (load + 1 at most C{bound}; the least
    loaded always is), the one sent the fewest requests lately
    (C{recent}, missing: none), the least loaded of those; ties go to the
    first in C{order} (replica ids: the key's ring walk, so that gateways
    with the same figures agree), then in C{candidates}' order.
    """
    by_id = {r.replica_id: r for r in candidates}
    best: Route | None = None
    best_score = (0, 0)
    # dict keys: the order's ids first, then the rest, each once.
    ids = dict.fromkeys(x for x in order if x in by_id)
    ids.update(dict.fromkeys(by_id))
    for rid in ids:
        load = loads[rid]
        if load + 1 > bound:
            continue
        score = (recent.get(rid, 0), load)
        if best is None or score < best_score:
            best, best_score = by_id[rid], score
    if best is None:
        # Only with a caller's odd loads (the least loaded is under the mean).
        return min(candidates, key=lambda r: (loads[r.replica_id], r.replica_id))
    return best


def bounded_prefix(
    candidates: Sequence[Route],
    loads: Mapping[str, int],
    ring: Ring | None,
    key: bytes,
    epsilon: float,
    home: str | None = None,
    slack: int = 0,
    recent: Mapping[str, int] | None = None,
    depths: Mapping[str, int] | None = None,
    prefix_match: float = 0.5,
    chain: bytes | None = None,
    match_slack: int | None = None,
    shares: Shares | None = None,
    balance: float = 0.2,
) -> Route | None:
    """
    C{home} (where this key's last request went) if it is a candidate under
    the bound (L{load_bound}), else the first candidate on C{ring} (built
    from all of C{candidates} when C{None}) from C{key} under it (one always
    is: the least loaded). A first turn's key (L{FIRST_TURN}) without a
    home under the bound goes by L{spread} over C{recent} (the requests
    sent to each replica lately), ties in ring order; without C{recent},
    C{None}: it goes to the least loaded.

    With C{chain} (C{cache_aware}: the key's chained chunk hashes,
    L{split_chain}), before the ring or spread, the candidate under the
    bound that C{depths} (per replica, the leading chunks of the chain it
    holds: the prefix index's
    L{match<llmgw.gateway.prefixindex.PrefixIndex.match>}) says holds the
    most of the chain, if at least C{prefix_match} of it, ties to the one
    sent it last (C{depths}' order: the index's; not the least loaded: a
    prefix that spilled or moved to a second replica would otherwise be
    dealt out over both, and held whole by neither); and a first turn's
    spread breaks ties in ring order from its first chunk.
    Without C{chain} (C{prefix}), C{depths} is not read. A match is held
    to the bound with C{match_slack} (C{slack} when C{None}).

    With C{shares} (L{Shares}: per replica, what it was sent lately, and
    the prompt beginnings placed on it lately; a replica's share is its
    figure over the candidates' total), while any candidate has a request
    in flight: a first turn nothing holds (with C{recent}: a spread window
    set) goes to the candidate under the
    bound with the least share of placements (ties in ring order from its
    first chunk), so that applications are dealt out evenly; and a match
    on a replica whose share of the sends is over C{1 + balance} times
    the mean, and which has more in flight than the least loaded
    candidate, moves instead to the candidate under the bound with the
    least share (ties likewise): sent there, its prefix stays there. So
    applications kept each on a replica share the load between the
    replicas, one moved at a time, while idle gateways (and balanced
    ones) keep every application where it is.
    """
    if chain is None:
        depths = None
    if home is None and recent is None and not depths and key.startswith(FIRST_TURN):
        return None
    by_id = {r.replica_id: r for r in candidates}
    total = 0
    for rid in by_id:  # a loop, not sum() over a generator: once a request, on a few replicas
        total += loads[rid]
    bound = load_bound(total, len(by_id), epsilon, slack)
    if home is not None and home in by_id and loads[home] + 1 <= bound:
        return by_id[home]
    first = key.startswith(FIRST_TURN)
    if depths and chain:
        if match_slack is not None and match_slack != slack:
            bound_m = load_bound(total, len(by_id), epsilon, match_slack)
        else:
            bound_m = bound
        need = max(1, math.ceil(prefix_match * (len(chain) // HASH_BYTES) - 1e-9))
        best: str | None = None
        best_depth = 0
        for rid, depth in depths.items():
            if depth < need or rid not in by_id or loads[rid] + 1 > bound_m:
                continue
            # >=: of those holding the most, the one sent it last.
            if depth >= best_depth:
                best, best_depth = rid, depth
        if best is not None and shares is not None and shares.sent:
            if ring is None:
                ring = Ring(list(by_id), PolicyConfig().vnodes)
            walk = ring.walk(FIRST_TURN + chain[:HASH_BYTES])
            moved = move_target(by_id, loads, walk, bound_m, best, shares.sent, balance)
            if moved is not None:
                return moved
        if best is not None:
            return by_id[best]
    if first and recent is None:
        return None
    if ring is None:
        ring = Ring(list(by_id), PolicyConfig().vnodes)
    if recent is not None and first:
        if chain:
            # Ties from the first chunk: requests that start alike (a shared
            # system prompt) go alike, from any gateway, while it is idle.
            walk = ring.walk(FIRST_TURN + chain[:HASH_BYTES])
            if shares is not None and shares.placed and any(loads[rid] for rid in by_id):
                return least_share(by_id, loads, walk, bound, shares.placed)[0]
            return spread(candidates, loads, recent, bound, walk)
        return spread(candidates, loads, recent, bound, ring.walk(key))
    walk = ring.walk(key)
    for rid in walk:
        r = by_id.get(rid)
        if r is not None and loads[rid] + 1 <= bound:
            return r
    # Unreachable with integer loads (the least loaded is under the mean);
    # kept so that a caller's odd loads still get an answer.
    return min(candidates, key=lambda r: (loads[r.replica_id], r.replica_id))


def choose(
    policy: str,
    candidates: Sequence[Route],
    in_flight: Callable[[str], int],
    now: float,
    config: PolicyConfig,
    key: bytes | None,
    turn: int,
    ring: Ring | None = None,
    at_sample: Mapping[str, int] | None = None,
    home: str | None = None,
    recent: Mapping[str, int] | None = None,
    depths: Mapping[str, int] | None = None,
    chain: bytes | None = None,
    shares: Shares | None = None,
) -> Route:
    """
    The replica C{policy} sends a request to among C{candidates} (not
    empty; all eligible: ready, not draining, not cooling down).

    @param key: the request's affinity key (L{affinity_key}); C{prefix}
        and C{cache_aware} without one fall back to C{least_loaded}.
    @param turn: a counter the caller advances per request (rotation).
    @param ring: the ring of every route of the model, to reuse; built
        from C{candidates} when not given.
    @param at_sample: per replica, this gateway's in-flight count when it
        first saw the replica's current signals (L{replica_load}).
    @param home: under C{prefix} and C{cache_aware}, the replica this
        key's last request went to, if the caller remembers it.
    @param recent: under C{prefix} and C{cache_aware}, per replica, the
        requests sent to it in the last C{config.spread_s} seconds
        (L{spread}); without it a first turn goes to the least loaded.
    @param depths: under C{cache_aware}, per replica, the leading chunks of
        C{chain} the gateway's prefix index says it holds.
    @param chain: under C{cache_aware}, the key's chained chunk hashes
        (L{split_chain}: C{key} is then the key less its chain).
    @param shares: under C{cache_aware}, how the prompts sent lately
        share the replicas (L{bounded_prefix}).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r} (known: {', '.join(POLICIES)})")
    signalled = False
    for r in candidates:
        if r.signals is not None:
            signalled = True
            break
    if signalled:
        candidates = unsaturated(candidates, now, config)
    if policy == "round_robin":
        return round_robin(candidates, turn)
    if signalled:
        seen = at_sample or {}
        loads = {
            r.replica_id: replica_load(r, in_flight(r.replica_id), now, config, seen.get(r.replica_id))
            for r in candidates
        }
    else:
        # No engine signals: nothing is saturated, and the load is the
        # gateway's own count (what saturated and replica_load say then).
        loads = {r.replica_id: in_flight(r.replica_id) for r in candidates}
    if policy == "prefix" and key is not None:
        if ring is None and (recent is not None or not key.startswith(FIRST_TURN)):
            ring = Ring([r.replica_id for r in candidates], config.vnodes)
        chosen = bounded_prefix(candidates, loads, ring, key, config.epsilon, home, config.slack, recent)
        if chosen is not None:
            return chosen
    elif policy == "cache_aware" and key is not None:
        if chain is None:
            key, chain = split_chain(key)
        if ring is None and (recent is not None or depths or not key.startswith(FIRST_TURN)):
            ring = Ring([r.replica_id for r in candidates], config.vnodes)
        chosen = bounded_prefix(
            candidates, loads, ring, key, config.epsilon, home, config.slack, recent, depths, config.prefix_match,
            chain, config.match_slack, shares, config.balance,
        )
        if chosen is not None:
            return chosen
    return least_loaded(candidates, loads, turn)
