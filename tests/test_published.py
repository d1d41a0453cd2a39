"""
L{llmgw.control.ha.published}, L{llmgw.control.ha.published_fleet} and
L{llmgw.control.ha.publishing}: the leader's routing table and fleet views
published in etcd (debounced, lease-guarded, bounded) and followed by the
other members (fail static), against the in-memory etcd on a Clock; and the
HA members that use them.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.ha.election import Role, leader_key
from llmgw.control.ha.published import (
    RoutesFollower,
    RoutesPublisher,
    pack,
    routes_document,
    routes_key,
    unpack,
)
from llmgw.control.ha.published_fleet import (
    FleetDocument,
    FleetFollower,
    FleetPack,
    FleetPublisher,
    fleet_key,
    pack_fleet,
    unpack_fleet,
)
from llmgw.routing import EngineSignals, Route, RoutesDataError, RoutingTable
from llmgw.testing.fakeetcd import FakeEtcd
from tests.test_ha import Member

PREFIX = "/llmgw"
KEY = routes_key(PREFIX)


def published(fake: FakeEtcd) -> list[str]:
    """The replica ids of the table published in C{fake}."""
    return [r["replica"] for r in unpack(fake.kvs[KEY].value)["routes"]]


class Leading:
    """A lease that holds the leader key in the fake, as a leader's does."""

    def __init__(self, fake: FakeEtcd):
        granted: list[tuple[int, int]] = []
        fake.grant(1000).addCallback(granted.append)
        self.lease = granted[0][0]
        fake.put(leader_key(PREFIX), b"{}", lease=self.lease)


class PublisherTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.fake = FakeEtcd(self.clock)
        self.table = RoutingTable(self.clock)
        self.logged: list[dict[str, Any]] = []
        self.publisher = RoutesPublisher(self.clock, self.fake, PREFIX, self.table)
        self.publisher.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]

    def route(self, rid: str, **kw: Any) -> Route:
        return Route(rid, "demo", f"10.0.0.1:{9000 + int(rid[1:])}", **kw)

    def writes(self) -> int:
        return self.fake.calls.count("txn")

    def test_debounced_and_only_on_change(self) -> None:
        """
        The table is written at once at the start, then at most once a
        second however often it changes (the last state wins), and not at
        all while it does not change; a change of engine signals alone is
        not even packed, a replica starting to drain is written.
        """
        lead = Leading(self.fake)
        self.table.publish_model("demo", [self.route("r1")])
        self.publisher.start(lead.lease)
        self.clock.advance(0)
        self.assertEqual(self.writes(), 1)
        self.assertEqual(published(self.fake), ["r1"])
        for i in range(2, 6):
            self.table.publish_model("demo", [self.route(f"r{j}") for j in range(1, i + 1)])
            self.clock.advance(0.1)
        self.assertEqual(self.writes(), 1)
        self.clock.advance(0.6)
        self.assertEqual(self.writes(), 2)
        self.assertEqual(published(self.fake), ["r1", "r2", "r3", "r4", "r5"])
        self.clock.advance(5)
        self.assertEqual(self.writes(), 2)
        packs = self.publisher.packs
        busy = EngineSignals(sampled_at=self.clock.seconds(), waiting=3)
        self.table.publish_model("demo", [self.route("r1", signals=busy)]
                                 + [self.route(f"r{j}") for j in range(2, 6)])
        self.clock.advance(2)
        self.assertEqual(self.writes(), 2)
        self.assertEqual(self.publisher.packs, packs, "a change of signals alone packed the table")
        self.table.publish_model("demo", [self.route(f"r{j}", draining=j == 2) for j in range(1, 6)])
        self.clock.advance(1)
        self.assertEqual(self.writes(), 3)
        self.assertNotIn("signals", unpack(self.fake.kvs[KEY].value)["routes"][0])

    def test_start_with_current_value_writes_nothing(self) -> None:
        """
        A leader that starts with the table etcd already holds (the one it
        followed) does not write it again.
        """
        lead = Leading(self.fake)
        self.table.publish_model("demo", [self.route("r1")])
        current = pack(routes_document(self.table, 0))
        self.publisher.start(lead.lease, current=current)
        self.clock.advance(3)
        self.assertEqual(self.writes(), 0)

    def test_deposed_leaders_publish_refused(self) -> None:
        """
        Once another lease holds the leader key, the old leader's write is
        refused by etcd: the published table stays the new leader's, the
        publisher stops, and the refusal is logged as an error.
        """
        old = Leading(self.fake)
        self.table.publish_model("demo", [self.route("r1")])
        self.publisher.start(old.lease)
        self.clock.advance(0)
        self.fake.expire(old.lease)
        new = Leading(self.fake)
        theirs = RoutingTable(self.clock)
        theirs.publish_model("demo", [self.route("r7")])
        other = RoutesPublisher(self.clock, self.fake, PREFIX, theirs)
        other.start(new.lease)
        self.clock.advance(0)
        self.assertEqual(published(self.fake), ["r7"])
        self.table.publish_model("demo", [self.route("r2")])
        self.clock.advance(1)
        self.assertEqual(published(self.fake), ["r7"])
        self.assertEqual(self.publisher.refused, 1)
        self.assertIsNone(self.publisher.lease)
        self.assertTrue(any(e.get("log_level").name == "error" and "no longer leads" in e["log_format"]
                            for e in self.logged))
        self.table.publish_model("demo", [self.route("r3")])
        self.clock.advance(5)
        self.assertEqual(published(self.fake), ["r7"])
        other.stop()

    def test_unreachable_etcd_retried(self) -> None:
        """
        A write etcd could not take is tried again a second later, until it
        goes through.
        """
        lead = Leading(self.fake)
        self.table.publish_model("demo", [self.route("r1")])
        self.fake.available = False
        self.publisher.start(lead.lease)
        self.clock.advance(0)
        self.assertNotIn(KEY, self.fake.kvs)
        self.clock.advance(1)
        self.assertNotIn(KEY, self.fake.kvs)
        self.fake.available = True
        self.clock.advance(1)
        self.assertEqual(published(self.fake), ["r1"])

    def test_failed_pack_tried_again(self) -> None:
        """
        A raise while packing the table is logged, and the table is packed
        and written an interval later: the publisher does not go quiet.
        """
        from llmgw.control.ha import published as mod

        lead = Leading(self.fake)
        self.table.publish_model("demo", [self.route("r1")])
        real = mod.routes_document

        def broken(*a: Any) -> Any:
            raise ValueError("a bug")

        self.patch(mod, "routes_document", broken)
        self.publisher.start(lead.lease)
        self.clock.advance(0)
        self.assertNotIn(KEY, self.fake.kvs)
        self.assertEqual([e["log_failure"].type for e in self.logged if "log_failure" in e], [ValueError])
        self.patch(mod, "routes_document", real)
        self.clock.advance(1)
        self.assertEqual(published(self.fake), ["r1"])

    def test_too_large_not_written(self) -> None:
        """
        A table over the size limit compressed is not published (etcd would
        refuse it): the last one stays in etcd, and the error is logged once.
        """
        lead = Leading(self.fake)
        small = RoutesPublisher(self.clock, self.fake, PREFIX, self.table, max_size=400)
        small.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.table.publish_model("demo", [self.route("r1")])
        small.start(lead.lease)
        self.clock.advance(0)
        self.assertEqual(published(self.fake), ["r1"])
        import random

        rng = random.Random(1)
        big = [Route(f"r{i}-{rng.getrandbits(64):x}", "demo", f"10.{rng.randrange(256)}.0.1:{i}")
               for i in range(1, 60)]
        self.table.publish_model("demo", big)
        self.clock.advance(1)
        self.table.publish_model("demo", big[:-1])
        self.clock.advance(1)
        self.assertEqual(published(self.fake), ["r1"])
        self.assertEqual(small.too_large, 2)
        errors = [e for e in self.logged if "over the" in e["log_format"]]
        self.assertEqual(len(errors), 1)
        small.stop()


class FollowerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.fake = FakeEtcd(self.clock)
        self.table = RoutingTable(self.clock)
        self.logged: list[dict[str, Any]] = []
        self.follower = RoutesFollower(self.clock, self.fake, PREFIX, self.table)
        self.follower.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.addCleanup(self.follower.stop)

    def publish(self, *rids: str, policies: dict[str, str] | None = None) -> None:
        source = RoutingTable(self.clock)
        source.publish([Route(r, "demo", "10.0.0.1:9000") for r in rids], ["demo", "other"])
        if policies:
            source.set_policies(policies)
        self.fake.put(KEY, pack(routes_document(source, 0)))

    def ids(self) -> list[str]:
        return [r.replica_id for r in self.table.routes("demo")]

    def test_applies_what_is_published_and_each_change(self) -> None:
        """
        A follower takes the published table (routes, declared models and
        policies) at start and each new one as it is written.
        """
        self.publish("r1", policies={"demo": "round_robin"})
        self.follower.start()
        self.assertEqual(self.ids(), ["r1"])
        self.assertTrue(self.table.knows_model("other"))
        self.assertEqual(self.table.policy("demo"), "round_robin")
        revision = self.table.revision
        self.publish("r1", "r2")
        self.assertEqual(self.ids(), ["r1", "r2"])
        self.assertEqual(self.table.policy("demo"), None)
        self.assertGreater(self.table.revision, revision)

    def test_fail_static(self) -> None:
        """
        While etcd is away, after the key is deleted, and when an
        unreadable value is written, the follower keeps the last table (and
        logs why); once etcd answers again it reads what is there.
        """
        self.publish("r1")
        self.follower.start()
        self.fake.available = False
        for w in list(self.fake.watches):
            w.done.errback(RuntimeError("connection lost"))
        self.clock.advance(5)
        self.assertEqual(self.ids(), ["r1"])
        self.assertTrue(self.follower.last_error)
        self.fake.available = True
        self.publish("r2")  # no watch now: read at the next retry
        self.clock.advance(1)
        self.assertEqual(self.ids(), ["r2"])
        self.fake.delete(KEY)
        self.assertEqual(self.ids(), ["r2"])
        self.fake.put(KEY, b"not zlib at all")
        self.fake.put(KEY, zlib.compress(b"[1, 2]"))
        self.assertEqual(self.ids(), ["r2"])
        errors = [e for e in self.logged if e.get("log_level").name == "error"]
        self.assertEqual(len(errors), 2, errors)
        self.assertIn("unreadable", errors[0]["log_format"])

    def test_stopped_follower_applies_nothing(self) -> None:
        """
        Once stopped (its member leads), a follower leaves the table alone.
        """
        self.publish("r1")
        self.follower.start()
        self.follower.stop()
        self.publish("r2")
        self.clock.advance(5)
        self.assertEqual(self.ids(), ["r1"])

    def test_restart_applies_the_published_table_again(self) -> None:
        """
        A follower started again (its member stepped down) replaces the
        table with what etcd holds even when that is the document it applied
        before: meanwhile its own reconciler rewrote the table.
        """
        self.publish("r1")
        self.follower.start()
        self.follower.stop()
        self.table.publish_model("demo", [Route("mine", "demo", "10.0.0.9:9000")])
        self.follower.start()
        self.assertEqual(self.ids(), ["r1"])
        self.assertTrue(self.follower.applied)

    def test_follower_survives_a_raise_while_applying(self) -> None:
        """
        A document too deeply nested to parse is logged as unreadable, and
        a raise from the table is logged: either way the follower goes on
        watching and takes the next document.
        """
        self.fake.put(KEY, zlib.compress(b"[" * 100000 + b"]" * 100000))
        self.follower.start()
        self.assertTrue(any("unreadable" in e["log_format"] for e in self.logged))
        self.publish("r1")
        self.assertEqual(self.ids(), ["r1"])
        real = self.table.replace

        def broken(snapshot: Any) -> bool:
            raise RuntimeError("a bug")

        self.patch(self.table, "replace", broken)
        self.publish("r2")
        self.assertEqual([e["log_failure"].type for e in self.logged if "log_failure" in e], [RuntimeError])
        self.patch(self.table, "replace", real)
        self.publish("r3")
        self.assertEqual(self.ids(), ["r3"])

    def test_unpack_is_bounded(self) -> None:
        """
        A value that inflates past the limit is refused, not inflated whole.
        """
        from llmgw.control.ha import publishing

        self.patch(publishing, "MAX_INFLATED", 1000)
        self.assertRaises(RoutesDataError, unpack, zlib.compress(b" " * 5000))


