"""
The admission queue's byte budgets (llmgw.gateway.admission): the bodies of
waiting requests may hold at most a budget per model and one for the whole
process; a body that would pass either waits nowhere (503 with Retry-After,
naming the budget), and a waiter's bytes are released however it leaves.
Driven in memory through the gateway's front, on a MemoryReactorClock; one
loopback test through a real gateway.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway import errors
from llmgw.gateway.admission import NONE, Admission, QueueConfig
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.routing import RoutingTable
from tests.gateway_helpers import TrackingFactory
from tests.test_gateway_admission import KEYS, Gw, sent_n
from tests.test_gateway_resource import LogCapture, error_of, parse, post

#: Bytes of each body sent (L{body}); budgets below are multiples of it.
SIZE = 1000


def body(model: str, n: int) -> bytes:
    """
    A request body of exactly L{SIZE} bytes.
    """
    b = json.dumps({"model": model, "n": n, "pad": ""}).encode()
    return json.dumps({"model": model, "n": n, "pad": "x" * (SIZE - len(b))}).encode()


def send(gw: Gw, n: int, who: str = "alice", model: str = "demo") -> StringTransport:
    proto = gw.site.buildProtocol(None)
    client = StringTransport()
    proto.makeConnection(client)
    gw.protos.append(proto)
    proto.dataReceived(post(body(model, n), extra=b"Authorization: Bearer " + KEYS[who].encode() + b"\r\n"))
    return client


class Request:
    """
    What L{Admission} needs of a request: the hook for its client leaving.
    """

    on_lost: Any = None


class BudgetThroughTheFrontTests(SynchronousTestCase):
    def test_model_budget(self) -> None:
        """
        Bodies wait up to the model's byte budget; the next one that would
        pass it gets 503 C{queue_bytes_full} at once, with C{Retry-After}
        and a message naming the model's budget, and the waiting ones keep
        their places. The bytes gauge follows, and the refusal is counted
        as the C{over_budget} outcome.
        """
        gw = Gw(GatewayConfig(default_policy="least_loaded", queue_bytes_per_model=3 * SIZE))
        waiting = [send(gw, n) for n in range(3)]
        self.assertEqual(gw.sample("llmgw_gateway_queue_bytes", model="demo"), 3 * SIZE)
        refused = send(gw, 3)
        status, headers, raw = parse(refused.value())
        err = error_of(raw)
        self.assertEqual((status, err["code"], err["type"]), (503, "queue_bytes_full", "server_error"))
        self.assertEqual(dict(headers)[b"retry-after"], b"5")
        self.assertIn("for 'demo'", err["message"])
        self.assertIn(f"budget of {3 * SIZE} bytes", err["message"])
        self.assertEqual([c.value() for c in waiting], [b"", b"", b""])
        self.assertEqual(
            gw.sample("llmgw_gateway_queue_wait_seconds_count", model="demo", outcome="over_budget"), 1
        )
        gw.ready("r1")
        self.assertEqual([sent_n(t) for _, t in gw.new_upstreams()], [0, 1, 2])
        self.assertEqual(gw.gateway.admission.queued_bytes, 0)
        self.assertIsNone(gw.sample("llmgw_gateway_queue_bytes", model="demo"))
        self.assertIn(b"llmgw_gateway_queue_bytes", generate_latest(gw.gateway.registry))

    def test_process_budget(self) -> None:
        """
        The bodies of all models together are bounded by the process's
        budget: with room left in its own budget, a model's request is
        refused when the others' bodies hold the rest, and the message
        names the process's budget.
        """
        gw = Gw(GatewayConfig(default_policy="least_loaded", queue_bytes=3 * SIZE))
        gw.table.set_known(["demo", "other"])
        send(gw, 0)
        send(gw, 1)
        send(gw, 2, model="other")
        status, headers, raw = parse(send(gw, 3, model="other").value())
        err = error_of(raw)
        self.assertEqual((status, err["code"]), (503, "queue_bytes_full"))
        self.assertEqual(dict(headers)[b"retry-after"], b"5")
        self.assertIn("for all models of this gateway", err["message"])
        self.assertEqual(gw.gateway.admission.bytes_by_label(), {"demo": 2 * SIZE, "other": SIZE})

    def test_over_budget_pushes_nobody_out(self) -> None:
        """
        With the queue full by depth too, a newcomer over the byte budget
        is refused without taking another key's place (the fair rule for
        depth would have pushed alice's newest out).
        """
        gw = Gw(GatewayConfig(default_policy="least_loaded", queue_depth=2, queue_bytes_per_model=2 * SIZE))
        alice = [send(gw, 0), send(gw, 1)]
        bob = send(gw, 2, who="bob")
        self.assertEqual(error_of(parse(bob.value())[2])["code"], "queue_bytes_full")
        self.assertEqual([c.value() for c in alice], [b"", b""])

    def test_logged_once_an_overload(self) -> None:
        """
        Refusals over a budget are logged once until the queues have
        emptied, not once a request.
        """
        logs = LogCapture(self)
        gw = Gw(GatewayConfig(default_policy="least_loaded", queue_bytes_per_model=SIZE))
        send(gw, 0)
        for n in range(1, 5):
            send(gw, n)
        self.assertEqual(logs.text().count("byte budget ("), 1)
        gw.ready("r1")
        gw.table.publish_model("demo", [])
        send(gw, 5)
        send(gw, 6)
        self.assertEqual(logs.text().count("byte budget ("), 2)


class ReleasedOnEveryExitTests(SynchronousTestCase):
    """
    A waiter's bytes return to both budgets however it leaves the queue.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.refused: list[errors.GatewayError] = []
        self.went: list[int] = []
        self.admission = Admission(
            self.clock, lambda model: NONE, lambda model: QueueConfig(depth=2, timeout_s=10, max_bytes=500),
            total_bytes=800,
        )
        self.addCleanup(self.admission.close)

    def enter(self, who: str, size: int, model: str = "m") -> Request:
        request = Request()
        self.admission.enter(model, who, request, lambda: self.went.append(size), self.refused.append, size)
        return request

    def assert_empty(self) -> None:
        self.assertEqual((self.admission.queued_bytes, self.admission.bytes_by_label()), (0, {}))

    def test_timeout(self) -> None:
        """
        A waiter timed out releases its bytes.
        """
        self.enter("a", 300)
        self.assertEqual(self.admission.queued_bytes, 300)
        self.clock.advance(10)
        self.assertEqual([e.code for e in self.refused], ["queue_timeout"])
        self.assert_empty()

    def test_client_gone(self) -> None:
        """
        A waiter whose client went away releases its bytes.
        """
        request = self.enter("a", 300)
        request.on_lost(Failure(ConnectionError("gone")))
        self.assert_empty()

    def test_pushed_out(self) -> None:
        """
        A waiter that gives its place to another key's request (the queue
        full by depth) releases its bytes; the newcomer's are counted.
        """
        self.enter("a", 100)
        self.enter("a", 200)
        self.enter("b", 50)
        self.assertEqual([e.code for e in self.refused], ["queue_full"])
        self.assertEqual(self.admission.queued_bytes, 150)

    def test_dispatched(self) -> None:
        """
        A waiter sent on releases its bytes, and room is made for more.
        """
        self.enter("a", 300)
        self.enter("b", 200)
        self.admission.capacity = lambda model: 2
        self.admission.pump("m")
        self.assertEqual(self.went, [300, 200])
        self.assert_empty()
        self.enter("a", 500)
        self.assertEqual(self.refused, [])

    def test_budgets_are_inclusive_and_per_model(self) -> None:
        """
        A body that fills a budget exactly waits; one byte more does not.
        Another model has its own budget, within the process's.
        """
        self.enter("a", 500)
        self.enter("b", 1)
        self.enter("a", 300, model="n")
        self.enter("b", 1, model="n")
        self.assertEqual(len(self.refused), 2)
        self.assertIn("waiting for 'm' would pass", self.refused[0].message)
        self.assertIn("waiting for all models of this gateway would pass", self.refused[1].message)
        self.assertEqual(self.admission.bytes_by_label(), {"m": 500, "n": 300})


