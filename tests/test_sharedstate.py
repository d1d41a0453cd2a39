"""
L{llmgw.control.ha.sharedstate}: in HA mode an operator's scale overrides,
cordons and drains live in etcd, written under the leader's lease before
they are applied, against the in-memory etcd on a Clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

import llmgw
from llmgw.control.core.catalog import EMPTY
from llmgw.control.core.kept import KeptState
from llmgw.control.ha.election import MemberInfo, Role
from llmgw.control.ha.member import HAMember
from llmgw.control.ha.sharedstate import SharedFleet, SharedStateError, fleet_state_key
from llmgw.control.service import ControlPlane
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import AdminError
from llmgw.control.state.inventory import Inventory, Node
from llmgw.testing.fakeetcd import FakeEtcd

DEMO = (Path(llmgw.__file__).parent / "demo-catalog.toml").read_bytes()
KEY = fleet_state_key("/llmgw")


class Member:
    def __init__(self, reactor: MemoryReactorClock, fake: FakeEtcd, name: str, catalog_file: str,
                 state_file: str | None = None):
        self.inventory = Inventory()
        for node_id in ("n1", "n2"):
            self.inventory.upsert(Node(id=node_id))
        self.reconciler = Reconciler(EMPTY, self.inventory, clock=reactor, adoption_grace=30,
                                     fleet_state=KeptState(state_file))
        self.cp = ControlPlane(
            reactor, sink=self.reconciler, tls=None, agents_host="127.0.0.1", agents_port=0,
            inventory=self.inventory, fleet=self.reconciler,
        )
        self.ha = HAMember(
            reactor, self.cp, self.reconciler, fake, "/llmgw",
            MemberInfo(name, f"127.0.0.{ord(name[-1]) - 96}:7443"), ttl=10,
            now_ms=lambda: 1_700_000_000_000, catalog_file=catalog_file,
        )
        assert isinstance(self.cp.fleet, SharedFleet)
        self.fleet: SharedFleet = self.cp.fleet


class SharedKeptStateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeEtcd(self.reactor)
        path = Path(self.mktemp())
        path.write_bytes(DEMO)
        self.catalog = str(path)

    def member(self, name: str, state_file: str | None = None) -> Member:
        m = Member(self.reactor, self.fake, name, self.catalog, state_file)
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        return m

    def advance(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)

    def leader(self) -> Member:
        m = self.member("a")
        self.advance(0.1)
        self.assertTrue(m.ha.taken_over)
        return m

    def stored(self) -> Any:
        return json.loads(self.fake.kvs[KEY].value)

    def refused(self, d: Any) -> AdminError:
        f = self.failureResultOf(d, AdminError)
        self.assertEqual(f.value.status, 409)
        return f.value

    def test_scale_written_to_etcd_then_applied(self) -> None:
        """
        A scale through the admin API's fleet is stored in etcd (with the
        catalog's count it overrides) and only then becomes the reconciler's
        desired count; the answer comes once etcd took it.
        """
        a = self.leader()
        self.assertEqual(a.reconciler.desired["demo"], 2)
        self.successResultOf(a.fleet.scale("demo", 3))
        self.assertEqual(self.stored()["replicas"], {"demo": {"replicas": 3, "catalog_replicas": 2}})
        self.assertEqual(a.reconciler.desired["demo"], 3)
        self.assertEqual(a.ha.status()["fleet_state_revision"], self.fake.kvs[KEY].mod_revision)

    def test_autoscale_bounds_kept_in_etcd(self) -> None:
        """
        An autoscaled deployment's bounds set through the fleet are stored in
        etcd (with the catalog's bounds they narrow) and then govern the
        reconciler's policy; a member that takes over has them.
        """
        Path(self.catalog).write_bytes(DEMO.replace(
            b"replicas = 2", b"min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 4"))
        a = self.leader()
        b = self.member("b")
        self.successResultOf(a.fleet.scale_bounds("demo", 2, 3))
        self.assertEqual(self.stored()["bounds"],
                         {"demo": {"min": 2, "max": 3, "catalog_min": 1, "catalog_max": 4}})
        self.assertEqual(a.reconciler.autoscale_view("demo")["min_replicas"], 2)
        self.fake.expire(a.ha.election.lease)  # type: ignore[arg-type]
        self.advance(1)
        self.assertTrue(b.ha.taken_over)
        policy = b.reconciler.fleet_state.policy(b.reconciler.catalog.deployments["demo"])
        self.assertEqual((policy.min_replicas, policy.max_replicas), (2, 3))
        self.assertEqual(b.reconciler.desired["demo"], 2)
        self.flushLoggedErrors()

    def test_cordon_drain_uncordon_kept_in_etcd(self) -> None:
        """
        Cordons and drains are stored in etcd and applied to the reconciler;
        an uncordon removes the node from both sets in etcd and here.
        """
        a = self.leader()
        self.successResultOf(a.fleet.cordon("n1"))
        self.successResultOf(a.fleet.drain_node("n2"))
        self.assertEqual((self.stored()["cordoned"], self.stored()["draining"]), (["n1", "n2"], ["n2"]))
        self.assertEqual((a.reconciler.state.cordoned, a.reconciler.state.draining_nodes), ({"n1", "n2"}, {"n2"}))
        self.successResultOf(a.fleet.uncordon("n2"))
        self.assertEqual((self.stored()["cordoned"], self.stored()["draining"]), (["n1"], []))
        self.assertEqual((a.reconciler.state.cordoned, a.reconciler.state.draining_nodes), ({"n1"}, set()))

    def test_bad_request_refused_before_etcd(self) -> None:
        """
        A request the reconciler would refuse (unknown model, unknown node)
        is refused as it would be, and nothing is written to etcd.
        """
        a = self.leader()
        self.assertRaises(AdminError, a.fleet.scale, "nope", 3)
        self.assertRaises(AdminError, a.fleet.cordon, "n9")
        self.assertNotIn(KEY, self.fake.kvs)

    def test_deposed_leader_write_fails_and_changes_nothing(self) -> None:
        """
        Once another member leads, a write guarded by the old leader's lease
        fails in etcd (the compare on the leader key's lease), the admin
        answer is a 409, and neither etcd nor the old leader's reconciler
        changes.
        """
        a = self.leader()
        b = self.member("b")
        self.successResultOf(a.fleet.scale("demo", 3))
        old_lease = a.ha.election.lease
        assert old_lease is not None
        stored = self.fake.kvs[KEY]
        self.fake.expire(old_lease)
        self.advance(1)
        self.assertIs(b.ha.election.role, Role.LEADER)
        # The deposed member's write as if its step-down had not reached it.
        a.ha.kept.lease = old_lease
        err = self.refused(a.fleet.scale("demo", 5))
        self.assertIn("no longer leads", str(err))
        self.assertEqual(self.fake.kvs[KEY], stored)
        self.assertEqual(a.ha.kept.overrides["demo"], (3, 2))
        # Having learnt it, it does not try again.
        self.assertIn("does not lead", str(self.refused(a.fleet.cordon("n1"))))
        self.assertNotIn("n1", a.reconciler.state.cordoned)
        self.flushLoggedErrors()

    def test_new_leader_starts_from_etcd(self) -> None:
        """
        A member that takes over loads the scale, cordons and drains from
        etcd into its reconciler, and its own writes then succeed.
        """
        a = self.leader()
        b = self.member("b")
        self.successResultOf(a.fleet.scale("demo", 4))
        self.successResultOf(a.fleet.cordon("n1"))
        self.successResultOf(a.fleet.drain_node("n2"))
        self.assertFalse(b.reconciler.running)
        self.fake.expire(a.ha.election.lease)  # type: ignore[arg-type]
        self.advance(1)
        self.assertTrue(b.ha.taken_over)
        self.assertEqual(b.reconciler.desired["demo"], 4)
        self.assertEqual((b.reconciler.state.cordoned, b.reconciler.state.draining_nodes), ({"n1", "n2"}, {"n2"}))
        self.successResultOf(b.fleet.uncordon("n1"))
        self.assertEqual(self.stored()["cordoned"], ["n2"])
        self.flushLoggedErrors()

    def test_etcd_unreachable_refuses_and_changes_nothing(self) -> None:
        """
        With etcd unreachable a scale is refused (409, saying so) and the
        reconciler keeps its count.
        """
        a = self.leader()
        self.fake.available = False
        self.assertIn("etcd could not be reached", str(self.refused(a.fleet.scale("demo", 3))))
        self.assertEqual(a.reconciler.desired["demo"], 2)
        self.flushLoggedErrors()

    def test_seeded_from_state_file(self) -> None:
        """
        When etcd holds no fleet state the first leader stores its state
        file's there (under its lease) and runs with it.
        """
        path = Path(self.mktemp())
        path.write_text(json.dumps({"replicas": {"demo": {"replicas": 5, "catalog_replicas": 2}},
                                    "cordoned": ["n2"], "draining": []}))
        m = self.member("a", state_file=str(path))
        self.advance(0.1)
        self.assertEqual(self.stored()["replicas"]["demo"]["replicas"], 5)
        self.assertEqual(m.reconciler.desired["demo"], 5)
        self.assertEqual(m.reconciler.state.cordoned, {"n2"})

    def test_etcd_state_wins_over_state_file(self) -> None:
        """
        A state file is not used when etcd holds fleet state already: etcd's
        is the cluster's.
        """
        self.fake.put(KEY, json.dumps({"cordoned": ["n1"], "draining": []}).encode())
        path = Path(self.mktemp())
        path.write_text(json.dumps({"cordoned": ["n2"], "draining": []}))
        m = self.member("a", state_file=str(path))
        self.advance(0.1)
        self.assertEqual(m.reconciler.state.cordoned, {"n1"})
        self.assertEqual(self.stored()["cordoned"], ["n1"])

    def test_unreadable_etcd_state_ignored_with_error(self) -> None:
        """
        A document in etcd that is not fleet state is ignored (logged), the
        leader runs with none, and its next change replaces it.
        """
        logged: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            logged.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.fake.put(KEY, b"{not json")
        m = self.leader()
        self.assertEqual(m.reconciler.state.cordoned, set())
        self.assertTrue([line for line in logged if "is unreadable and was ignored" in line])
        self.successResultOf(m.fleet.cordon("n1"))
        self.assertEqual(self.stored()["cordoned"], ["n1"])

    def test_changed_behind_its_back_refused_then_reloaded(self) -> None:
        """
        A write racing a change it has not seen (the key edited by hand) is
        refused without overwriting it; the member takes up what etcd holds
        and the retry applies to that.
        """
        a = self.leader()
        self.successResultOf(a.fleet.cordon("n1"))
        a.ha._stop_watch()  # the edit is not seen before the write
        self.fake.put(KEY, json.dumps({"cordoned": ["n2"], "draining": []}).encode())
        self.assertIn("changed by someone else", str(self.refused(a.fleet.scale("demo", 3))))
        self.assertEqual(self.stored()["cordoned"], ["n2"])
        self.successResultOf(a.fleet.scale("demo", 3))
        self.assertEqual((self.stored()["cordoned"], self.stored()["replicas"]["demo"]["replicas"]), (["n2"], 3))

    def test_hand_edit_taken_up_by_the_watch(self) -> None:
        """
        The leader takes up a change of the key made in etcd by hand (its
        own writes are not taken up twice); a deletion clears it, and an
        unreadable document leaves the running state.
        """
        a = self.leader()
        self.successResultOf(a.fleet.cordon("n1"))
        # Its own write was applied by the cordon itself, not taken up first.
        self.assertEqual([e["node"] for e in a.reconciler.events() if e["kind"] == "node_cordoned"], ["n1"])
        self.fake.put(KEY, json.dumps({"replicas": {"demo": {"replicas": 4, "catalog_replicas": 2}},
                                       "cordoned": ["n2"], "draining": []}).encode())
        self.assertEqual(a.reconciler.state.cordoned, {"n2"})
        self.assertEqual(a.reconciler.desired["demo"], 4)
        self.assertEqual(a.ha.kept.revision, self.fake.kvs[KEY].mod_revision)
        self.fake.put(KEY, b"[]")
        self.assertEqual(a.reconciler.state.cordoned, {"n2"})
        self.fake.delete(KEY)
        self.assertEqual((a.reconciler.state.cordoned, a.reconciler.desired["demo"]), (set(), 2))
        self.successResultOf(a.fleet.cordon("n1"))
        self.assertEqual(self.stored()["cordoned"], ["n1"])
        self.assertEqual(a.reconciler.state.cordoned, {"n1"})

    def test_nodes_the_reconciler_changes_are_written_behind(self) -> None:
        """
        The reconciler's own change of the cordoned set (not an operator's)
        is applied at once and written to etcd behind it.
        """
        a = self.leader()
        self.assertTrue(a.ha.kept.set_nodes({"n2"}, ()))
        self.assertEqual(self.stored()["cordoned"], ["n2"])
        self.assertFalse(a.ha.kept.set_nodes({"n2"}, ()))

    def test_follower_refuses_writes(self) -> None:
        """
        A member that does not lead writes nothing: its write fails at once.
        """
        self.leader()
        b = self.member("b")
        self.advance(1)
        f = self.failureResultOf(b.ha.kept.write(lambda s: None), SharedStateError)
        self.assertIn("does not lead", str(f.value))

    # -- the admin API over an HA member's fleet ---------------------------------------

    def request(self, m: Member, path: str, body: Any = None) -> Any:
        from treq.testing import StubTreq

        from llmgw.control.admin.api import AdminResource
        from llmgw.control.shell.metrics import make_registry

        treq: Any = StubTreq(AdminResource(m.cp.fleet, make_registry(), m.cp.agents))
        data = json.dumps(body).encode() if body is not None else None
        d = treq.request("POST", "http://127.0.0.1:7480" + path,
                         headers={"Content-Type": ["application/json"]}, data=data)
        treq.flush()
        return treq, d

    def test_answer_waits_for_etcd_and_refusal_is_409(self) -> None:
        """
        A scale over the admin API is answered only once etcd took it (while
        etcd hangs, no answer and no change); a deposed leader's scale is
        answered 409 with the reason.
        """
        a = self.leader()
        lease = a.ha.kept.lease
        a.ha.kept.lease = None
        treq, d = self.request(a, "/api/v1/nodes/n1/cordon")
        response = self.successResultOf(d)
        self.assertEqual(response.code, 409)
        body = json.loads(self.successResultOf(treq.content(response)))
        self.assertIn("does not lead", body["error"])
        self.assertNotIn("n1", a.reconciler.state.cordoned)
        a.ha.kept.lease = lease
        self.fake.hang = True
        treq, d = self.request(a, "/api/v1/deployments/demo/scale", {"replicas": 3})
        self.assertNoResult(d)
        self.assertEqual(a.reconciler.desired["demo"], 2)
        self.flushLoggedErrors()


class HeldDeploymentsTests(SynchronousTestCase):
    """Held deployments kept in etcd beside the rest of the fleet state."""

    setUp = SharedKeptStateTests.setUp
    member = SharedKeptStateTests.member
    advance = SharedKeptStateTests.advance
    leader = SharedKeptStateTests.leader
    stored = SharedKeptStateTests.stored
    refused = SharedKeptStateTests.refused

    def hold(self, m: Member) -> None:
        """
        A configuration failure of a demo shard, decided and applied as the
        reconciler does for an agent's failed report (no agent is connected
        in these tests, so nothing was placed to fail).
        """
        import functools

        from llmgw.control.core import lifecycle

        failed = functools.partial(lifecycle.record_failure, crash_class="config", error="unknown model")
        m.reconciler._decide(lambda ctx, out: failed(ctx, "demo", "n1", "demo-r1", "demo-r1-s0",
                                                     self.reactor.seconds(), out))

    def test_hold_kept_and_taken_over(self) -> None:
        """
        A deployment held after a configuration failure is stored in etcd;
        the member that takes over starts with it held (nothing placed for
        it); the admin API's view says so.
        """
        a = self.leader()
        b = self.member("b")
        self.hold(a)
        self.advance(0.1)
        self.assertIn("configuration error", self.stored()["held"]["demo"]["reason"])
        self.assertEqual(self.stored()["held"]["demo"]["crash_class"], "config")
        self.assertIsNone(b.reconciler.ctx.deps["demo"].held)
        self.fake.expire(a.ha.election.lease)  # type: ignore[arg-type]
        self.advance(1)
        self.assertTrue(b.ha.taken_over)
        held = b.reconciler.ctx.deps["demo"].held
        self.assertIsNotNone(held)
        assert held is not None
        self.assertIn("unknown model", held.reason)
        self.flushLoggedErrors()

    def test_retry_clears_through_etcd(self) -> None:
        """
        A retry removes the hold in etcd under the leader's lease, then
        releases it in the reconciler; a member that takes over then holds
        nothing.
        """
        a = self.leader()
        self.hold(a)
        self.advance(0.1)
        self.assertIn("demo", self.stored()["held"])
        self.successResultOf(a.fleet.retry("demo"))
        self.assertNotIn("held", self.stored())
        self.assertIsNone(a.reconciler.ctx.deps["demo"].held)
        self.assertRaises(AdminError, a.fleet.retry, "nope")
        b = self.member("b")
        self.fake.expire(a.ha.election.lease)  # type: ignore[arg-type]
        self.advance(1)
        self.assertTrue(b.ha.taken_over)
        self.assertIsNone(b.reconciler.ctx.deps["demo"].held)
        self.flushLoggedErrors()

    def test_deposed_leaders_retry_changes_nothing(self) -> None:
        """
        A retry on a leader that lost its lease is refused (409), and the
        hold stays, in etcd and in that member's reconciler.
        """
        a = self.leader()
        self.hold(a)
        self.advance(0.1)
        lease = a.ha.election.lease
        a.ha.kept.lease = 424242  # as if deposed while the write was on its way
        self.refused(a.fleet.retry("demo"))
        self.assertIn("demo", self.stored()["held"])
        self.assertIsNotNone(a.reconciler.ctx.deps["demo"].held)
        a.ha.kept.lease = lease
        self.flushLoggedErrors()

    def test_standalone_state_file_holds_nothing(self) -> None:
        """
        Standalone, holds are not written to the state file (a hold lasts as
        long as the process, as before).
        """
        state = Path(self.mktemp())
        fs = KeptState(str(state))
        self.assertFalse(fs.keeps_holds)
        fs.set("demo", 3, 2)
        self.assertNotIn("held", json.loads(state.read_text()))


class MalformedHoldTests(SynchronousTestCase):
    def test_bad_hold_skipped_rest_kept(self) -> None:
        """
        One malformed entry under "held" is skipped with a warning naming
        the deployment; the other holds, the overrides and the cordoned and
        draining nodes are all taken.
        """
        from twisted.logger import Logger

        logged: list[dict[str, Any]] = []
        state = KeptState(None)
        state.log = Logger(observer=logged.append)  # type: ignore[arg-type]
        state.take_data({
            "replicas": {"demo": {"replicas": 3, "catalog_replicas": 1}},
            "cordoned": ["gpu-01"], "draining": ["gpu-02"],
            "held": {"bad": {"crash_class": "config"}, "worse": 7,
                     "good": {"reason": "configuration error", "crash_class": "config", "since": 5}},
        })
        self.assertEqual(state.overrides, {"demo": (3, 1)})
        self.assertEqual(state.cordoned, frozenset({"gpu-01", "gpu-02"}))
        self.assertEqual(state.draining, frozenset({"gpu-02"}))
        self.assertEqual(sorted(state.held), ["good"])
        warned = sorted(formatEvent(e) for e in logged)
        self.assertEqual(len(warned), 2, warned)
        self.assertIn("the hold of bad is malformed", warned[0])
        self.assertIn("the hold of worse is malformed", warned[1])