class HAMemberRoutesTests(SynchronousTestCase):
    """Two HA members: the leader publishes, the other follows."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeEtcd(self.reactor)

    def member(self, name: str) -> Member:
        m = Member(self.reactor, self.fake, name)
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        return m

    def advance(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)

    def ids(self, m: Member) -> list[str]:
        return [r.replica_id for r in m.reconciler.routing_table.routes("demo")]

    def test_no_table_no_routes_answered(self) -> None:
        """
        A member that neither leads nor holds a published table does not
        answer routes itself (an empty table would make gateways drop every
        route): etcd does not answer it here.
        """
        self.fake.hang = True
        c = self.member("c")
        self.advance(1)
        self.assertFalse(c.ha.serves_routes())

    def test_follower_follows_the_leader(self) -> None:
        """
        A follower answers routes itself once it holds a published table;
        its routing table (its gateway's) becomes the leader's within a
        second of each change.
        """
        a = self.member("a")
        self.advance(0.1)
        b = self.member("b")
        self.advance(0.1)
        self.assertIs(a.ha.election.role, Role.LEADER)
        self.assertTrue(a.ha.serves_routes())
        a.reconciler.routing_table.publish_model("demo", [Route("r1", "demo", "10.0.0.1:9000")])
        self.advance(1.1)
        self.assertEqual(self.ids(b), ["r1"])
        self.assertTrue(b.ha.serves_routes())
        a.reconciler.routing_table.publish_model("demo", [Route("r2", "demo", "10.0.0.2:9000")])
        self.advance(1.1)
        self.assertEqual(self.ids(b), ["r2"])
        self.assertEqual(b.ha.status()["routes_followed_revision"], self.fake.kvs[KEY].mod_revision)

    def leader_after_handover(self) -> Any:
        """
        Member C{a} leads and publishes a table of one route; C{b} follows
        it; C{a} stops and C{b} wins, routing by the table it followed.
        Returns C{b}.
        """
        a = self.member("a")
        self.advance(0.1)
        b = self.member("b")
        a.reconciler.routing_table.publish_model("demo", [Route("r1", "demo", "10.0.0.1:9000")])
        self.advance(1.1)
        self.successResultOf(a.ha.stopService())
        self.advance(2)
        self.assertIs(b.ha.election.role, Role.LEADER)
        self.assertEqual(self.ids(b), ["r1"])
        return b

    def test_new_leader_keeps_the_followed_table_until_its_grace_ends(self) -> None:
        """
        When the leader goes, the member that wins keeps routing by the
        table it followed (nothing dropped while agents come over), and once
        its adoption grace is over publishes the table of its own state.
        """
        b = self.leader_after_handover()
        self.advance(29)
        self.assertEqual(self.ids(b), [])
        self.advance(1.1)
        self.assertEqual(published(self.fake), [])

    def test_grace_ended_early_republishes_then(self) -> None:
        """
        A leader whose adoption grace is ended early (every expected agent
        came) publishes the table of its own state then, not when the grace
        would have ended.
        """
        b = self.leader_after_handover()
        b.reconciler.end_adoption_grace("every expected agent has registered")
        self.assertEqual(self.ids(b), [])
        self.advance(1.1)
        self.assertEqual(published(self.fake), [])
        self.advance(30)
        self.assertEqual(published(self.fake), [])

    def test_deposed_leader_follows_new_leader(self) -> None:
        """
        A leader cut off from etcd steps down and keeps its last table
        (fail static); once the other member leads and etcd answers it
        again, it takes the new leader's table.
        """
        a = self.member("a")
        self.advance(0.1)
        a.reconciler.routing_table.publish_model("demo", [Route("r1", "demo", "10.0.0.1:9000")])
        self.advance(1.1)
        self.fake.available = False
        self.advance(10)
        self.assertIsNot(a.ha.election.role, Role.LEADER)
        self.assertEqual([r.replica_id for r in a.reconciler.routing_table.routes("demo")], ["r1"])
        b = self.member("b")
        self.fake.available = True
        self.advance(15)
        leader, other = (a, b) if a.ha.election.role is Role.LEADER else (b, a)
        self.assertIs(leader.ha.election.role, Role.LEADER)
        leader.reconciler.routing_table.publish_model("demo", [Route("r9", "demo", "10.0.0.9:9000")])
        self.advance(1.1)
        self.assertEqual([r.replica_id for r in other.reconciler.routing_table.routes("demo")], ["r9"])
        # The adoption grace (30 s) ends: the leader's table is its own
        # state's, which holds no replica; followers get that too.
        self.advance(31)
        self.assertEqual(list(leader.reconciler.routing_table.routes("demo")), [])
        self.assertEqual(list(other.reconciler.routing_table.routes("demo")), [])
        self.flushLoggedErrors()



FLEET = fleet_key(PREFIX)


class FleetPublisherTests(SynchronousTestCase):
    """The leader's fleet views, published."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.fake = FakeEtcd(self.clock)
        self.logged: list[dict[str, Any]] = []
        self.nodes: list[dict[str, Any]] = [{"id": "gpu-1", "last_seen": 100.0}]
        self.publisher = FleetPublisher(self.clock, self.fake, PREFIX, self.views)
        self.publisher.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.addCleanup(self.publisher.stop)

    def views(self) -> dict[str, Any]:
        return {"leader": "a", "leader_admin_url": "https://a:7480", "nodes": list(self.nodes),
                "replicas": [{"id": "r1", "shards": [{"id": "s1", "signals": {"waiting": self.clock.seconds()}}]}],
                "events": [{"time": float(i), "kind": "k"} for i in range(1500)],
                "status": {"connected": len(self.nodes)}}

    def doc(self) -> dict[str, Any]:
        return unpack_fleet(self.fake.kvs[FLEET].value)

    def writes(self) -> int:
        return self.fake.calls.count("txn")

    def test_published_on_change_debounced(self) -> None:
        """
        The views are written at the start, then at most once each 2 s and
        only when they changed: engine signals and a heartbeat's last_seen
        within the same 10 s do not count; published_at is the leader's
        clock at the write; only the newest 1000 events go.
        """
        lead = Leading(self.fake)
        self.clock.advance(100)
        self.publisher.start(lead.lease)
        self.clock.advance(0)
        self.assertEqual(self.writes(), 1)
        doc = self.doc()
        self.assertEqual(doc["published_at"], 100)
        self.assertEqual(doc["views"]["nodes"], [{"id": "gpu-1", "last_seen": 100.0}])
        self.assertIsNone(doc["views"]["replicas"][0]["shards"][0]["signals"])
        self.assertEqual(len(doc["views"]["events"]), 1000)
        self.assertEqual(doc["views"]["events"][-1]["time"], 1499.0)
        self.nodes = [{"id": "gpu-1", "last_seen": 104.0}]
        self.clock.advance(6)
        self.assertEqual(self.writes(), 1)
        self.nodes.append({"id": "gpu-2", "last_seen": 105.0})
        self.clock.advance(2)
        self.assertEqual(self.writes(), 2)
        self.assertEqual(self.doc()["published_at"], 108)
        for i in range(3, 8):
            self.nodes.append({"id": f"gpu-{i}"})
            self.clock.advance(0.5)
        self.assertEqual(self.writes(), 3)
        self.clock.advance(2)
        self.assertEqual(self.writes(), 4)
        self.assertEqual(len(self.doc()["views"]["nodes"]), 7)

    def test_large_fleet_packed_less_often(self) -> None:
        """
        A pack that takes long (1 s a turn here, by the injected timer) is
        followed by the next no sooner than ten times its reactor time (all
        its turns): packing takes at most a tenth of the leader's reactor; a GPU's memory in use is published
        rounded down to 1 GiB.
        """
        ticks = iter(float(i) for i in range(1000))
        slow = FleetPublisher(self.clock, self.fake, PREFIX, self.views, timer=lambda: next(ticks))
        self.addCleanup(slow.stop)
        lead = Leading(self.fake)
        self.nodes = [{"id": "gpu-1", "gpus": [{"index": 0, "memory_used_mb": 3000}]}]
        slow.start(lead.lease)
        self.clock.advance(0)
        self.assertEqual(self.doc()["views"]["nodes"][0]["gpus"][0]["memory_used_mb"], 2048)
        # A second a turn by the timer: the pack's reactor time is its turns'.
        took = slow.pack_seconds
        self.assertEqual(took, float(slow.pack_turns))
        self.assertGreater(took, 2.0)
        self.clock.advance(took * 10 - 0.5)
        self.assertEqual(slow.packs, 1)
        self.clock.advance(1)
        self.assertEqual(slow.packs, 2)

    def test_deposed_leader_refused(self) -> None:
        """
        Once another lease holds the leader key the old leader's write is
        refused and it publishes nothing more.
        """
        old = Leading(self.fake)
        self.publisher.start(old.lease)
        self.clock.advance(0)
        self.fake.expire(old.lease)
        Leading(self.fake)
        self.nodes.append({"id": "gpu-2"})
        self.clock.advance(2)
        self.assertEqual(self.publisher.refused, 1)
        self.assertIsNone(self.publisher.lease)
        self.assertEqual(len(self.doc()["views"]["nodes"]), 1)
        self.nodes.append({"id": "gpu-3"})
        self.clock.advance(10)
        self.assertEqual(self.writes(), 2)

    def test_bound_cuts_nodes(self) -> None:
        """
        Over the size bound the nodes are cut (replicas, events and status
        whole) and the document says how many nodes there are.
        """
        import random

        rng = random.Random(2)
        self.nodes = [{"id": f"gpu-{i}", "address": f"{rng.getrandbits(64):x}"} for i in range(2000)]
        small = FleetPublisher(self.clock, self.fake, PREFIX, self.views, max_size=30000)
        lead = Leading(self.fake)
        small.start(lead.lease)
        self.clock.advance(0)
        small.stop()
        self.assertLessEqual(len(self.fake.kvs[FLEET].value), 30000)
        views = self.doc()["views"]
        self.assertEqual(views["truncated"], {"nodes": 2000})
        self.assertGreater(len(views["nodes"]), 0)
        self.assertLess(len(views["nodes"]), 2000)
        self.assertEqual(len(views["events"]), 1000)


    def test_packed_over_several_turns(self) -> None:
        """
        A pack is done a slice per reactor turn (no turn packs more
        than a slice of nodes or replicas): the document is written once the
        last slice is, whole, with the nodes and replicas in order.
        """
        self.nodes = [{"id": f"gpu-{i}", "last_seen": 100.0} for i in range(1000)]
        sliced = FleetPublisher(self.clock, self.fake, PREFIX, self.views, slice_size=100)
        self.addCleanup(sliced.stop)
        lead = Leading(self.fake)
        sliced.start(lead.lease)
        self.clock.advance(0)
        self.assertEqual(sliced.pack_turns, 1 + 2 + 1 + 10 + 1)
        self.assertEqual(self.writes(), 1)
        views = self.doc()["views"]
        self.assertEqual([n["id"] for n in views["nodes"]], [f"gpu-{i}" for i in range(1000)])
        self.assertNotIn("truncated", views)

    def test_pack_waits_for_its_turns(self) -> None:
        """
        While a pack is under way (its slices each a turn of their
        own), nothing is written; a turn runs one slice.
        """
        turns: list[float] = []
        calls = iter(float(i) for i in range(10000))

        def timer() -> float:
            t = next(calls)
            turns.append(t)
            return t

        self.nodes = [{"id": f"gpu-{i}"} for i in range(500)]
        sliced = FleetPublisher(self.clock, self.fake, PREFIX, self.views, slice_size=100, timer=timer)
        self.addCleanup(sliced.stop)
        lead = Leading(self.fake)
        sliced.start(lead.lease)
        self.assertEqual(self.writes(), 0)
        # The reactor's calls, run one at a time: each is one slice.
        done = 0
        while not self.writes():
            call = self.clock.getDelayedCalls()[0]
            self.assertEqual(call.getTime(), self.clock.seconds())
            self.clock.calls.remove(call)  # type: ignore[attr-defined]
            call.func(*call.args, **call.kw)
            done += 1
        self.assertEqual(done, 1 + 2 + 1 + 5 + 1)
        self.assertEqual(sliced.pack_max_turn, 1.0)

    def test_leadership_change_mid_pack_drops_it(self) -> None:
        """
        A pack under way when this member stops leading (or starts
        again under another lease) is dropped, never written; the new term
        packs afresh.
        """
        self.nodes = [{"id": f"gpu-{i}"} for i in range(1000)]
        sliced = FleetPublisher(self.clock, self.fake, PREFIX, self.views, slice_size=100)
        self.addCleanup(sliced.stop)
        lead = Leading(self.fake)
        sliced.start(lead.lease)
        for _ in range(4):
            call = self.clock.getDelayedCalls()[0]
            self.clock.calls.remove(call)  # type: ignore[attr-defined]
            call.func(*call.args, **call.kw)
        sliced.stop()
        self.clock.advance(0)
        self.assertEqual((self.writes(), sliced.dropped), (0, 1))
        self.assertEqual([c for c in self.clock.getDelayedCalls() if c.getTime() <= self.clock.seconds()], [])
        sliced.start(lead.lease)
        call = self.clock.getDelayedCalls()[0]
        self.clock.calls.remove(call)  # type: ignore[attr-defined]
        call.func(*call.args, **call.kw)
        self.nodes.append({"id": "gpu-new"})
        sliced.start(lead.lease)  # led again: the pack under way is the old term's
        self.clock.advance(0)
        self.assertEqual((self.writes(), sliced.dropped), (1, 2))
        self.assertEqual(self.doc()["views"]["nodes"][-1], {"id": "gpu-new"})


class FleetFollowerTests(SynchronousTestCase):
    """A member that does not lead, holding the leader's fleet views."""

    def test_follows_and_fails_static(self) -> None:
        """
        The follower holds nothing before a document is published, then
        each new one; an unreadable one is logged and the last stays.
        """
        clock = Clock()
        fake = FakeEtcd(clock)
        follower = FleetFollower(clock, fake, PREFIX)
        logged: list[dict[str, Any]] = []
        follower.log = Logger(observer=logged.append)  # type: ignore[arg-type]
        self.addCleanup(follower.stop)
        follower.start()
        self.assertIsNone(follower.document)
        good = pack_fleet({"leader": "a", "nodes": [], "replicas": [], "events": [], "status": {}}, 5)
        assert good is not None
        fake.put(FLEET, good)
        assert follower.document is not None
        self.assertEqual(follower.document.value, good)
        fake.put(FLEET, zlib.compress(b'{"published_at": 6, "views": {"nodes": 1}}'))
        self.assertEqual(follower.document.value, good)
        self.assertTrue(any("unreadable" in e["log_format"] for e in logged))

    def test_parts_answered_as_packed(self) -> None:
        """
        The nodes part is the leader's answer as bytes (published_at,
        published_by, nodes, truncated); a document with a part that is
        not what the header says (not zlib, or a stream cut short, which
        inflates to a plausible prefix without an error), or whose parts
        lie outside the value, is refused at apply, and the last good
        document stays.
        """
        clock = Clock()
        fake = FakeEtcd(clock)
        follower = FleetFollower(clock, fake, PREFIX)
        follower.log = Logger(observer=lambda e: None)  # type: ignore[arg-type]
        self.addCleanup(follower.stop)
        follower.start()
        value = pack_fleet({"leader": "a", "leader_admin_url": "https://a:7480", "nodes": [{"id": "n1"}],
                            "replicas": [{"id": "r1", "shards": [{"id": "s", "signals": {"w": 1}}]}],
                            "events": [{"time": 1.0}], "status": {"connected": 1}}, 7.5)
        assert value is not None
        fake.put(FLEET, value)
        doc = follower.document
        assert doc is not None
        self.assertEqual((doc.published_at, doc.leader, doc.leader_admin_url), (7.5, "a", "https://a:7480"))
        self.assertEqual(json.loads(doc.part("nodes")),
                         {"published_at": 7.5, "published_by": "a", "nodes": [{"id": "n1"}]})
        self.assertEqual(json.loads(doc.part("replicas"))["replicas"][0]["shards"][0]["signals"], None)
        self.assertEqual((doc.events(), doc.status()), ([{"time": 1.0}], {"connected": 1}))
        head, _, body = value.partition(b"\n")
        header = json.loads(head)
        at, size = header["parts"]["nodes"]
        broken = head + b"\n" + body[:at] + b"x" * size + body[at + size:]
        fake.put(FLEET, broken)
        self.assertIs(follower.document, doc)
        # The nodes stream cut at a sync flush: it inflates, but is not whole.
        cut_header = json.loads(head)
        cut_header["parts"]["nodes"] = [at, size - 6]
        fake.put(FLEET, json.dumps(cut_header).encode() + b"\n" + body[:at + size - 6])
        self.assertIs(follower.document, doc)
        self.assertRaises(RoutesDataError, FleetDocument(
            json.dumps(cut_header).encode() + b"\n" + body[:at + size - 6]).part, "nodes")
        header["parts"]["nodes"] = [at, size + 1]
        fake.put(FLEET, json.dumps(header).encode() + b"\n" + body)
        self.assertIs(follower.document, doc)
        self.assertEqual(follower.document.value, value)  # type: ignore[union-attr]


class GoneWhilePackingTests(SynchronousTestCase):
    def test_empty_slices_leave_valid_json(self) -> None:
        """
        Slices whose nodes (or replicas) all went while the pack ran,
        first, in the middle or last, leave the published answers valid
        JSON with the rest; NaN is refused rather than published.
        """

        class Gone:
            # Six items in slices of two; the slices asked for in `gone` come back empty.
            def __init__(self, gone: set[int]):
                self.gone = gone

            def __len__(self) -> int:
                return 6

            def __getitem__(self, s: slice) -> list[dict[str, str]]:
                return [] if s.start // 2 in self.gone else [{"id": f"x{i}"} for i in range(s.start, s.stop)]

        for gone in ({0}, {1}, {2}, {0, 2}, {0, 1, 2}):
            value = FleetPack({"leader": "a", "nodes": Gone(gone), "replicas": Gone(gone), "events": [],
                               "status": {}}, 1.0, slice_size=2).run()
            assert value is not None
            doc = FleetDocument(value)
            left = [f"x{i}" for i in range(6) if i // 2 not in gone]
            self.assertEqual([n["id"] for n in json.loads(doc.part("nodes"))["nodes"]], left, gone)
            self.assertEqual([r["id"] for r in json.loads(doc.part("replicas"))["replicas"]], left, gone)
        self.assertRaises(ValueError, FleetPack({"leader": "a", "nodes": [], "replicas": [], "events": [],
                                                 "status": {"x": float("nan")}}, 1.0).run)


class HAMemberFleetTests(SynchronousTestCase):
    """Two HA members: the leader publishes its views, the other answers from them."""

    def test_leader_nodes_built_a_slice_at_a_time(self) -> None:
        """
        The nodes the leader publishes are its GET /api/v1/nodes view,
        built for the slice asked (by index or slice); a node removed after
        the view was taken is left out of its slice.
        """
        from llmgw.control.admin.fleet import nodes_view
        from llmgw.control.state.inventory import GPUInfo, Node

        reactor = MemoryReactorClock()
        m = Member(reactor, FakeEtcd(reactor), "a")
        for i in range(7):
            m.inventory.upsert(Node(f"gpu-{i}", gpus=[GPUInfo(0, f"GPU-{i}", "H100", 81559, 4000 + i)],
                                    address="10.0.0.1", last_seen=float(i)))
        whole = nodes_view(m.reconciler, m.cp.agents)["nodes"]
        sliced = m.ha.fleet_views()["nodes"]
        self.assertEqual(len(sliced), 7)
        self.assertEqual(sliced[0:3] + sliced[3:7], whole)
        self.assertEqual(sliced[5], whole[5])
        m.inventory.remove("gpu-4")
        self.assertEqual([n["id"] for n in sliced[3:6]], ["gpu-3", "gpu-5"])
        self.assertRaises(IndexError, lambda: sliced[4])

    def test_follower_answers_from_published_views(self) -> None:
        """
        A member that does not lead answers GET /api/v1/nodes (listing the
        node the leader knows) and /status from the leader's published views,
        with published_at and published_by, within a publish interval.
        """
        from treq.testing import StubTreq

        from llmgw.control.admin.api import AdminResource
        from llmgw.control.shell.metrics import make_registry
        from llmgw.control.state.inventory import Node

        reactor = MemoryReactorClock()
        fake = FakeEtcd(reactor)
        a = Member(reactor, fake, "a")
        a.ha.startService()
        self.addCleanup(a.ha.stopService)
        for _ in range(2):
            reactor.advance(0.1)
        b = Member(reactor, fake, "b")
        b.ha.startService()
        self.addCleanup(b.ha.stopService)
        self.assertIs(a.ha.election.role, Role.LEADER)

        class Control:
            ha = b.ha

        resource = AdminResource(b.reconciler, make_registry(), b.cp.agents, control=Control())
        stub = StubTreq(resource)

        def get(path: str) -> tuple[int, Any]:
            d = stub.request("GET", "http://127.0.0.1:7480" + path, allow_redirects=False)
            stub.flush()
            response = self.successResultOf(d)
            content = self.successResultOf(stub.content(response))
            return response.code, json.loads(content)

        a.inventory.upsert(Node("gpu-1", address="10.0.0.1", last_seen=reactor.seconds()))
        for _ in range(30):
            reactor.advance(0.1)
        code, body = get("/api/v1/nodes")
        self.assertEqual(code, 200, body)
        self.assertEqual([n["id"] for n in body["nodes"]], ["gpu-1"])
        self.assertEqual(body["published_by"], "a")
        self.assertLessEqual(body["published_at"], reactor.seconds())
        code, body = get("/api/v1/status")
        self.assertEqual((code, body["published_by"], body["role"]), (200, "a", "follower"))
        # Once it has led, what it followed before is not answered (it
        # would be stale after it steps down).
        self.successResultOf(a.ha.stopService())
        for _ in range(30):
            reactor.advance(0.1)
        self.assertIs(b.ha.election.role, Role.LEADER)
        self.assertIsNone(b.ha.followed_fleet())
        self.assertIsNone(b.ha.fleet_follower.document)