class LoopbackTests(TestCase):
    timeout = 15

    @inlineCallbacks
    def test_over_budget_refused_on_loopback(self) -> Any:
        """
        Through a real gateway on loopback: with room for two bodies in the
        model's budget, two requests wait and the third is answered 503
        C{queue_bytes_full} with C{Retry-After} at once; when its clients
        go, the bytes are released.
        """
        import treq

        table = RoutingTable(global_reactor)
        table.set_known(["demo"])
        gw = Gateway(global_reactor, table, GatewayConfig(queue_bytes_per_model=2 * SIZE))
        front = TrackingFactory(GatewaySite(GatewayResource(gw), reactor=global_reactor))
        port = global_reactor.listenTCP(0, front, interface="127.0.0.1")

        @inlineCallbacks
        def cleanup() -> Any:
            yield front.close_all()
            gw.close()
            yield port.stopListening()

        self.addCleanup(cleanup)
        url = f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions"
        waiting = [treq.post(url, data=body("demo", n), persistent=False) for n in range(2)]
        while gw.admission.queued_bytes < 2 * SIZE:
            yield deferLater(global_reactor, 0.01, lambda: None)
        response = yield treq.post(url, data=body("demo", 2), persistent=False)
        err = (yield response.json())["error"]
        self.assertEqual((response.code, err["code"]), (503, "queue_bytes_full"))
        self.assertEqual(response.headers.getRawHeaders("retry-after"), ["5"])
        for d in waiting:
            d.cancel()
            d.addErrback(lambda f: None)
        while gw.admission.queued_bytes:
            yield deferLater(global_reactor, 0.01, lambda: None)
