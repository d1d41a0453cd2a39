"""
The prefix index (llmgw.gateway.prefixindex) and the C{cache_aware} policy
that routes by it: applications that send one long system prompt with a
different question each time keep to a replica, within the load bound, and
two gateways agree; C{prefix} neither reads nor feeds the index.
"""

from __future__ import annotations

import random
from collections import Counter

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import parse_catalog
from llmgw.gateway.policy import (
    FIRST_TURN,
    PolicyConfig,
    Ring,
    affinity_key,
    bounded_prefix,
    chunk_hashes,
    head_hashes,
    key_chain,
    load_bound,
    split_chain,
)
from llmgw.gateway.prefixindex import BALANCE_WINDOW, HASH_BYTES, PrefixIndex
from llmgw.gateway.router import Router
from llmgw.gateway.sharing import Shares
from llmgw.routing import Route

CONFIG = PolicyConfig()
#: The index off: C{cache_aware} routing as C{prefix} does.
NO_INDEX = PolicyConfig(prefix_match=2.0)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def routes(n: int) -> tuple[Route, ...]:
    return tuple(Route(f"r{i}", "m", f"10.0.0.{i + 1}:8000") for i in range(n))


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ask(system: str, question: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def chain(s: str, chunk: int = 4) -> bytes:
    return b"".join(chunk_hashes(s, chunk, 64))


class PrefixIndexTests(SynchronousTestCase):
    def test_match_counts_shared_chunks(self) -> None:
        """
        A replica sent a prompt holds every prefix of it: a prompt sharing
        its first chunks matches that many on that replica, none elsewhere.
        """
        index = PrefixIndex()
        index.add(chain("aaaabbbbcccc"), "r0")
        index.add(chain("xxxxyyyy"), "r1")
        self.assertEqual(index.match(chain("aaaabbbbdddd"), {"r0", "r1"}), {"r0": 2})
        self.assertEqual(index.match(chain("aaaabbbbcccc"), {"r0", "r1"}), {"r0": 3})
        self.assertEqual(index.match(chain("zzzz"), {"r0", "r1"}), {})
        self.assertEqual(index.match(chain("aaaabbbb"), {"r1"}), {})

    def test_bounded_deepest_first(self) -> None:
        """
        The index never holds more than its bound, and eviction takes a
        prompt's deepest chunks before its beginning.
        """
        index = PrefixIndex(max_entries=5)
        index.add(chain("aaaabbbbccccdddd"), "r0")
        index.add(chain("xxxxyyyy"), "r1")
        self.assertEqual(len(index), 5)
        self.assertEqual(index.match(chain("aaaabbbbccccdddd"), {"r0"}), {"r0": 3})
        rng = random.Random(1)
        for _ in range(200):
            index.add(chain(text(rng, 8)), f"r{rng.randrange(4)}")
            self.assertLessEqual(len(index), 5)

    def test_forget(self) -> None:
        """
        A replica gone from the table is forgotten, with the chunks only it
        held; the others' stay.
        """
        index = PrefixIndex()
        index.add(chain("aaaabbbb"), "r0")
        index.add(chain("aaaacccc"), "r1")
        index.forget({"r1"})
        self.assertEqual(index.match(chain("aaaabbbb"), {"r0", "r1"}), {"r1": 1})
        self.assertEqual(len(index), 2)

    def test_key_chain(self) -> None:
        """
        A prompt key made with its chain carries its head's chained hashes,
        and less them is the key C{prefix} makes; a session's key has none.
        """
        body = ask("s" * 600, "question")
        full = affinity_key(body, None, CONFIG, chain=True) or b""
        self.assertEqual(len(key_chain(full)) % HASH_BYTES, 0)
        self.assertGreater(len(key_chain(full)), HASH_BYTES)
        self.assertEqual(split_chain(full), (affinity_key(body, None, CONFIG), key_chain(full)))
        self.assertEqual(len(affinity_key(body, None, CONFIG) or b""), 2 + HASH_BYTES)
        self.assertEqual(key_chain(affinity_key(body, "sess", CONFIG, chain=True) or b""), b"")

    def test_catalog_names_cache_aware(self) -> None:
        """
        A deployment may name C{cache_aware} as its routing policy.
        """
        cat = parse_catalog(
            {
                "profiles": {"p": {"command": ["x"], "gpus_per_shard": 1}},
                "deployments": [{"model": "a", "profile": "p", "routing": "cache_aware"}],
            }
        )
        self.assertEqual(cat.routing_policies(), {"a": "cache_aware"})


class SharedPrefixRoutingTests(SynchronousTestCase):
    def pick(
        self, router: Router, rs: tuple[Route, ...], body: dict[str, object], policy: str = "cache_aware"
    ) -> str:
        aware = policy == "cache_aware"
        route = router.pick(rs, (), policy, affinity_key(body, None, router.policy, chain=aware))
        assert route is not None
        return route.replica_id

    def test_same_system_prompt_same_replica(self) -> None:
        """
        Requests with one long system prompt and a different question each
        keep to one replica while its load allows, though each is a first
        turn; without the index, or under C{prefix}, they are dealt out
        over the replicas.
        """
        rng = random.Random(2)
        system = text(rng, 300)
        for policy, config, together in (
            ("cache_aware", CONFIG, True),
            ("cache_aware", NO_INDEX, False),
            ("prefix", CONFIG, False),
        ):
            clock = Clock()
            router = Router(clock, policy=config)
            rs = routes(2)
            got = set()
            for i in range(6):
                rid = self.pick(router, rs, ask(system, f"question {i}: {text(rng, 8)}"), policy)
                router.begin(rid)
                got.add(rid)
            self.assertEqual(len(got) == 1, together, (policy, config))

    def test_match_held_to_its_own_slack(self) -> None:
        """
        Requests that share only a system prompt stay on its replica while
        it is within the bound with C{match_slack}, not C{slack}: the
        eighth of eight in flight on two replicas goes to the other one
        with C{match_slack} 2, and stays with C{match_slack} 4.
        """
        rng = random.Random(9)
        system = text(rng, 300)
        for match_slack, spread in ((2, True), (4, False)):
            router = Router(Clock(), policy=PolicyConfig(match_slack=match_slack))
            rs = routes(2)
            got = []
            for i in range(8):
                rid = self.pick(router, rs, ask(system, f"q{i} {text(rng, 5)}"))
                router.begin(rid)
                got.append(rid)
            self.assertEqual(len(set(got[:7])), 1, match_slack)
            self.assertEqual(got[7] != got[0], spread, match_slack)

    def test_prefix_leaves_the_index_alone(self) -> None:
        """
        C{prefix} adds nothing to the router's index, even when given a
        key made with its chain.
        """
        rng = random.Random(8)
        router = Router(Clock(), policy=CONFIG)
        for _ in range(10):
            body = ask(text(rng, 300), "q")
            router.pick(routes(2), (), "prefix", affinity_key(body, None, CONFIG))
            router.pick(routes(2), (), "prefix", affinity_key(body, None, CONFIG, chain=True))
        self.assertEqual(len(router.prefixes), 0)

    def test_load_bound_respected(self) -> None:
        """
        A replica holding the prefix takes no request that would put it
        over the bound: the rest go elsewhere.
        """
        rng = random.Random(3)
        system = text(rng, 300)
        router = Router(Clock(), policy=CONFIG)
        rs = routes(2)
        loads: Counter[str] = Counter()
        for i in range(30):
            total = sum(loads.values())
            rid = self.pick(router, rs, ask(system, f"q{i} {text(rng, 5)}"))
            self.assertLessEqual(loads[rid] + 1, load_bound(total, 2, CONFIG.epsilon, CONFIG.slack))
            router.begin(rid)
            loads[rid] += 1
        self.assertEqual(set(loads), {"r0", "r1"})

    def test_applications_keep_to_a_replica(self) -> None:
        """
        Eight applications, each its own system prompt, requests one after
        another: each keeps to one replica, and both replicas take some.
        """
        rng = random.Random(4)
        systems = [text(rng, 250) for _ in range(8)]
        clock = Clock()
        router = Router(clock, policy=CONFIG)
        rs = routes(2)
        where: dict[int, set[str]] = {}
        for _ in range(200):
            app = rng.randrange(8)
            rid = self.pick(router, rs, ask(systems[app], text(rng, 10)))
            where.setdefault(app, set()).add(rid)
            clock.advance(0.05)
        self.assertEqual([len(s) for s in where.values()], [1] * len(where))
        self.assertEqual(set().union(*where.values()), {"r0", "r1"})

    def test_two_gateways_agree(self) -> None:
        """
        Two routers with the same table, each seeing every application for
        the first time while idle, send it to the same replica, and keep
        it there.
        """
        rng = random.Random(5)
        systems = [text(rng, 250) for _ in range(8)]
        rs = routes(3)
        clocks = [Clock(), Clock()]
        gateways = [Router(c, policy=CONFIG) for c in clocks]
        chosen: dict[int, set[str]] = {}
        for i in range(120):
            app = rng.randrange(8)
            gw = i % 2 if i >= 16 else i // 8  # the first eight on one, the next eight on the other
            rid = self.pick(gateways[gw], rs, ask(systems[app], text(rng, 10)))
            chosen.setdefault(app, set()).add(rid)
            for c in clocks:
                c.advance(1.0)
        self.assertEqual([len(s) for s in chosen.values()], [1] * len(chosen))

    def test_index_bounded_in_the_router(self) -> None:
        """
        The router's index stays within its bound however many distinct
        prompts it routes.
        """
        router = Router(Clock(), policy=CONFIG, prefixes=PrefixIndex(max_entries=50))
        rng = random.Random(6)
        rs = routes(2)
        for _ in range(100):
            self.pick(router, rs, ask(text(rng, 200), "q"))
            self.assertLessEqual(len(router.prefixes), 50)

    def test_forget_reaches_the_index(self) -> None:
        """
        A replica leaving the table leaves the router's index too.
        """
        router = Router(Clock(), policy=CONFIG)
        rng = random.Random(7)
        system = text(rng, 300)
        rid = self.pick(router, routes(2), ask(system, "q"))
        router.forget({"r0", "r1"} - {rid})
        key = affinity_key(ask(system, "q2"), None, CONFIG, chain=True) or b""
        self.assertEqual(router.prefixes.match(key_chain(key), {"r0", "r1"}), {})


class HeadHashTests(SynchronousTestCase):
    def test_short_system_prompt_has_its_own_chunk(self) -> None:
        """
        A chat's head is chunked a message at a time: requests sharing a
        system prompt shorter than a chunk (or any length) share every
        hash of it, whatever their questions.
        """
        for size in (240, 250, 600):
            system = "s" * size
            a = key_chain(affinity_key(ask(system, "one question"), None, CONFIG, chain=True) or b"")
            b = key_chain(affinity_key(ask(system, "another"), None, CONFIG, chain=True) or b"")
            shared = -(-(size + len("system") + 2) // CONFIG.chunk_chars) * HASH_BYTES
            self.assertEqual(a[:shared], b[:shared], size)
            self.assertNotEqual(a[shared : shared + HASH_BYTES], b[shared : shared + HASH_BYTES], size)

    def test_head_hashes_bounded(self) -> None:
        """
        A head of many messages has at most C{max_chunks} hashes.
        """
        config = PolicyConfig(chunk_chars=4, max_chunks=5)
        body = {"messages": [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 40}]}
        self.assertEqual(len(head_hashes(body, config.chunk_chars, config.max_chunks)), 5)


class BalanceTests(SynchronousTestCase):
    def test_latest_holder_last(self) -> None:
        """
        Of the replicas holding the most of a prompt, the index lists the
        one sent it last, last; and C{cache_aware} sends the next such
        request there.
        """
        index = PrefixIndex()
        index.add(chain("aaaabbbb"), "r1")
        index.add(chain("aaaabbbb"), "r0")
        self.assertEqual(list(index.match(chain("aaaabbbbcccc"), {"r0", "r1"})), ["r1", "r0"])
        index.add(chain("aaaabbbbdddd"), "r1")
        self.assertEqual(list(index.match(chain("aaaabbbbcccc"), {"r0", "r1"})), ["r0", "r1"])
        rs = routes(2)
        picked = bounded_prefix(
            rs, {"r0": 0, "r1": 0}, None, FIRST_TURN + b"k" * 8, 0.25, slack=4, recent={},
            depths=index.match(chain("aaaabbbbcccc"), {"r0", "r1"}), chain=chain("aaaabbbbcccc"),
        )
        self.assertEqual(picked and picked.replica_id, "r1")

    def test_shares_told_after_a_window(self) -> None:
        """
        The index tells what each replica was sent lately once it has been
        sent a window's worth, the latest weighing most, and not for a
        window after a prompt's beginning went to a replica other than
        its last.
        """
        index = PrefixIndex()
        for i in range(BALANCE_WINDOW - 1):
            index.add(chain(f"a{i:03d}bbbb"), "r0" if i % 4 else "r1")
        self.assertIsNone(index.shares().sent)
        index.add(chain("bbbb"), "r0")
        weights = index.shares().sent
        assert weights is not None
        self.assertGreater(weights["r0"] / (weights["r0"] + weights["r1"]), 0.7)
        for i in range(BALANCE_WINDOW):
            index.add(chain(f"c{i:03d}dddd"), "r1")
        weights = index.shares().sent
        assert weights is not None
        self.assertGreater(weights["r1"] / (weights["r0"] + weights["r1"]), 0.6)
        index.add(chain("bbbb"), "r1")
        self.assertIsNone(index.shares().sent)

    def test_move_off_a_replica_over_its_share(self) -> None:
        """
        A match on a replica over C{1 + balance} times the mean share, and
        busier than another, goes to the one with the least share; not
        when it is no busier, nor when the shares are even.
        """
        rs = routes(2)
        c = chain("aaaabbbbcccc")
        skewed = {"r0": 0.7, "r1": 0.3}

        def pick(loads: dict[str, int], shares: dict[str, float]) -> str:
            r = bounded_prefix(rs, loads, None, FIRST_TURN + b"k" * 8, 0.25, slack=4, recent={},
                               depths={"r0": 2}, chain=c, shares=Shares(sent=shares), balance=0.15)
            assert r is not None
            return r.replica_id

        self.assertEqual(pick({"r0": 2, "r1": 1}, skewed), "r1")
        self.assertEqual(pick({"r0": 1, "r1": 1}, skewed), "r0")
        self.assertEqual(pick({"r0": 2, "r1": 1}, {"r0": 0.55, "r1": 0.45}), "r0")

    def test_router_evens_out_applications(self) -> None:
        """
        Four applications all kept on one replica while it is busier than
        the other: after a window of sends, they are moved off it one at a
        time, each moved one staying where it went, until the shares are
        even; every application keeps to one replica at a time.
        """
        rs = routes(2)
        ring = Ring(["r0", "r1"], CONFIG.vnodes)
        rng = random.Random(12)
        systems: list[str] = []
        while len(systems) < 4:
            # Applications an idle gateway places on r0.
            s = text(rng, 250)
            first = key_chain(affinity_key(ask(s, "q"), None, CONFIG, chain=True) or b"")[:HASH_BYTES]
            if ring.walk(FIRST_TURN + first)[0] == "r0":
                systems.append(s)
        clock = Clock()
        router = Router(clock, policy=CONFIG)
        for s in systems:
            self.assertEqual(self.pick(router, rs, ask(s, "hello")), "r0")
            clock.advance(1.0)
        in_flight: list[str] = []
        seq: list[tuple[int, str]] = []
        for i in range(8 * BALANCE_WINDOW):
            app = i % 4
            rid = self.pick(router, rs, ask(systems[app], f"q{i} {text(rng, 5)}"))
            seq.append((app, rid))
            router.begin(rid)
            in_flight.append(rid)
            if len(in_flight) > 4:
                router.end(in_flight.pop(0))
        moves = [i for i in range(4, len(seq)) if seq[i][1] != seq[i - 4][1]]
        self.assertGreaterEqual(len(moves), 1)
        self.assertTrue(all(b - a >= BALANCE_WINDOW for a, b in zip(moves, moves[1:], strict=False)), moves)
        last = Counter(rid for _, rid in seq[-2 * BALANCE_WINDOW :])
        self.assertEqual(last["r0"], last["r1"])

    def test_new_applications_dealt_out(self) -> None:
        """
        Under load, applications new to the index are dealt out over the
        replicas by how many were placed on each lately, not by how many
        requests each was sent: eight, the first of them busy, four on
        each (the shares of the sends are evened out by moves, later).
        """
        rng = random.Random(13)
        router = Router(Clock(), policy=CONFIG)
        rs = routes(2)
        router.begin("r0")
        router.begin("r1")
        where: dict[int, set[str]] = {}
        for app in range(8):
            system = text(rng, 250)
            for i in range(7 if app == 0 else 1):
                rid = self.pick(router, rs, ask(system, f"q{i} {text(rng, 5)}"))
                router.begin(rid)
                router.end(rid)
                where.setdefault(app, set()).add(rid)
        self.assertEqual([len(s) for s in where.values()], [1] * 8)
        self.assertEqual(Counter(min(s) for s in where.values()), {"r0": 4, "r1": 4})

    def pick(self, router: Router, rs: tuple[Route, ...], body: dict[str, object]) -> str:
        route = router.pick(rs, (), "cache_aware", affinity_key(body, None, router.policy, chain=True))
        assert route is not None
        return route.replica_id
