"""
Routing policies (llmgw.gateway.policy) and the router that applies them:
pure choices over routing tables, loads and a Clock.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.control.core.catalog import CatalogError, parse_catalog
from llmgw.gateway.policy import (
    FIRST_TURN,
    PolicyConfig,
    Ring,
    affinity_key,
    choose,
    load_bound,
    prompt_head,
    replica_load,
    spread,
)
from llmgw.gateway.router import Router
from llmgw.routing import (
    EngineSignals,
    Route,
    RoutingSnapshot,
    RoutingTable,
    snapshot_from_json,
    snapshot_to_json,
)

CONFIG = PolicyConfig()
ENGINE_LOAD = PolicyConfig(engine_load=True)


def routes(n: int, signals: dict[str, EngineSignals] | None = None) -> list[Route]:
    signals = signals or {}
    return [
        Route(f"r{i}", "m", f"10.0.0.{i + 1}:8000", signals=signals.get(f"r{i}")) for i in range(n)
    ]


def chat(system: str, *turns: str) -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": messages}


class AffinityKeyTests(SynchronousTestCase):
    def test_later_turns_share_the_key(self) -> None:
        """
        Every turn of a conversation (the same system prompt and first user
        message, then more turns) has the same key, the first marked as a
        first turn; another conversation under the same system prompt has
        another.
        """
        system = "You are helpful. " * 40
        first = affinity_key(chat(system, "hello"), None, CONFIG)
        second = affinity_key(chat(system, "hello", "hi!", "more"), None, CONFIG)
        third = affinity_key(chat(system, "hello", "hi!", "more", "sure", "again"), None, CONFIG)
        other = affinity_key(chat(system, "goodbye", "bye!", "more"), None, CONFIG)
        assert first is not None and second is not None
        self.assertTrue(first.startswith(FIRST_TURN))
        self.assertEqual(first[2:], second[2:])
        self.assertEqual(second, third)
        self.assertNotEqual(second, other)

    def test_completion_prompt(self) -> None:
        """
        A completion is keyed by its prompt's leading chunks: prompts that
        differ only past them share the key.
        """
        config = PolicyConfig(chunk_chars=10, max_chunks=2)
        a = affinity_key({"prompt": "0123456789abcdefghijXXXX"}, None, config)
        b = affinity_key({"prompt": "0123456789abcdefghijYYYY"}, None, config)
        c = affinity_key({"prompt": "0123456789abcdefghiZ"}, None, config)
        self.assertEqual(a, b)
        self.assertNotEqual(a, c)

    def test_session_wins(self) -> None:
        """
        An X-Session-Id (passed as C{session}) or the body's C{user} keys a
        request whatever its prompt; the header wins over C{user}.
        """
        k1 = affinity_key(chat("a", "x"), "sess-1", CONFIG)
        k2 = affinity_key(chat("b", "y"), "sess-1", CONFIG)
        self.assertEqual(k1, k2)
        u1 = affinity_key({**chat("a", "x"), "user": "alice"}, None, CONFIG)
        u2 = affinity_key({**chat("c", "z"), "user": "alice"}, None, CONFIG)
        self.assertEqual(u1, u2)
        self.assertEqual(affinity_key({**chat("a", "x"), "user": "alice"}, "sess-1", CONFIG), k1)

    def test_no_prompt_no_key(self) -> None:
        """
        A body with neither messages nor prompt (nor a session) has no key.
        """
        self.assertIsNone(affinity_key({"model": "m"}, None, CONFIG))

    def test_content_parts(self) -> None:
        """
        Content given as parts counts by its text parts.
        """
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        self.assertEqual(prompt_head(body), "user\x00hi\x01")


class LoadTests(SynchronousTestCase):
    def test_fresh_signals_count(self) -> None:
        """
        Fresh engine signals raise a replica's load to the engine's waiting +
        running when that is more than the gateway's in-flight count.
        """
        s = EngineSignals(sampled_at=10.0, waiting=5, running=3)
        route = Route("r", "m", "h:1", signals=s)
        self.assertEqual(replica_load(route, 2, 11.0, ENGINE_LOAD), 8)
        self.assertEqual(replica_load(route, 20, 11.0, ENGINE_LOAD), 20)
        # Off (the default), the load is the gateway's count alone.
        self.assertEqual(replica_load(route, 2, 11.0, CONFIG), 2)

    def test_other_gateways_share(self) -> None:
        """
        Given this gateway's in-flight count when the signals came, the load
        is its count now plus what the engine held beyond it then (other
        gateways' requests), so a lagging engine count does not hide
        requests that have finished since.
        """
        s = EngineSignals(sampled_at=10.0, waiting=2, running=8)
        route = Route("r", "m", "h:1", signals=s)
        self.assertEqual(replica_load(route, 3, 11.0, ENGINE_LOAD, in_flight_at_sample=6), 3 + 4)
        self.assertEqual(replica_load(route, 3, 11.0, ENGINE_LOAD, in_flight_at_sample=12), 3)

    def test_stale_signals_ignored(self) -> None:
        """
        Signals older than the staleness bound (3 s by default) are ignored:
        the load is the gateway's in-flight count, and a replica they said
        was full is not avoided.
        """
        s = EngineSignals(sampled_at=0.0, waiting=500, running=3, kv_cache_usage=1.0)
        rs = routes(2, {"r0": s})
        self.assertEqual(replica_load(rs[0], 1, 3.5, ENGINE_LOAD), 1)
        inflight = {"r0": 0, "r1": 1}
        for config in (CONFIG, ENGINE_LOAD):
            for policy in ("least_loaded", "prefix"):
                stale = choose(policy, rs, inflight.__getitem__, 3.5, config, None, 0)
                self.assertEqual(stale.replica_id, "r0", policy)
                fresh = choose(policy, rs, inflight.__getitem__, 2.5, config, None, 0)
                self.assertEqual(fresh.replica_id, "r1", policy)

    def test_saturated_avoided(self) -> None:
        """
        A replica whose engine queues more than the threshold, or whose KV
        cache is over the fraction, gets nothing while another does not;
        when all are saturated they are used still.
        """
        config = PolicyConfig(saturated_waiting=4, saturated_kv=0.9)
        full = EngineSignals(sampled_at=0.0, waiting=0, running=1, kv_cache_usage=0.95)
        queued = EngineSignals(sampled_at=0.0, waiting=5, running=1)
        rs = routes(3, {"r0": full, "r1": queued})
        zero = {"r0": 0, "r1": 0, "r2": 50}.__getitem__
        for policy in ("least_loaded", "round_robin", "prefix"):
            for turn in range(6):
                key = b"k%d" % turn
                got = choose(policy, rs, zero, 1.0, config, key, turn)
                self.assertEqual(got.replica_id, "r2", policy)
        both = routes(2, {"r0": full, "r1": queued})
        picked = {choose("round_robin", both, zero, 1.0, config, None, t).replica_id for t in range(4)}
        self.assertEqual(picked, {"r0", "r1"})


class PrefixTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(
        loads=st.lists(st.integers(0, 40), min_size=1, max_size=9),
        key=st.binary(min_size=1, max_size=16),
        epsilon=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
        slack=st.sampled_from([0, 1, 4]),
    )
    def test_bound_never_exceeded(self, loads: list[int], key: bytes, epsilon: float, slack: int) -> None:
        """
        Whatever the loads, the replica C{prefix} picks holds, with the new
        request, no more than ceil((1 + epsilon) * (total + 1) / n) + slack.
        """
        config = PolicyConfig(epsilon=epsilon, slack=slack)
        rs = routes(len(loads))
        inflight = {r.replica_id: n for r, n in zip(rs, loads, strict=True)}
        got = choose("prefix", rs, inflight.__getitem__, 0.0, config, key, 0)
        self.assertLessEqual(
            inflight[got.replica_id] + 1, load_bound(sum(loads), len(loads), epsilon, slack)
        )

    @settings(max_examples=50, deadline=None)
    @given(keys=st.lists(st.integers(0, 5), min_size=1, max_size=300))
    def test_bound_holds_as_load_builds(self, keys: list[int]) -> None:
        """
        Placing a stream of requests (few distinct keys, none finishing) one
        by one through a router never puts a replica over the bound.
        """
        r = Router(Clock(), policy=PolicyConfig(epsilon=0.25))
        rs = routes(4)
        for k in keys:
            total = sum(r.in_flight(x.replica_id) for x in rs)
            got = r.pick(rs, (), "prefix", b"key%d" % k)
            assert got is not None
            self.assertLessEqual(r.in_flight(got.replica_id) + 1, load_bound(total, 4, 0.25, 4))
            r.begin(got.replica_id)

    def test_prefix_keeps_its_replica(self) -> None:
        """
        A key goes to the same replica request after request while that
        replica is under the bound, even if others are less loaded; once it
        is over, the next on the ring under the bound takes it, and its
        requests follow it there. (The proportional bound alone: no slack.)
        """
        r = Router(Clock(), policy=PolicyConfig(slack=0))
        rs = routes(4)
        key = affinity_key(chat("system " * 100, "question", "answer", "more"), None, CONFIG)
        first = r.pick(rs, (), "prefix", key)
        assert first is not None
        home = first.replica_id
        others = [x.replica_id for x in rs if x.replica_id != home]
        for rid, n in zip(others, (2, 2, 1), strict=True):
            for _ in range(n):
                r.begin(rid)
        r.begin(home)
        r.begin(home)
        # Loads 2 (home), 2, 2, 1: total 7, bound ceil(1.25 * 8 / 4) = 3.
        again = r.pick(rs, (), "prefix", key)
        assert again is not None
        self.assertEqual(again.replica_id, home)
        r.begin(home)
        # home at 3 = bound: the next replica on the ring under it takes it.
        spill = r.pick(rs, (), "prefix", key)
        assert spill is not None and key is not None
        self.assertNotEqual(spill.replica_id, home)
        walk = [x for x in Ring([x.replica_id for x in rs], 64).walk(key) if x != home]
        self.assertEqual(spill.replica_id, walk[0])
        r.end(home)
        # Its cache is where its last request went: it stays there while
        # that replica is under the bound.
        after = r.pick(rs, (), "prefix", key)
        assert after is not None
        self.assertEqual(after.replica_id, spill.replica_id)
        # A gateway that has not seen the key goes by the ring: to home.
        fresh = Router(Clock(), policy=PolicyConfig(slack=0)).pick(rs, (), "prefix", key)
        assert fresh is not None
        self.assertEqual(fresh.replica_id, home)

    def test_slack_keeps_a_key_at_low_load(self) -> None:
        """
        With C{slack}, a key stays on its replica while that replica holds
        up to C{slack} requests more than the proportional bound, and moves
        off it past that.
        """
        r = Router(Clock(), policy=PolicyConfig(epsilon=0.25, slack=2))
        rs = routes(4)
        key = affinity_key(chat("system " * 100, "question", "answer", "more"), None, CONFIG)
        home = r.pick(rs, (), "prefix", key)
        assert home is not None
        # Others idle: the proportional bound for the 5th request is
        # ceil(1.25 * 5 / 4) = 2; with slack 2 it is 4.
        for _ in range(3):
            r.begin(home.replica_id)
        self.assertEqual(load_bound(3, 4, 0.25, 2), 4)
        again = r.pick(rs, (), "prefix", key)
        assert again is not None
        self.assertEqual(again.replica_id, home.replica_id)
        r.begin(home.replica_id)
        moved = r.pick(rs, (), "prefix", key)
        assert moved is not None
        self.assertNotEqual(moved.replica_id, home.replica_id)

    def test_bad_knobs_refused(self) -> None:
        """
        A negative epsilon, slack or spread window is refused, naming the
        knobs.
        """
        for kw in ({"epsilon": -0.1}, {"slack": -1}, {"spread_s": -0.5}):
            with self.assertRaises(ValueError) as e:
                PolicyConfig(**kw)  # type: ignore[arg-type]
            self.assertIn("slack", str(e.exception))

    def test_keys_spread(self) -> None:
        """
        Many distinct keys on idle replicas spread over all of them.
        """
        rs = routes(4)
        got = Counter(
            choose("prefix", rs, lambda _: 0, 0.0, CONFIG, b"conversation-%d" % i, 0).replica_id
            for i in range(400)
        )
        self.assertEqual(set(got), {"r0", "r1", "r2", "r3"})
        self.assertLess(max(got.values()), 160)

    @settings(max_examples=100, deadline=None)
    @given(
        n=st.integers(1, 8),
        loads=st.lists(st.integers(0, 10), min_size=8, max_size=8),
        keys=st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=20),
        order=st.randoms(use_true_random=False),
    )
    def test_two_routers_agree(self, n: int, loads: list[int], keys: list[bytes], order: object) -> None:
        """
        Two routers (two gateways) given the same routing table, in whatever
        order its routes come, and the same loads, make the same choices:
        no state is shared, nothing random is used.
        """
        table = RoutingSnapshot(routes(n))
        doc = snapshot_to_json(table, 0.0)
        order.shuffle(doc["routes"])  # type: ignore[attr-defined]
        other, problems = snapshot_from_json(doc, 0.0)
        self.assertEqual(problems, [])
        a, b = Router(Clock()), Router(Clock())
        for i, rid in enumerate(r.replica_id for r in table.routes("m")):
            for _ in range(loads[i]):
                a.begin(rid)
                b.begin(rid)
        for i, key in enumerate(keys):
            # First turns too: they go by loads and recent sends, which agree.
            key = FIRST_TURN + key if i % 3 == 0 else key
            pa = a.pick(table.routes("m"), (), "prefix", key)
            pb = b.pick(list(reversed(other.routes("m"))), (), "prefix", key)
            assert pa is not None and pb is not None
            self.assertEqual(pa.replica_id, pb.replica_id)
            a.begin(pa.replica_id)
            b.begin(pb.replica_id)

    def test_draining_keeps_the_ring(self) -> None:
        """
        When one replica drains, keys it did not own keep their replica.
        """
        r = Router(Clock())
        rs = routes(4)
        keys = [b"k%d" % i for i in range(60)]
        before = {k: r.pick(rs, (), "prefix", k).replica_id for k in keys}  # type: ignore[union-attr]
        drained = [Route(x.replica_id, "m", x.address, draining=x.replica_id == "r0") for x in rs]
        for k in keys:
            if before[k] != "r0":
                self.assertEqual(r.pick(drained, (), "prefix", k).replica_id, before[k])  # type: ignore[union-attr]

    def test_first_turn_least_loaded(self) -> None:
        """
        A chat's first turn goes to the least loaded replica, whatever its
        prompt, when nothing was sent in the last C{spread_s} seconds; with
        C{spread_s} 0, always.
        """
        clock = Clock()
        r = Router(clock)
        rs = routes(3)
        r.begin("r0")
        r.begin("r2")
        for i in range(5):
            key = affinity_key(chat("system", f"question {i}"), None, CONFIG)
            self.assertEqual(r.pick(rs, (), "prefix", key).replica_id, "r1")  # type: ignore[union-attr]
            clock.advance(CONFIG.spread_s + 0.01)
        now = Router(Clock(), policy=PolicyConfig(spread_s=0))
        now.begin("r0")
        now.begin("r2")
        for i in range(5):
            key = affinity_key(chat("system", f"question {i}"), None, CONFIG)
            self.assertEqual(now.pick(rs, (), "prefix", key).replica_id, "r1")  # type: ignore[union-attr]

    def test_burst_of_first_turns_dealt_out(self) -> None:
        """
        First turns arriving together are dealt out over the replicas under
        the bound, fewest sent lately first, rather than all sent to the one
        replica that has just emptied (which would prefill them all in one
        batch); once the window has passed, the least loaded takes the next.
        """
        clock = Clock()
        r = Router(clock)
        rs = routes(4)
        for rid in ("r1", "r2", "r3"):
            for _ in range(8):
                r.begin(rid)
        got = []
        for i in range(8):
            key = affinity_key(chat("system", f"question {i}"), None, CONFIG)
            chosen = r.pick(rs, (), "prefix", key)
            assert chosen is not None
            got.append(chosen.replica_id)
            r.begin(chosen.replica_id)
        self.assertEqual(Counter(got), {"r0": 2, "r1": 2, "r2": 2, "r3": 2})
        # The least loaded (r0, 2 against 10) went first in each round.
        self.assertEqual(got[0], "r0")
        self.assertEqual(got[4], "r0")
        clock.advance(CONFIG.spread_s + 0.01)
        key = affinity_key(chat("system", "question 9"), None, CONFIG)
        self.assertEqual(r.pick(rs, (), "prefix", key).replica_id, "r0")  # type: ignore[union-attr]
        # Without the window the whole burst goes to the emptied replica.
        plain = Router(Clock(), policy=PolicyConfig(spread_s=0))
        for rid in ("r1", "r2", "r3"):
            for _ in range(8):
                plain.begin(rid)
        for i in range(8):
            key = affinity_key(chat("system", f"question {i}"), None, CONFIG)
            chosen = plain.pick(rs, (), "prefix", key)
            assert chosen is not None
            self.assertEqual(chosen.replica_id, "r0")
            plain.begin("r0")

    def test_recent_sends_do_not_move_a_conversation(self) -> None:
        """
        A later turn goes to its conversation's replica while that replica is
        under the bound, however many requests were sent to it just before.
        """
        clock = Clock()
        r = Router(clock)
        rs = routes(4)
        system = "system " * 100
        first = r.pick(rs, (), "prefix", affinity_key(chat(system, "question"), None, CONFIG))
        assert first is not None
        home = first.replica_id
        # Other conversations' later turns, all sent to home just now.
        for i in range(3):
            key = affinity_key(chat(system, f"q{i}", "a", "more"), None, CONFIG)
            r._homes[key[2:]] = home  # type: ignore[index]
            self.assertEqual(r.pick(rs, (), "prefix", key).replica_id, home)  # type: ignore[union-attr]
        later = affinity_key(chat(system, "question", "answer", "more"), None, CONFIG)
        self.assertEqual(r.pick(rs, (), "prefix", later).replica_id, home)  # type: ignore[union-attr]

    @settings(max_examples=50, deadline=None)
    @given(
        steps=st.lists(
            st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.01, 0.05, 0.2]), st.booleans()),
            min_size=1, max_size=200,
        )
    )
    def test_bound_holds_for_first_turns(self, steps: list[tuple[int, float, bool]]) -> None:
        """
        A stream of first turns and later turns, some finishing, on a
        clock, never puts a replica over the bound, spread or not.
        """
        clock = Clock()
        r = Router(clock, policy=PolicyConfig(epsilon=0.25))
        rs = routes(4)
        held: list[str] = []
        for i, (k, dt, finish) in enumerate(steps):
            clock.advance(dt)
            if finish and held:
                r.end(held.pop(0))
            body = chat("system", f"question {k}") if i % 2 else chat("system", f"question {k}", "a", "b")
            total = sum(r.in_flight(x.replica_id) for x in rs)
            got = r.pick(rs, (), "prefix", affinity_key(body, None, CONFIG))
            assert got is not None
            self.assertLessEqual(r.in_flight(got.replica_id) + 1, load_bound(total, 4, 0.25, 4))
            r.begin(got.replica_id)
            held.append(got.replica_id)

    def test_spread_rule(self) -> None:
        """
        L{spread}: of the candidates under the bound, the fewest sent lately,
        then the least loaded, then the first in the given order (the key's
        ring walk), whatever the candidates' order; a replica at the bound
        is passed over however few were sent to it.
        """
        rs = routes(4)
        loads = {"r0": 5, "r1": 1, "r2": 3, "r3": 1}
        # r1 and r3: none sent lately, equally loaded: the order decides.
        recent = {"r0": 0, "r1": 0, "r2": 2, "r3": 0}
        self.assertEqual(spread(rs, loads, recent, 6, ["r1", "r3", "r0", "r2"]).replica_id, "r1")
        self.assertEqual(spread(rs, loads, recent, 6, ["r3", "r2", "r1", "r0"]).replica_id, "r3")
        self.assertEqual(spread(rs[::-1], loads, recent, 6, ["r1", "r3", "r0", "r2"]).replica_id, "r1")
        # Fewest sent beats least loaded.
        self.assertEqual(spread(rs, loads, {"r1": 1, "r2": 1, "r3": 1}, 6).replica_id, "r0")
        # ... but not the bound: r0 (5 + 1 > 5) is passed over.
        self.assertEqual(spread(rs, loads, {"r1": 1, "r2": 1, "r3": 1}, 5).replica_id, "r1")
        # Missing from recent: nothing sent.
        self.assertEqual(spread(rs, loads, {"r0": 1, "r1": 1, "r3": 1}, 6).replica_id, "r2")

    def test_choose_first_turn(self) -> None:
        """
        L{choose} under C{prefix}: a first turn's key with per-replica
        recent sends goes by L{spread} (a replica sent requests lately is
        passed over for one sent none, though it is less loaded); without
        them, to the least loaded. A later turn's key goes by the ring
        either way.
        """
        rs = routes(3)
        inflight = {"r0": 0, "r1": 2, "r2": 2}.__getitem__
        first = FIRST_TURN + b"question"
        spread_pick = choose("prefix", rs, inflight, 0.0, CONFIG, first, 0, recent={"r0": 3})
        self.assertIn(spread_pick.replica_id, {"r1", "r2"})
        self.assertEqual(choose("prefix", rs, inflight, 0.0, CONFIG, first, 0).replica_id, "r0")
        later = b"p\x00" + b"question"
        self.assertEqual(
            choose("prefix", rs, inflight, 0.0, CONFIG, later, 0, recent={"r0": 3}).replica_id,
            choose("prefix", rs, inflight, 0.0, CONFIG, later, 0).replica_id,
        )

    def test_no_key_is_least_loaded(self) -> None:
        """
        Under C{prefix}, a request without a key goes to the least loaded.
        """
        r = Router(Clock())
        rs = routes(3)
        r.begin("r0")
        r.begin("r2")
        self.assertEqual(r.pick(rs, (), "prefix", None).replica_id, "r1")  # type: ignore[union-attr]


class OtherPolicyTests(SynchronousTestCase):
    def test_round_robin_ignores_load(self) -> None:
        """
        C{round_robin} takes each eligible replica in turn, loaded or not.
        """
        r = Router(Clock())
        rs = routes(3)
        for _ in range(10):
            r.begin("r0")
        got = Counter(r.pick(rs, (), "round_robin").replica_id for _ in range(30))  # type: ignore[union-attr]
        self.assertEqual(got, {"r0": 10, "r1": 10, "r2": 10})

    def test_least_loaded_uses_signals(self) -> None:
        """
        C{least_loaded} counts what fresh engine signals show beyond this
        gateway's own requests (other gateways' work).
        """
        clock = Clock()
        clock.advance(100)
        busy = EngineSignals(sampled_at=99.0, waiting=4, running=4)
        idle = EngineSignals(sampled_at=99.0, waiting=0, running=0)
        r = Router(clock, policy=ENGINE_LOAD)
        rs = routes(3, {"r0": busy, "r1": idle, "r2": idle})
        r.begin("r1")
        r.begin("r2")
        got = Counter(r.pick(rs, (), "least_loaded").replica_id for _ in range(6))  # type: ignore[union-attr]
        self.assertEqual(set(got), {"r1", "r2"})

    def test_unknown_policy(self) -> None:
        """
        An unknown policy name is an error that names the known ones.
        """
        e = self.assertRaises(ValueError, choose, "random", routes(1), lambda _: 0, 0.0, CONFIG, None, 0)
        self.assertIn("round_robin", str(e))


class PublishedPolicyTests(SynchronousTestCase):
    def test_table_carries_policies(self) -> None:
        """
        A routing table's per-model policies change its revision, travel in
        the routes document and come back out of it.
        """
        table = RoutingTable(Clock())
        rev = table.revision
        self.assertTrue(table.set_policies({"m": "round_robin"}))
        self.assertGreater(table.revision, rev)
        self.assertFalse(table.set_policies({"m": "round_robin"}))
        self.assertEqual(table.policy("m"), "round_robin")
        self.assertIsNone(table.policy("other"))
        doc = snapshot_to_json(table, 0.0)
        self.assertEqual(doc["policies"], {"m": "round_robin"})
        snap, problems = snapshot_from_json(doc, 0.0)
        self.assertEqual((snap.policy("m"), problems), ("round_robin", []))
        self.assertRaises(ValueError, table.set_policies, {"m": "random"})

    def test_policy_source(self) -> None:
        """
        With a policy source, publishing the declared models publishes the
        policies the source gives at that time.
        """
        table = RoutingTable(Clock())
        current = {"m": "prefix"}
        table.policy_source = lambda: current
        self.assertTrue(table.set_known(["m"]))
        self.assertEqual(table.policy("m"), "prefix")
        current = {"m": "least_loaded"}
        self.assertTrue(table.set_known(["m"]))
        self.assertEqual(table.snapshot().policy("m"), "least_loaded")

    def test_old_documents(self) -> None:
        """
        A routes document without policies (an older control plane) reads
        as no policies; a bad entry is a problem that costs only itself.
        """
        snap, problems = snapshot_from_json({"revision": 1, "known": ["m"], "routes": []}, 0.0)
        self.assertEqual((snap.policies(), problems), ({}, []))
        snap, problems = snapshot_from_json(
            {"revision": 1, "known": [], "routes": [], "policies": {"a": "prefix", "b": "fastest"}},
            0.0,
        )
        self.assertEqual(snap.policies(), {"a": "prefix"})
        self.assertEqual(len(problems), 1)
        self.assertIn("fastest", problems[0])

    def test_catalog_routing_field(self) -> None:
        """
        A deployment's C{routing} is one of the policies; the catalog maps
        the models that name one to it, and refuses any other value.
        """
        profile = {"p": {"command": ["x"], "gpus_per_shard": 1}}
        cat = parse_catalog(
            {
                "profiles": profile,
                "deployments": [
                    {"model": "a", "profile": "p", "routing": "round_robin"},
                    {"model": "b", "profile": "p"},
                ],
            }
        )
        self.assertEqual(cat.routing_policies(), {"a": "round_robin"})
        e = self.assertRaises(
            CatalogError,
            parse_catalog,
            {"profiles": profile, "deployments": [{"model": "a", "profile": "p", "routing": "random"}]},
        )
        self.assertIn("routing", str(e))
        self.assertIn("least_loaded", str(e))


class GatewayPolicyTests(SynchronousTestCase):
    def test_table_policy_then_default(self) -> None:
        """
        The gateway routes a model by the policy its routing table names,
        and a model the table names none for by the configured default.
        """
        from llmgw.gateway.proxy import Gateway, GatewayConfig

        table = RoutingTable(Clock())
        table.set_policies({"a": "round_robin"})
        gw = Gateway(Clock(), table, GatewayConfig(default_policy="least_loaded"))
        self.assertEqual((gw.policy_for("a"), gw.policy_for("b")), ("round_robin", "least_loaded"))
        self.assertEqual(Gateway(Clock(), RoutingSnapshot()).policy_for("b"), "prefix")


class PrefixThroughGatewayTests(TestCase):
    """
    Prefix routing through a real gateway on loopback, to fake replicas.
    """

    @inlineCallbacks
    def test_conversation_and_session_stick(self) -> Any:
        """
        Under C{prefix}, every later turn of a conversation reaches the
        replica its second turn reached, and requests with one X-Session-Id reach one
        replica whatever their prompts.
        """
        from tests.gateway_helpers import Harness

        h = Harness(self)
        h.policies["demo"] = "prefix"
        for name in ("r1", "r2", "r3", "r4"):
            h.replica(name)

        @inlineCallbacks
        def who(body: dict[str, Any], headers: dict[bytes, list[bytes]] | None = None) -> Any:
            response = yield h.post("/v1/chat/completions", {**body, "model": "demo"}, headers=headers or {})
            self.assertEqual(response.code, 200)
            doc = yield response.json()
            return doc["choices"][0]["message"]["content"]

        for c in range(6):
            turns = [f"conversation {c} opens", "an answer", "a follow-up", "another answer", "more"]
            homes = set()
            for n in range(3, len(turns) + 1, 2):
                homes.add((yield who(chat("Shared system prompt. " * 30, *turns[:n]))))
            self.assertEqual(len(homes), 1, f"conversation {c} moved: {homes}")
        sessions = set()
        for c in range(5):
            sessions.add((yield who(chat(f"prompt {c}", "q"), {b"X-Session-Id": [b"abc"]})))
        self.assertEqual(len(sessions), 1)


class ControlPlaneHookTests(SynchronousTestCase):
    def test_follow_catalog_policies(self) -> None:
        """
        The control plane's hook publishes the catalog's routing policies at
        once, and again (the reloaded catalog's) whenever the declared models
        are published.
        """
        from types import SimpleNamespace

        from llmgw.control.service import follow_catalog_policies

        profile = {"p": {"command": ["x"], "gpus_per_shard": 1}}

        def catalog(routing: str) -> Any:
            return parse_catalog(
                {"profiles": profile, "deployments": [{"model": "a", "profile": "p", "routing": routing}]}
            )

        reconciler = SimpleNamespace(routing_table=RoutingTable(Clock()), catalog=catalog("round_robin"))
        follow_catalog_policies(reconciler)
        self.assertEqual(reconciler.routing_table.policy("a"), "round_robin")
        reconciler.catalog = catalog("least_loaded")
        reconciler.routing_table.set_known(["a"])
        self.assertEqual(snapshot_to_json(reconciler.routing_table, 0.0)["policies"], {"a": "least_loaded"})


class ChunkHashTests(SynchronousTestCase):
    def test_short_text_is_its_first_chunk(self) -> None:
        """
        A text no longer than one chunk hashes as the first link of the
        chain that a longer text with the same start begins with; an empty
        text has no hashes.
        """
        from llmgw.gateway.policy import chunk_hashes

        self.assertEqual(chunk_hashes("", 4, 8), [])
        short = chunk_hashes("abcd", 4, 8)
        self.assertEqual(len(short), 1)
        self.assertEqual(chunk_hashes("abcdefgh", 4, 8)[0], short[0])
        self.assertEqual(chunk_hashes("abc", 4, 8), chunk_hashes("abcx", 3, 8)[:1])
        self.assertNotEqual(chunk_hashes("abce", 4, 8), short)
