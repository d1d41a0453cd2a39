"""
The admission queue (llmgw.gateway.admission): requests of a model that no
replica can take now wait, bounded, fair across API keys, with a deadline;
they leave when a replica turns ready or capacity frees, and at once when
their client goes away. Driven in memory through the gateway's own front,
time on a MemoryReactorClock; one loopback test through a real gateway.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.control.core.catalog import CatalogError, parse_catalog
from llmgw.gateway.admission import FairQueue, Waiter
from llmgw.gateway.follower import FollowerTable
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.service import GatewayService
from llmgw.routing import (
    Demand,
    EngineSignals,
    IDemand,
    QueueLimits,
    Route,
    RoutingSnapshot,
    RoutingTable,
    snapshot_from_json,
    snapshot_to_json,
)
from tests.gateway_helpers import FakeReplica, TrackingFactory
from tests.test_gateway_resource import error_of, parse, post

KEYS = {"alice": "sk-alice-key", "bob": "sk-bob-key"}
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Gw:
    """
    A gateway on a memory reactor, routing by a L{RoutingTable} the test
    publishes to; API keys alice and bob.
    """

    def __init__(self, config: GatewayConfig | None = None, keys: bool = True):
        self.clock = MemoryReactorClock()
        self.table = RoutingTable(self.clock)
        self.table.set_known(["demo"])
        self.gateway = Gateway(
            self.clock, self.table, config or GatewayConfig(default_policy="least_loaded"),
            keys=KeyRing(KEYS) if keys else None,
        )
        self.site = GatewaySite(GatewayResource(self.gateway))
        self.protos: list[Any] = []
        self.upstreams = 0

    def send(self, who: str = "alice", model: str = "demo", n: int = 0) -> StringTransport:
        proto = self.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        self.protos.append(proto)
        body = json.dumps({"model": model, "n": n}).encode()
        proto.dataReceived(post(body, extra=b"Authorization: Bearer " + KEYS[who].encode() + b"\r\n"))
        return client

    def ready(self, *replicas: str, signals: EngineSignals | None = None) -> None:
        self.table.publish_model(
            "demo", [Route(r, "demo", f"10.0.0.{i + 1}:8000", signals=signals) for i, r in enumerate(replicas)]
        )
        self.clock.advance(0)

    def new_upstreams(self) -> list[tuple[Any, StringTransport]]:
        """
        The replica side of the connections opened since the last call.
        """
        out = []
        for _, _, factory, _, _ in self.clock.tcpClients[self.upstreams :]:
            conn = factory.buildProtocol(None)
            transport = StringTransport()
            conn.makeConnection(transport)
            out.append((conn, transport))
        self.upstreams = len(self.clock.tcpClients)
        return out

    def sample(self, name: str, **labels: str) -> float | None:
        return self.gateway.registry.get_sample_value(name, labels)


def sent_n(transport: StringTransport) -> int:
    """
    The C{n} of the request a replica received.
    """
    return int(json.loads(transport.value().partition(b"\r\n\r\n")[2])["n"])


class FairQueueTests(SynchronousTestCase):
    def w(self, who: str, n: int) -> Waiter:
        return Waiter("m", who, None, lambda: None, lambda e: None, float(n))

    def test_round_robin_between_keys(self) -> None:
        """
        Waiters leave one key at a time, in turn, each key's first come
        first: a key with many waiting does not delay another's first.
        """
        q = FairQueue()
        for who, n in [("a", 1), ("a", 2), ("a", 3), ("b", 4), ("c", 5), ("c", 6)]:
            q.push(self.w(who, n))
        order = []
        while q:
            w = q.pop()
            assert w is not None
            order.append((w.who, int(w.since)))
        self.assertEqual(order, [("a", 1), ("b", 4), ("c", 5), ("a", 2), ("c", 6), ("a", 3)])
        self.assertIsNone(q.pop())

    def test_longest_tracked_through_removals(self) -> None:
        """
        C{longest} names a key holding the most waiters as they come and
        go (also from the middle of a sub-queue), and C{None} when empty.
        """
        q = FairQueue()
        ws = [self.w("a", i) for i in range(3)] + [self.w("b", 9)]
        for w in ws:
            q.push(w)
        self.assertEqual(q.longest(), ("a", 3))
        self.assertTrue(q.remove(ws[1]))
        self.assertFalse(q.remove(ws[1]))
        self.assertEqual(q.longest(), ("a", 2))
        self.assertIs(q.newest("a"), ws[2])
        q.remove(ws[0])
        q.remove(ws[2])
        self.assertEqual(q.longest(), ("b", 1))
        q.remove(ws[3])
        self.assertIsNone(q.longest())
        self.assertEqual(len(q), 0)


class QueueTests(SynchronousTestCase):
    def test_unknown_model_is_404_at_once(self) -> None:
        """
        A model no deployment serves is not queued: 404 at once.
        """
        gw = Gw()
        status, _, body = parse(gw.send(model="nope").value())
        self.assertEqual((status, error_of(body)["code"]), (404, "model_not_found"))
        self.assertEqual(gw.gateway.demand(), {})

    def test_held_until_a_replica_turns_ready(self) -> None:
        """
        With no replica ready a request waits (no answer, nothing sent
        upstream); when a replica turns ready it is sent on and answered.
        The waiting gauge and the demand follow it.
        """
        gw = Gw()
        client = gw.send()
        self.assertEqual(client.value(), b"")
        self.assertEqual(gw.clock.tcpClients, [])
        self.assertEqual(gw.sample("llmgw_gateway_queue_waiting", model="demo"), 1)
        self.assertEqual(gw.gateway.demand(), {"demo": Demand(in_flight=0, waiting=1)})
        gw.clock.advance(30)
        gw.ready("r1")
        [(conn, _)] = gw.new_upstreams()
        self.assertEqual(gw.gateway.demand(), {"demo": Demand(in_flight=1, waiting=0)})
        conn.dataReceived(OK)
        status, _, body = parse(client.value())
        self.assertEqual((status, body), (200, b"ok"))
        self.assertEqual(gw.gateway.demand(), {})
        self.assertEqual(gw.sample("llmgw_gateway_queue_waiting", model="demo"), None)
        self.assertEqual(
            gw.sample("llmgw_gateway_queue_wait_seconds_sum", model="demo", outcome="dispatched"), 30
        )

    def test_a_waiter_that_fails_to_go_is_answered_and_others_go(self) -> None:
        """
        A waiter whose sending on raises is answered with an error (and the
        failure logged); the waiters after it are still sent on.
        """
        gw = Gw()
        adm = gw.gateway.admission
        went: list[str] = []
        refused: list[int] = []

        class Request:
            on_lost = None
            client_host = "127.0.0.1"

        def broken() -> None:
            raise RuntimeError("boom")

        adm.enter("demo", "key:alice", Request(), broken, lambda e: refused.append(e.status))
        adm.enter("demo", "key:bob", Request(), lambda: went.append("bob"), lambda e: refused.append(e.status))
        gw.ready("r1")
        self.assertEqual((went, refused), (["bob"], [502]))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_deadline(self) -> None:
        """
        A request still waiting at the deadline gets the OpenAI-shaped 503
        with C{Retry-After}, and reaches no replica.
        """
        gw = Gw(GatewayConfig(queue_timeout_s=10))
        client = gw.send()
        gw.clock.advance(9.9)
        self.assertEqual(client.value(), b"")
        gw.clock.advance(0.2)
        status, headers, body = parse(client.value())
        self.assertEqual(status, 503)
        self.assertEqual(dict(headers)[b"retry-after"], b"5")
        self.assertEqual(error_of(body)["code"], "queue_timeout")
        self.assertEqual(error_of(body)["type"], "server_error")
        gw.ready("r1")
        self.assertEqual(gw.clock.tcpClients, [])
        self.assertEqual(gw.sample("llmgw_gateway_queue_wait_seconds_count", model="demo", outcome="timeout"), 1)
        self.assertEqual(
            gw.sample("llmgw_gateway_requests_total", model="demo", path="/v1/chat/completions", status="503"), 1
        )

    def test_bound(self) -> None:
        """
        Past the bound a request gets 503 with C{Retry-After} at once; those
        already waiting keep their places.
        """
        gw = Gw(GatewayConfig(queue_depth=2))
        waiting = [gw.send(n=1), gw.send(n=2)]
        refused = gw.send(n=3)
        status, headers, body = parse(refused.value())
        self.assertEqual((status, error_of(body)["code"]), (503, "queue_full"))
        self.assertEqual(dict(headers)[b"retry-after"], b"5")
        self.assertEqual([c.value() for c in waiting], [b"", b""])
        gw.ready("r1")
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [1, 2])

    def test_depth_zero_is_off(self) -> None:
        """
        A depth of 0 turns the queue off: 503 C{no_ready_replica} at once.
        """
        gw = Gw(GatewayConfig(queue_depth=0))
        status, _, body = parse(gw.send().value())
        self.assertEqual((status, error_of(body)["code"]), (503, "no_ready_replica"))

    def test_fair_across_keys(self) -> None:
        """
        One key's burst does not starve another: bob's request, sent after
        ten of alice's, is the second one sent on.
        """
        gw = Gw()
        for i in range(10):
            gw.send("alice", n=i)
        gw.send("bob", n=100)
        gw.ready("r1")
        order = [sent_n(t) for _, t in gw.new_upstreams()]
        self.assertEqual(order[:3], [0, 100, 1])
        self.assertEqual(sorted(order), list(range(10)) + [100])

    def test_full_queue_fair_across_keys(self) -> None:
        """
        When alice's burst has filled the queue, bob's request still gets a
        place: alice's newest gives it up (503 C{queue_full}); and bob's
        next, while he holds as many as alice, is refused.
        """
        gw = Gw(GatewayConfig(queue_depth=4))
        alice = [gw.send("alice", n=i) for i in range(4)]
        bob = gw.send("bob", n=100)
        self.assertEqual(bob.value(), b"")
        status, _, body = parse(alice[3].value())
        self.assertEqual((status, error_of(body)["code"]), (503, "queue_full"))
        bob2 = gw.send("bob", n=101)
        self.assertEqual(bob2.value(), b"")
        status, _, _ = parse(alice[2].value())
        self.assertEqual(status, 503)
        bob3 = gw.send("bob", n=102)
        self.assertEqual(parse(bob3.value())[0], 503)
        gw.ready("r1")
        self.assertEqual(sorted(sent_n(t) for _, t in gw.new_upstreams()), [0, 1, 100, 101])

    def test_disconnect_leaves_the_queue(self) -> None:
        """
        A client that goes away while waiting leaves the queue at once: no
        upstream request is made for it when a replica turns ready, and the
        others keep their order.
        """
        gw = Gw()
        gw.send(n=1)
        gw.send(n=2)
        gw.send(n=3)
        gw.protos[1].connectionLost(Failure(ConnectionError("client went away")))
        self.assertEqual(gw.gateway.demand(), {"demo": Demand(0, 2)})
        self.assertEqual(
            gw.sample("llmgw_gateway_queue_wait_seconds_count", model="demo", outcome="disconnected"), 1
        )
        gw.ready("r1")
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [1, 3])

    def test_no_overtaking(self) -> None:
        """
        While requests wait, a newcomer joins behind them even if it could
        go at once (its model's state changed without an event), and the
        whole queue goes in order.
        """
        gw = Gw()
        gw.send(n=1)
        # A table change the queue hears of only on the next reactor turn.
        gw.table.publish_model("demo", [Route("r1", "demo", "10.0.0.1:8000")])
        gw.send(n=2)
        gw.clock.advance(0)
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [1, 2])

    def test_saturated_waits_for_capacity(self) -> None:
        """
        With every replica saturated (fresh engine signals over the
        threshold) a request waits; when one of the model's requests
        finishes, one waiter takes its place; fresh unsaturated signals
        release the rest.
        """
        gw = Gw()
        gw.ready("r1")
        first = gw.send(n=1)
        [(conn1, t1)] = gw.new_upstreams()
        full = EngineSignals(sampled_at=gw.clock.seconds(), waiting=100.0, running=8.0)
        gw.ready("r1", signals=full)
        gw.send(n=2)
        gw.send(n=3)
        self.assertEqual(gw.new_upstreams(), [])
        t1.clear()
        conn1.dataReceived(OK)
        self.assertEqual(parse(first.value())[0], 200)
        # Sent on the connection the finished request left idle.
        self.assertEqual(gw.new_upstreams(), [])
        self.assertEqual(sent_n(t1), 2)
        gw.clock.advance(0.5)  # the tick re-checks; still saturated
        gw.clock.advance(0.6)
        self.assertEqual(gw.new_upstreams(), [])
        calm = EngineSignals(sampled_at=gw.clock.seconds(), waiting=0.0, running=1.0)
        gw.ready("r1", signals=calm)
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [3])

    def test_stale_saturation_is_ignored(self) -> None:
        """
        Saturation judged from signals that went stale (no scrape) holds
        no request: within a tick of the signals' staleness bound the
        waiters go.
        """
        gw = Gw()
        full = EngineSignals(sampled_at=gw.clock.seconds(), waiting=100.0)
        gw.ready("r1", signals=full)
        gw.send(n=1)
        self.assertEqual(gw.new_upstreams(), [])
        for _ in range(5):
            gw.clock.advance(1.0)
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [1])

    def test_draining_only_waits(self) -> None:
        """
        A model whose only replica is draining has no ready replica: its
        requests wait for another.
        """
        gw = Gw()
        gw.table.publish_model("demo", [Route("old", "demo", "10.0.0.1:8000", draining=True)])
        client = gw.send()
        self.assertEqual((client.value(), gw.clock.tcpClients), (b"", []))
        gw.ready("new")
        self.assertEqual(len(gw.new_upstreams()), 1)

    def test_per_deployment_limits(self) -> None:
        """
        The routing table's per-model limits win over the gateway's
        defaults: depth 1 and a 2 s deadline for demo.
        """
        gw = Gw(GatewayConfig(queue_depth=100, queue_timeout_s=60))
        gw.table.set_queue_limits({"demo": QueueLimits(depth=1, timeout_s=2.0)})
        first = gw.send()
        self.assertEqual(parse(gw.send("alice").value())[0], 503)
        gw.clock.advance(2.0)
        self.assertEqual(error_of(parse(first.value())[2])["code"], "queue_timeout")

    def test_kept_while_room_is_made(self) -> None:
        """
        While the table says room is made for the model (C{room_s}), a
        waiter is not refused at its deadline: it is kept, counted once,
        and dispatched when a replica turns ready; it is refused at the
        deadline plus C{room_s} if none does.
        """
        gw = Gw(GatewayConfig(queue_timeout_s=60))
        gw.table.set_queue_limits({"demo": QueueLimits(timeout_s=2.0, room_s=10.0)})
        served, expired = gw.send(), gw.send("bob")
        gw.clock.advance(5.0)
        self.assertEqual((served.value(), expired.value()), (b"", b""))
        self.assertEqual(gw.sample("llmgw_gateway_queue_kept_total", model="demo"), 2)
        gw.clock.advance(1.0)
        gw.ready("r1")
        [(conn, _), (conn2, _)] = gw.new_upstreams()
        conn.dataReceived(OK)
        conn2.dataReceived(OK)
        self.assertEqual((parse(served.value())[0], parse(expired.value())[0]), (200, 200))
        self.assertEqual(gw.sample("llmgw_gateway_queue_kept_total", model="demo"), 2)

        gw.table.publish_model("demo", [])
        gw.clock.advance(0)
        late = gw.send()
        # The earlier requests are over, so this one may wait; no replica comes.
        gw.clock.advance(11.9)
        self.assertEqual(late.value(), b"")
        gw.clock.advance(0.2)
        self.assertEqual(error_of(parse(late.value())[2])["code"], "queue_timeout")

    def test_room_withdrawn(self) -> None:
        """
        When the table stops saying room is made, the queue timeout alone
        bounds a waiter again.
        """
        gw = Gw(GatewayConfig(queue_timeout_s=60))
        gw.table.set_queue_limits({"demo": QueueLimits(timeout_s=2.0, room_s=10.0)})
        gw.table.set_queue_limits({"demo": QueueLimits(timeout_s=2.0)})
        client = gw.send()
        gw.clock.advance(2.1)
        self.assertEqual(error_of(parse(client.value())[2])["code"], "queue_timeout")
        self.assertIsNone(gw.sample("llmgw_gateway_queue_kept_total", model="demo"))

    def test_without_keys_fair_by_address(self) -> None:
        """
        Without API keys the queue still takes requests (all from one
        address here), and the metrics keep to known models.
        """
        gw = Gw(keys=False)
        proto = gw.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(b'{"model": "demo"}'))
        gw.ready("r1")
        self.assertEqual(len(gw.new_upstreams()), 1)
        text = generate_latest(gw.gateway.registry).decode()
        self.assertIn('llmgw_gateway_queue_wait_seconds_count{model="demo",outcome="dispatched"} 1.0', text)

    def test_gateway_is_a_demand_source(self) -> None:
        """
        The gateway provides L{IDemand}.
        """
        self.assertTrue(IDemand.providedBy(Gw().gateway))


class StandaloneTests(SynchronousTestCase):
    def test_follower_table_change_releases_waiters(self) -> None:
        """
        A standalone gateway (routing by a L{FollowerTable}) answers 503 at
        once before its first read; once it holds a table, a request for a
        declared model without replicas waits, and goes when a read brings
        a ready replica. Its limits come from the table read.
        """
        clock = MemoryReactorClock()
        table = FollowerTable(clock, "http://127.0.0.1:7480", http=object())
        gw = Gateway(clock, table, GatewayConfig(default_policy="least_loaded"))
        site = GatewaySite(GatewayResource(gw))

        def send() -> StringTransport:
            proto = site.buildProtocol(None)
            client = StringTransport()
            proto.makeConnection(client)
            proto.dataReceived(post(b'{"model": "demo"}'))
            return client

        status, _, body = parse(send().value())
        self.assertEqual((status, error_of(body)["code"]), (503, "no_ready_replica"))
        table._got(RoutingSnapshot([], ["demo"], 1, queues={"demo": QueueLimits(timeout_s=5.0)}), [])
        expired = send()
        clock.advance(5.0)
        self.assertEqual(error_of(parse(expired.value())[2])["code"], "queue_timeout")
        waiting = send()
        self.assertEqual((waiting.value(), clock.tcpClients), (b"", []))
        table._got(RoutingSnapshot([Route("r1", "demo", "10.0.0.1:8000")], ["demo"], 2), [])
        clock.advance(0)
        self.assertEqual(len(clock.tcpClients), 1)

    def test_gateway_service_is_a_demand_source(self) -> None:
        """
        The gateway service (what the control plane embeds) offers the
        gateway's L{IDemand}.
        """
        clock = MemoryReactorClock()
        table = RoutingTable(clock)
        table.set_known(["demo"])
        svc = GatewayService(clock, table, port=0)
        self.assertTrue(IDemand.providedBy(svc))
        proto = svc.site.buildProtocol(None)
        proto.makeConnection(StringTransport())
        proto.dataReceived(post(b'{"model": "demo"}'))
        self.assertEqual(svc.demand(), {"demo": Demand(0, 1)})


class LimitsTravelTests(SynchronousTestCase):
    def catalog(self, **fields: Any) -> Any:
        dep = {"model": "demo", "profile": "p", **fields}
        return parse_catalog({"profiles": {"p": {"command": ["x"]}}, "deployments": [dep]})

    def test_catalog_fields(self) -> None:
        """
        C{queue_depth} and C{queue_timeout_s} in a deployment become its
        queue limits; a deployment that sets neither has none.
        """
        cat = self.catalog(queue_depth=5, queue_timeout_s=2)
        self.assertEqual(cat.queue_limits(), {"demo": QueueLimits(5, 2.0)})
        self.assertEqual(self.catalog().queue_limits(), {})

    def test_catalog_refuses_bad_limits(self) -> None:
        """
        A negative depth, a zero or too long timeout and a non-number are
        refused with a message naming the deployment and the field.
        """
        for fields, text in [
            ({"queue_depth": -1}, "'queue_depth' must be at least 0"),
            ({"queue_timeout_s": 0}, "'queue_timeout_s'"),
            ({"queue_timeout_s": 100_000}, "'queue_timeout_s'"),
            ({"queue_timeout_s": "soon"}, "must be a number"),
        ]:
            with self.assertRaises(CatalogError) as e:
                self.catalog(**fields)
            self.assertIn("deployment 'demo'", str(e.exception))
            self.assertIn(text, str(e.exception))

    def test_control_plane_publishes_the_catalogs_limits(self) -> None:
        """
        The control plane's hook publishes the catalog's queue limits at
        once, and the reloaded catalog's when the declared models are
        published again; the embedded gateway then holds by them.
        """
        from types import SimpleNamespace

        from llmgw.control.service import follow_catalog_policies

        clock = MemoryReactorClock()
        reconciler = SimpleNamespace(routing_table=RoutingTable(clock), catalog=self.catalog(queue_depth=3))
        follow_catalog_policies(reconciler)
        table = reconciler.routing_table
        self.assertEqual(table.queue_limits("demo"), QueueLimits(3, None))
        reconciler.catalog = self.catalog(queue_timeout_s=1.5)
        table.set_known(["demo"])
        self.assertEqual(snapshot_to_json(table, 0.0)["queues"], {"demo": {"timeout_s": 1.5}})
        gw = Gateway(clock, table)
        proto = GatewaySite(GatewayResource(gw)).buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(b'{"model": "demo"}'))
        clock.advance(1.5)
        self.assertEqual(error_of(parse(client.value())[2])["code"], "queue_timeout")

    def test_routes_document_round_trip(self) -> None:
        """
        Queue limits travel in C{GET /api/v1/routes} to standalone gateways;
        a bad entry costs only itself.
        """
        table = RoutingTable(MemoryReactorClock())
        table.set_known(["demo", "other"])
        table.set_queue_limits({"demo": QueueLimits(7, 3.0, 40.0), "other": QueueLimits(timeout_s=9.0)})
        doc = snapshot_to_json(table, 0.0)
        snap, problems = snapshot_from_json(doc, 0.0)
        self.assertEqual(problems, [])
        self.assertEqual(snap.queue_limits("demo"), QueueLimits(7, 3.0, 40.0))
        self.assertEqual(snap.queue_limits("other"), QueueLimits(None, 9.0))
        for bad in ({"depth": -3}, {"room_s": -1}, {"room_s": "long"}):
            doc["queues"]["demo"] = bad
            snap, problems = snapshot_from_json(doc, 0.0)
            self.assertIsNone(snap.queue_limits("demo"))
            self.assertEqual(len(problems), 1)
            self.assertIn("queues['demo']", problems[0])

    def test_table_reads_the_catalog_at_each_publication(self) -> None:
        """
        With a C{queue_source} (the control plane's catalog) the declared
        models' publication carries the limits, and a change of limits
        alone is a new revision.
        """
        table = RoutingTable(MemoryReactorClock())
        limits = {"demo": QueueLimits(1, None)}
        table.queue_source = lambda: limits
        table.set_known(["demo"])
        self.assertEqual(table.queue_limits("demo"), QueueLimits(1, None))
        rev = table.revision
        self.assertFalse(table.set_known(["demo"]))
        limits = {"demo": QueueLimits(2, None)}
        self.assertTrue(table.set_known(["demo"]))
        self.assertGreater(table.revision, rev)


class LoopbackTests(TestCase):
    timeout = 15

    @inlineCallbacks
    def test_held_request_answered_once_a_replica_appears(self) -> Any:
        """
        Through a real gateway on loopback: a request for a model with no
        replica is held, not refused, and answered by the replica that
        turns ready after it arrived.
        """
        import treq
        from twisted.internet.task import deferLater

        table = RoutingTable(global_reactor)
        table.set_known(["demo"])
        gw = Gateway(global_reactor, table, GatewayConfig(default_policy="least_loaded"))
        front = TrackingFactory(GatewaySite(GatewayResource(gw), reactor=global_reactor))
        port = global_reactor.listenTCP(0, front, interface="127.0.0.1")
        replica = FakeReplica("late")
        replica.listen()

        @inlineCallbacks
        def cleanup() -> Any:
            yield front.close_all()
            gw.close()
            yield replica.stop()
            yield port.stopListening()

        self.addCleanup(cleanup)
        url = f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions"
        d = treq.post(url, json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
                      persistent=False)
        # Publish only once the gateway holds the request (bounded by the
        # test's timeout).
        while not gw.admission.waiting("demo"):
            yield deferLater(global_reactor, 0.01, lambda: None)
        self.assertEqual(replica.received, [])
        table.publish_model("demo", [Route("late", "demo", replica.address())])
        response = yield d
        body = yield response.json()
        self.assertEqual(response.code, 200)
        self.assertIn("late", body["choices"][0]["message"]["content"])
        self.assertEqual(len(replica.received), 1)
