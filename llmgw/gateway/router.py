"""
Which replica takes a request: pure decisions over plain data and a clock.

L{Router} keeps the gateway's count of requests in flight per replica (the
L{IInFlight} the reconciler reads to stop an idle draining replica) and a
circuit breaker: a replica whose connections fail C{failure_threshold}
times in a row is left out of rotation for C{cooldown} seconds, before the
control plane has noticed anything.

Which of the eligible replicas takes a request is the model's routing
policy's choice (L{llmgw.gateway.policy}), over the gateway's in-flight
counts and the engine signals in the routing table.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from typing import Final

from twisted.internet.interfaces import IReactorTime
from zope.interface import classImplements

from llmgw.gateway.policy import (
    AFFINITY_POLICIES,
    FIRST_TURN,
    PolicyConfig,
    Ring,
    choose,
    split_chain,
)
from llmgw.gateway.prefixindex import PrefixIndex, Shares
from llmgw.gateway.waking import AWAKE, WAKES_ON_REQUEST
from llmgw.routing import IInFlight, Route

#: Rings kept (one per set of replica ids seen recently).
_MAX_RINGS: Final = 1024
#: Affinity keys whose last replica is remembered (least recently used go).
MAX_HOMES: Final = 100_000
#: Send times kept per replica for C{prefix}'s spread (more in a window
#: count as this many).
MAX_RECENT: Final = 1024


class Router:
    def __init__(
        self,
        clock: IReactorTime,
        failure_threshold: int = 3,
        cooldown: float = 10.0,
        policy: PolicyConfig | None = None,
        prefixes: PrefixIndex | None = None,
    ):
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.clock = clock
        self.policy = policy if policy is not None else PolicyConfig()
        self._rings: dict[tuple[str, ...], Ring] = {}
        self._ring_routes: Sequence[Route] | None = None
        #: The last routes found with no replica asleep (see pick).
        self._awake_routes: Sequence[Route] | None = None
        #: The routes last picked among, and whether they are plain (see pick).
        self._seen_routes: Sequence[Route] | None = None
        self._plain = False
        self._ring_last: Ring | None = None
        #: affinity key (less its mark) -> the replica its last request went to
        self._homes: OrderedDict[bytes, str] = OrderedDict()
        #: which replicas were lately sent which prompt beginnings (C{cache_aware})
        self.prefixes = prefixes if prefixes is not None else PrefixIndex()
        #: replica -> (sampled_at of the signals last seen, in flight then)
        self._at_sample: dict[str, tuple[float, int]] = {}
        #: replica -> times of the requests C{prefix} sent it lately, oldest first
        self._sent: dict[str, deque[float]] = {}
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self._in_flight: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._cool_until: dict[str, float] = {}
        self._turn = 0
        #: A route's sleep (L{llmgw.gateway.waking.Waker.state}); C{None}:
        #: sleeping replicas are routed as any other.
        self.asleep: Callable[[Route], int] | None = None

    # IInFlight

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def snapshot(self) -> dict[str, int]:
        """
        Requests in flight per replica, for replicas with any.
        """
        return dict(self._in_flight)

    def begin(self, replica_id: str) -> None:
        """
        A request was sent (or is being sent) to C{replica_id}.
        """
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def end(self, replica_id: str) -> None:
        """
        A request to C{replica_id} is over, however it ended.
        """
        n = self._in_flight.get(replica_id, 0) - 1
        if n > 0:
            self._in_flight[replica_id] = n
        else:
            self._in_flight.pop(replica_id, None)

    # circuit breaker

    def failed(self, replica_id: str) -> bool:
        """
        A connection to C{replica_id} failed (refused, reset before an
        answer, timed out). Returns whether this put it in a cool-down.
        """
        n = self._failures.get(replica_id, 0) + 1
        self._failures[replica_id] = n
        if n >= self.failure_threshold and replica_id not in self._cool_until:
            self._cool_until[replica_id] = self.clock.seconds() + self.cooldown
            return True
        return False

    def bench(self, replica_id: str) -> bool:
        """
        Put C{replica_id} in a cool-down now, as if its failures had reached
        the threshold (it stopped answering in another way); returns whether
        it was not in one already.
        """
        if self.cooling(replica_id):
            return False
        self._failures[replica_id] = self.failure_threshold
        self._cool_until[replica_id] = self.clock.seconds() + self.cooldown
        return True

    def succeeded(self, replica_id: str) -> None:
        """
        C{replica_id} answered; its run of failures is over.
        """
        if self._failures:
            self._failures.pop(replica_id, None)

    def cooling(self, replica_id: str) -> bool:
        """
        Whether C{replica_id} is out of rotation now. When its cool-down
        ends it is back, on probation: one more failure sends it back.
        """
        until = self._cool_until.get(replica_id)
        if until is None:
            return False
        if self.clock.seconds() < until:
            return True
        del self._cool_until[replica_id]
        self._failures[replica_id] = self.failure_threshold - 1
        return False

    def cooling_replicas(self) -> list[str]:
        return sorted(r for r in list(self._cool_until) if self.cooling(r))

    def forget(self, keep: Collection[str]) -> None:
        """
        Drop breaker state of replicas not in C{keep} (gone from the table).
        """
        for d in (self._failures, self._cool_until, self._at_sample, self._sent):
            for r in [r for r in d if r not in keep]:
                del d[r]
        self.prefixes.forget(keep)

    # the decision

    def all_free(self, routes: Sequence[Route]) -> bool:
        """
        Whether every one of C{routes} may take a request now as far as the
        router can tell at a glance: they are the routes it last picked
        among, none draining and none with engine signals (so none asleep
        or saturated), and no replica is cooling down. C{False} when it
        cannot tell (then ask L{llmgw.gateway.admission.capacity}).
        """
        return routes is self._seen_routes and self._plain and not self._cool_until

    def ring(self, routes: Sequence[Route]) -> Ring:
        """
        The consistent-hash ring of C{routes}' replica ids (all of them,
        draining or not, so that a drain moves only the drained replica's
        keys), built once per set of ids.
        """
        if routes is self._ring_routes:
            # The routing table hands out the same sequence until it changes.
            return self._ring_last  # type: ignore[return-value]
        ids = tuple(r.replica_id for r in routes)
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:
                self._rings.clear()
            ring = self._rings[ids] = Ring(ids, self.policy.vnodes)
        if isinstance(routes, tuple):
            # Only an immutable sequence can be known again by identity.
            self._ring_routes, self._ring_last = routes, ring
        return ring

    def pick(
        self,
        routes: Sequence[Route],
        exclude: Collection[str] = (),
        policy: str = "least_loaded",
        key: bytes | None = None,
    ) -> Route | None:
        """
        The route C{policy} chooses among those not draining, not cooling
        down and not in C{exclude}; C{None} if there is none. C{key} is the
        request's affinity key (L{llmgw.gateway.policy.affinity_key}).
        Without fresh engine signals, C{least_loaded} is the fewest
        requests in flight, ties going round the candidates in turn.
        """
        if not routes:
            return None
        cool = self._cool_until
        if routes is not self._seen_routes:
            self._seen_routes = routes
            # An immutable sequence of frozen routes, none draining and none
            # with engine signals (so none asleep), is known again by identity.
            self._plain = isinstance(routes, tuple) and all(not r.draining and r.signals is None for r in routes)
        plain = self._plain
        if plain and not exclude and not cool:
            candidates = list(routes)
        else:
            candidates = [
                r
                for r in routes
                if not r.draining
                and not (exclude and r.replica_id in exclude)
                and not (cool and r.replica_id in cool and self.cooling(r.replica_id))
            ]
        if not plain and routes is not self._awake_routes and self.asleep is not None:
            asleep = self.asleep
            for r in routes:
                s = r.signals
                if s is not None and s.sleeping:
                    # Awake replicas first; then those a request wakes; never
                    # one that takes nothing until a wake call answers.
                    candidates = ([r for r in candidates if asleep(r) == AWAKE]
                                  or [r for r in candidates if asleep(r) == WAKES_ON_REQUEST])
                    break
            else:
                if isinstance(routes, tuple):
                    # None of them sleeps, and (an immutable sequence of
                    # frozen routes) none will: not looked at again.
                    self._awake_routes = routes
        if not candidates:
            return None
        if len(candidates) == 1:
            # Every policy's choice; the common case, kept cheap.
            return candidates[0]
        turn = self._turn
        self._turn += 1
        at_sample: dict[str, int] = {}
        seen = self._at_sample
        for r in () if plain else candidates:
            s = r.signals
            if s is None:
                continue
            rid = r.replica_id
            entry = seen.get(rid)
            if entry is None or entry[0] != s.sampled_at:
                entry = seen[rid] = (s.sampled_at, self._in_flight.get(rid, 0))
            at_sample[rid] = entry[1]
        if policy not in AFFINITY_POLICIES or key is None:
            return choose(
                policy, candidates, self.in_flight, self.clock.seconds(), self.policy, key, turn, None, at_sample
            )
        chain: bytes | None
        depths: dict[str, int] | None
        shares: Shares | None
        depths = chain = shares = None
        if policy == "cache_aware":
            key, chain = split_chain(key)
        homes = self._homes
        hkey = key[2:] if key[1:2] == b"\x00" else key  # key_point(key), once a request: inline
        home = homes.get(hkey)
        if chain and home is None and self.policy.prefix_match <= 1.0:
            # A request with no home yet (an application's next question,
            # or a conversation new to this gateway): where its beginning went.
            depths = self.prefixes.match(chain, {r.replica_id for r in candidates})
            shares = self.prefixes.shares()
        now = self.clock.seconds()
        window = self.policy.spread_s
        sent = self._sent
        if key.startswith(FIRST_TURN):
            # Without a spread window, the least loaded: no ring to walk.
            recent = None
            ring: Ring | None
            if window > 0:
                # self.ring(routes), its common case inline
                ring = self._ring_last if routes is self._ring_routes else self.ring(routes)
                recent = {}
                since = now - window
                for r in candidates:
                    times = sent.get(r.replica_id)
                    if times:
                        while times and times[0] <= since:
                            times.popleft()
                        recent[r.replica_id] = len(times)
            else:
                ring = self.ring(routes) if depths else None
            chosen = choose(
                policy, candidates, self.in_flight, now, self.policy, key, turn, ring, at_sample, home, recent,
                depths, chain, shares,
            )
        else:
            chosen = choose(
                policy, candidates, self.in_flight, now, self.policy, key, turn,
                self.ring(routes), at_sample, home, None, depths, chain, shares,
            )
        if window > 0:
            times = sent.get(chosen.replica_id)
            if times is None:
                times = sent[chosen.replica_id] = deque(maxlen=MAX_RECENT)
            times.append(now)
        if chain:
            self.prefixes.add(chain, chosen.replica_id)
        homes[hkey] = chosen.replica_id
        homes.move_to_end(hkey)
        if len(homes) > MAX_HOMES:
            homes.popitem(last=False)
        return chosen


# Not @implementer (setup.py's rules for compiled classes).
classImplements(Router, IInFlight)
