"""
The gateway end to end on loopback: real sockets between a client, the
gateway and fake replicas (L{tests.gateway_helpers.FakeReplica}).
"""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway.front import FrontFactory, FrontRequest
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import Gateway, GatewayConfig, ProxyCall
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.upstream import UpstreamConnection
from llmgw.routing import Route, RoutingSnapshot
from tests.gateway_helpers import Harness, dead_address


def error_of(body: bytes) -> dict[str, Any]:
    obj = json.loads(body)
    assert set(obj) == {"error"}, obj
    assert {"message", "type", "code"} <= set(obj["error"]), obj
    return obj["error"]  # type: ignore[no-any-return]


class RawClient(Protocol):
    """
    A client that sends one request, records what comes back, and can stop
    reading or hang up at any moment.
    """

    def __init__(self, request: bytes):
        self.request = request
        self.data = b""
        self.lost: Deferred[None] = Deferred()
        self._waiting: list[tuple[bytes, Deferred[None]]] = []
        self.received_total = 0

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.received_total += len(data)
        if len(self.data) < 1 << 20:
            self.data += data
        for needle, d in list(self._waiting):
            if needle in self.data:
                self._waiting.remove((needle, d))
                d.callback(None)

    def wait_for(self, needle: bytes) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if needle in self.data:
            d.callback(None)
        else:
            self._waiting.append((needle, d))
        return d

    def connectionLost(self, reason: Any) -> None:
        self.lost.callback(None)


def raw_request(body: dict[str, Any], path: bytes = b"/v1/chat/completions") -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data)
    ) + data


class RoutingTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_routes_by_model(self) -> Any:
        """
        A request goes to a replica of the model its body names, and the
        replica gets the body the client sent, unchanged.
        """
        h = Harness(self)
        h.replica("a1", model="alpha")
        h.replica("b1", model="beta")
        for model, replica in [("alpha", "a1"), ("beta", "b1"), ("alpha", "a1")]:
            response = yield h.chat(model, extra={"temperature": 0.5})
            self.assertEqual(response.code, 200)
            body = yield response.json()
            self.assertEqual(body["choices"][0]["message"]["content"], replica)
            self.assertEqual(body["model"], model)
        self.assertEqual([r["model"] for r in h.replicas["a1"].received], ["alpha", "alpha"])
        self.assertEqual(h.replicas["b1"].received[0]["temperature"], 0.5)

    @inlineCallbacks
    def test_fewest_in_flight(self) -> Any:
        """
        While one replica is busy with a request, the next requests go to
        the idle replica of the same model.
        """
        h = Harness(self)
        r1, r2 = h.replica("r1"), h.replica("r2")
        r1.mode = r2.mode = "hold"
        both = [r1.arrived(), r2.arrived()]
        first = h.chat()
        yield DeferredList(both, fireOnOneCallback=True)
        busy = r1 if r1.received else r2
        idle = r2 if busy is r1 else r1
        idle.mode = "answer"
        self.assertEqual(h.gateway.in_flight(busy.name), 1)
        for _ in range(4):
            response = yield h.chat()
            body = yield response.json()
            self.assertEqual(body["choices"][0]["message"]["content"], idle.name)
        busy.answer(busy.open.pop())
        response = yield first
        self.assertEqual(response.code, 200)
        yield response.content()
        self.assertEqual(h.gateway.in_flight(busy.name), 0)

    @inlineCallbacks
    def test_draining_gets_nothing_new(self) -> Any:
        """
        A draining replica gets no new request while another is ready; with
        only draining replicas (and the admission queue off) the answer is
        503 at once.
        """
        h = Harness(self, GatewayConfig(queue_depth=0))
        h.replica("old", draining=True)
        h.replica("new")
        for _ in range(5):
            response = yield h.chat()
            body = yield response.json()
            self.assertEqual(body["choices"][0]["message"]["content"], "new")
        self.assertEqual(h.replicas["old"].received, [])
        h.route_list = [r for r in h.route_list if r.replica_id == "old"]
        h.routes_for()
        response = yield h.chat()
        self.assertEqual(response.code, 503)
        self.assertEqual(response.headers.getRawHeaders(b"Retry-After"), [b"5"])
        self.assertEqual(error_of((yield response.content()))["code"], "no_ready_replica")

    @inlineCallbacks
    def test_forwarded_headers(self) -> Any:
        """
        The replica sees the client's own headers, but not its API key nor
        hop-by-hop headers; it does see who the client is.
        """
        h = Harness(self, keys=KeyRing({"alice": "sk-secret-key"}))
        r = h.replica("r1")
        response = yield h.chat(
            headers={
                b"Authorization": [b"Bearer sk-secret-key"],
                b"X-Request-Id": [b"abc"],
            }
        )
        self.assertEqual(response.code, 200)
        yield response.content()
        headers = r.headers[0]
        self.assertEqual(headers.getRawHeaders(b"x-request-id"), [b"abc"])
        self.assertIsNone(headers.getRawHeaders(b"authorization"))
        self.assertEqual(headers.getRawHeaders(b"x-forwarded-for"), [b"127.0.0.1"])


class StreamingTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_first_event_before_upstream_finishes(self) -> Any:
        """
        The first server-sent event reaches the client while the replica is
        still generating (its response is open); the rest follow when sent.
        """
        h = Harness(self)
        r = h.replica("r1")
        r.mode = "manual"
        arrived = r.arrived()
        response = yield h.chat(extra={"stream": True}, unbuffered=True)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        chunks: list[bytes] = []
        first: Deferred[None] = Deferred()

        def collect(data: bytes) -> None:
            chunks.append(data)
            if not first.called:
                first.callback(None)

        done = treq.collect(response, collect)
        upstream = yield arrived
        yield first
        self.assertIn(b'"first"', b"".join(chunks))
        # The replica has not finished: the event came through on its own.
        self.assertFalse(upstream.finished)
        self.assertFalse(done.called)
        r.send_event(upstream, "second")
        r.finish(upstream)
        yield done
        text = b"".join(chunks)
        self.assertTrue(text.endswith(b"data: [DONE]\n\n"))
        self.assertIn(b'"second"', text)

    @inlineCallbacks
    def test_client_disconnect_cancels_upstream(self) -> Any:
        """
        A client that hangs up in the middle of a stream makes the gateway
        drop the replica's connection, which ends the replica's request;
        the replica's in-flight count goes back to zero.
        """
        h = Harness(self)
        r = h.replica("r1")
        r.mode = "manual"
        arrived = r.arrived()
        client = RawClient(raw_request({"model": "demo", "stream": True}))
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", h.port.getHost().port)
        yield connectProtocol(endpoint, client)
        yield arrived
        yield client.wait_for(b'"first"')
        self.assertEqual(h.gateway.in_flight("r1"), 1)
        client.transport.abortConnection()
        self.assertEqual((yield r.lost[0]), "cancelled")
        self.assertEqual(h.gateway.in_flight("r1"), 0)
        yield client.lost

    @inlineCallbacks
    def test_client_disconnect_while_waiting(self) -> Any:
        """
        A client that hangs up before the replica has answered anything also
        cancels the replica's request.
        """
        h = Harness(self)
        r = h.replica("r1")
        r.mode = "hold"
        arrived = r.arrived()
        client = RawClient(raw_request({"model": "demo"}))
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", h.port.getHost().port)
        yield connectProtocol(endpoint, client)
        yield arrived
        client.transport.abortConnection()
        self.assertEqual((yield r.lost[0]), "cancelled")
        self.assertEqual(h.gateway.in_flight("r1"), 0)
        yield client.lost

    @inlineCallbacks
    def test_slow_client_backpressure(self) -> Any:
        """
        A client that stops reading makes the gateway pause the replica's
        connection (the replica's producer is paused long before it has
        written everything); when the client reads again, all of it arrives.
        """
        h = Harness(self)
        r = h.replica("r1")
        r.mode = "flood"
        total = r.flood_bytes = 256 * 1024 * 1024
        arrived = r.arrived()
        client = RawClient(raw_request({"model": "demo"}))
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", h.port.getHost().port)
        yield connectProtocol(endpoint, client)
        client.transport.pauseProducing()
        yield arrived
        while r.flood is None or r.flood.pauses == 0:
            yield _later(0.01)
        # Let the pipeline settle: a paused replica stays paused.
        yield _later(0.2)
        self.assertTrue(r.flood.paused)
        stalled = r.flood.sent
        self.assertLess(stalled, 64 * 1024 * 1024)
        yield _later(0.1)
        self.assertEqual(r.flood.sent, stalled)
        client.transport.resumeProducing()
        while client.received_total < total:
            yield _later(0.01)
        self.assertEqual(r.flood.sent, total)


def _later(seconds: float) -> Deferred[None]:
    from twisted.internet.task import deferLater

    return deferLater(reactor, seconds, lambda: None)


class FailureTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_retry_on_dead_replica(self) -> Any:
        """
        A replica that refuses connections is skipped: the request goes to
        another replica and succeeds, and the retry is counted.
        """
        h = Harness(self)
        h.add_route("dead", "demo", dead_address())
        h.replica("alive")
        for _ in range(4):
            response = yield h.chat()
            self.assertEqual(response.code, 200)
            body = yield response.json()
            self.assertEqual(body["choices"][0]["message"]["content"], "alive")
        retries = h.gateway.registry.get_sample_value(
            "llmgw_gateway_retries_total", {"model": "demo", "reason": "connect"}
        )
        self.assertGreaterEqual(retries, 1)

    @inlineCallbacks
    def test_repeated_failures_cool_down(self) -> Any:
        """
        After C{failure_threshold} failures in a row a replica is out of
        rotation: no further request tries it during the cool-down.
        """
        h = Harness(self, GatewayConfig(failure_threshold=2, cooldown=60))
        h.add_route("dead", "demo", dead_address())
        h.replica("alive")
        for _ in range(8):
            response = yield h.chat()
            self.assertEqual(response.code, 200)
            yield response.content()
        self.assertTrue(h.gateway.router.cooling("dead"))
        retries = h.gateway.registry.get_sample_value(
            "llmgw_gateway_retries_total", {"model": "demo", "reason": "connect"}
        )
        self.assertEqual(retries, 2)
        self.assertEqual(
            h.gateway.registry.get_sample_value(
                "llmgw_gateway_replica_cooldowns_total", {"replica": "dead"}
            ),
            1,
        )

    @inlineCallbacks
    def test_all_dead_is_502(self) -> Any:
        """
        When every replica refuses connections the client gets an
        OpenAI-shaped 502 after at most C{max_tries} replicas.
        """
        h = Harness(self, GatewayConfig(max_tries=2))
        for i in range(3):
            h.add_route(f"dead{i}", "demo", dead_address())
        response = yield h.chat()
        self.assertEqual(response.code, 502)
        err = error_of((yield response.content()))
        self.assertEqual((err["type"], err["code"]), ("server_error", "upstream_error"))
        self.assertEqual(
            h.gateway.registry.get_sample_value(
                "llmgw_gateway_requests_total",
                {"model": "demo", "path": "/v1/chat/completions", "status": "502"},
            ),
            1,
        )
        self.flushLoggedErrors()

    @inlineCallbacks
    def test_first_byte_timeout_is_504(self) -> Any:
        """
        A replica that answers nothing within the first-byte timeout gets
        its request cancelled, and the client an OpenAI-shaped 504.
        """
        h = Harness(self, GatewayConfig(first_byte_timeout=0.2))
        r = h.replica("r1")
        r.mode = "hold"
        response = yield h.chat()
        self.assertEqual(response.code, 504)
        self.assertEqual(error_of((yield response.content()))["code"], "upstream_timeout")
        self.assertEqual((yield r.lost[0]), "cancelled")
        self.assertEqual(h.gateway.in_flight("r1"), 0)

    @inlineCallbacks
    def test_idle_timeout_breaks_off_stream(self) -> Any:
        """
        A stream whose replica goes silent past the idle timeout is broken
        off: the client's response ends without its final chunk, and the
        replica's request is cancelled.
        """
        h = Harness(self, GatewayConfig(idle_timeout=0.2))
        r = h.replica("r1")
        r.mode = "manual"
        client = RawClient(raw_request({"model": "demo", "stream": True}))
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", h.port.getHost().port)
        yield connectProtocol(endpoint, client)
        yield client.lost
        self.assertIn(b'"first"', client.data)
        self.assertFalse(client.data.endswith(b"0\r\n\r\n"))
        self.assertEqual((yield r.lost[0]), "cancelled")

    @inlineCallbacks
    def test_replica_error_passes_through(self) -> Any:
        """
        A replica's own error answer (a 400 about the request, say) reaches
        the client as the replica sent it, and is not retried.
        """
        h = Harness(self)
        r = h.replica("r1")
        r.mode = "hold"
        arrived = r.arrived()
        d = h.chat()
        upstream = yield arrived
        upstream.setResponseCode(400)
        upstream.setHeader(b"Content-Type", b"application/json")
        upstream.write(b'{"error": {"message": "bad", "type": "invalid_request_error", "code": null}}')
        upstream.finish()
        response = yield d
        self.assertEqual(response.code, 400)
        self.assertEqual(error_of((yield response.content()))["message"], "bad")
        self.assertEqual(len(r.received), 1)


class ErrorShapeTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def _check(self, h: Harness, body: Any, status: int, code: str, path: str = "/v1/chat/completions") -> Any:
        response = yield h.post(path, body)
        self.assertEqual(response.code, status)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
        err = error_of((yield response.content()))
        self.assertEqual(err["code"], code)
        return response

    @inlineCallbacks
    def test_each_error(self) -> Any:
        """
        Malformed JSON and a missing model get 400, an unknown model 404, a
        known model without a ready replica 503 with C{Retry-After} (at
        once, with the admission queue off), a body over the limit 413: each
        in OpenAI's error shape.
        """
        h = Harness(self, GatewayConfig(max_body=1000, queue_depth=0))
        h.known.add("later")
        h.routes_for()
        yield self._check(h, b'{"model": "demo"', 400, "invalid_json")
        yield self._check(h, b"[1, 2]", 400, "invalid_json")
        yield self._check(h, {"messages": []}, 400, "missing_model")
        yield self._check(h, {"model": 7}, 400, "missing_model")
        yield self._check(h, {"model": "nope"}, 404, "model_not_found")
        response = yield self._check(h, {"model": "later"}, 503, "no_ready_replica")
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"5"])
        yield self._check(h, {"model": "demo", "x": "y" * 2000}, 413, "request_too_large")
        yield self._check(h, {"model": "demo", "x": "y" * 2000}, 413, "request_too_large", "/v1/embeddings")

    @inlineCallbacks
    def test_chunked_body_over_limit(self) -> Any:
        """
        A chunked request body is cut off at the limit too (413), without
        being kept.
        """
        h = Harness(self, GatewayConfig(max_body=1000))
        body = json.dumps({"model": "demo", "x": "y" * 5000}).encode()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 700]), body[i : i + 700]) for i in range(0, len(body), 700))
        client = RawClient(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + chunked + b"0\r\n\r\n"
        )
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", h.port.getHost().port)
        yield connectProtocol(endpoint, client)
        yield client.lost
        self.assertTrue(client.data.startswith(b"HTTP/1.1 413 "), client.data[:100])


class KeyTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_keys(self) -> Any:
        """
        With keys configured, no key or a wrong one gets 401 with
        C{WWW-Authenticate}; a listed key gets through; no key ever appears
        in the log.
        """
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        h = Harness(self, keys=KeyRing({"alice": "sk-alice-0001", "bob": "sk-bob-00002"}))
        h.replica("r1")
        response = yield h.chat()
        self.assertEqual(response.code, 401)
        self.assertEqual(error_of((yield response.content()))["code"], "invalid_api_key")
        self.assertTrue(response.headers.getRawHeaders(b"www-authenticate"))
        response = yield h.chat(headers={b"Authorization": [b"Bearer sk-wrong-guess"]})
        self.assertEqual(response.code, 401)
        yield response.content()
        response = yield h.chat(headers={b"Authorization": [b"Bearer sk-bob-00002"]})
        self.assertEqual(response.code, 200)
        yield response.content()
        response = yield h.http.get(h.url + "/v1/models", headers={b"Authorization": [b"Bearer sk-alice-0001"]})
        self.assertEqual(response.code, 200)
        self.assertEqual((yield response.json())["data"][0]["id"], "demo")
        from twisted.logger import formatEvent

        text = " ".join(formatEvent(e) + repr(e) for e in events)
        self.assertIn("refused", text)
        for secret in ("sk-wrong-guess", "sk-bob-00002", "sk-alice-0001"):
            self.assertNotIn(secret, text)


class ModelsTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_models_list(self) -> Any:
        """
        C{GET /v1/models} lists the models with a ready, not draining
        replica, in OpenAI's list shape; C{/v1/models/NAME} gets one.
        """
        h = Harness(self)
        h.add_route("a", "alpha", "127.0.0.1:1")
        h.add_route("b", "beta", "127.0.0.1:2", draining=True)
        response = yield h.http.get(h.url + "/v1/models")
        body = yield response.json()
        self.assertEqual(body["object"], "list")
        self.assertEqual([(m["id"], m["object"]) for m in body["data"]], [("alpha", "model")])
        response = yield h.http.get(h.url + "/v1/models/alpha")
        self.assertEqual((yield response.json())["id"], "alpha")
        response = yield h.http.get(h.url + "/v1/models/beta")
        self.assertEqual(response.code, 404)
        yield response.content()
        response = yield h.post("/v1/models", {})
        self.assertEqual(response.code, 405)
        yield response.content()


class FramingTests(SynchronousTestCase):
    def test_chunked_upstream_claiming_a_length(self) -> None:
        """
        A replica's answer that comes chunked and also claims a
        Content-Length reaches the client chunked, without the void length.
        """
        clock = MemoryReactorClock()
        gw = Gateway(clock, RoutingSnapshot())
        requests: list[FrontRequest] = []
        proto = FrontFactory(requests.append, clock).buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(raw_request({"model": "demo"}))
        route = Route("r1", "demo", "127.0.0.1:1")
        call = ProxyCall(gw, requests[0], "demo", "/v1/chat/completions", b"{}", [route], 0.0)
        call.route = route
        call.response_started(200, b"OK", [(b"transfer-encoding", b"chunked"), (b"content-length", b"99")])
        call.response_data(b"abc")
        call.response_finished()
        out = transport.value()
        self.assertIn(b"Transfer-Encoding: chunked\r\n", out)
        self.assertNotIn(b"content-length", out.lower())
        self.assertTrue(out.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), out)


class RelayedHeadTests(SynchronousTestCase):
    def test_replica_head_through_a_real_connection(self) -> None:
        """
        A replica's answer in the common shape (one Content-Length), read
        by the gateway's upstream client, reaches the client with the
        replica's own headers as sent, the gateway's Date and framing, and
        none of the replica's Server, Date, Keep-Alive or Content-Length.
        """
        clock = MemoryReactorClock()
        route = Route("r1", "demo", "127.0.0.1:1")
        gw = Gateway(clock, RoutingSnapshot([route]))
        conn = UpstreamConnection(gw.pool, route.address)
        conn.makeConnection(StringTransport())
        gw.pool.release(conn)
        proto = GatewaySite(GatewayResource(gw), clock).buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(raw_request({"model": "demo"}))
        self.assertIsNotNone(conn.handler)
        conn.dataReceived(
            b"HTTP/1.1 200 OK\r\nServer: fake/1\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
            b"Keep-Alive: timeout=5\r\nX-Instance: a:1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n{}"
        )
        head, _, body = client.value().partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.assertEqual(lines[0], b"HTTP/1.1 200 OK")
        self.assertEqual(body, b"{}")
        self.assertIn(b"X-Instance: a:1", lines)
        self.assertIn(b"Content-Type: application/json", lines)
        self.assertIn(b"Content-Length: 2", lines)
        lower = [line.lower() for line in lines]
        self.assertEqual([x for x in lower if x.startswith(b"content-length")], [b"content-length: 2"])
        self.assertEqual(len([x for x in lower if x.startswith(b"date:")]), 1)
        self.assertNotIn(b"2024", head)
        self.assertFalse([x for x in lower if x.startswith((b"server:", b"keep-alive:"))])


class OneWriteTests(SynchronousTestCase):
    def _call(self) -> tuple[ProxyCall, list[bytes]]:
        clock = MemoryReactorClock()
        gw = Gateway(clock, RoutingSnapshot())
        requests: list[FrontRequest] = []
        proto = FrontFactory(requests.append, clock).buildProtocol(None)
        proto.makeConnection(StringTransport())
        writes: list[bytes] = []
        proto.send = writes.append  # type: ignore[method-assign]
        proto.dataReceived(raw_request({"model": "demo"}))
        route = Route("r1", "demo", "127.0.0.1:1")
        call = ProxyCall(gw, requests[0], "demo", "/v1/chat/completions", b"{}", [route], 0.0)
        call.route = route
        return call, writes

    def test_head_and_body_in_one_write(self) -> None:
        """
        A replica's answer whose head and body come in one read reaches
        the client in one write.
        """
        call, writes = self._call()
        call.response_started(200, b"OK", [(b"content-length", b"2")])
        self.assertEqual(writes, [])
        call.response_data(b"ok")
        call.response_finished()
        (out,) = writes
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"\r\n\r\nok"), out)

    def test_head_alone_is_not_held(self) -> None:
        """
        A head that comes without body bytes (a stream whose first event is
        not ready) goes to the client at once.
        """
        call, writes = self._call()
        call.response_started(200, b"OK", [(b"transfer-encoding", b"chunked")])
        call.response_data(b"")
        (out,) = writes
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"\r\n\r\n"), out)
        call.response_data(b"data: 1\n\n")
        self.assertEqual(writes[1], b"9\r\ndata: 1\n\n\r\n")


class ReplicaTimeoutTests(SynchronousTestCase):
    def _start(self, first_byte: float, idle: float) -> tuple[MemoryReactorClock, StringTransport, Any, Gateway]:
        clock = MemoryReactorClock()
        config = GatewayConfig(first_byte_timeout=first_byte, idle_timeout=idle)
        gw = Gateway(clock, RoutingSnapshot([Route("r1", "demo", "127.0.0.1:9")]), config)
        proto = GatewaySite(GatewayResource(gw)).buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(raw_request({"model": "demo", "stream": True}))
        conn = clock.tcpClients[0][2].buildProtocol(None)
        conn.makeConnection(StringTransport())
        return clock, client, conn, gw

    def test_first_byte_time_longer_than_idle_time(self) -> None:
        """
        A replica gets the whole first-byte time for its head even when the
        idle time between bytes is shorter; after the head, the idle time
        governs.
        """
        clock, client, conn, gw = self._start(first_byte=10, idle=3)
        clock.advance(9.9)
        self.assertEqual(client.value(), b"")
        clock.advance(0.2)
        self.assertIn(b"HTTP/1.1 504 ", client.value())
        gw.close()

        clock, client, conn, gw = self._start(first_byte=10, idle=3)
        clock.advance(9)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.assertTrue(client.value().startswith(b"HTTP/1.1 200 OK\r\n"))
        clock.advance(2.9)
        self.assertFalse(client.disconnecting)
        clock.advance(0.2)
        self.assertTrue(client.disconnecting)
        gw.close()

    def test_first_byte_time_shorter_than_idle_time(self) -> None:
        """
        A first-byte time shorter than the idle time is kept exactly.
        """
        clock, client, conn, gw = self._start(first_byte=2, idle=30)
        clock.advance(1.9)
        self.assertEqual(client.value(), b"")
        clock.advance(0.2)
        self.assertIn(b"HTTP/1.1 504 ", client.value())
        gw.close()


    def test_timeouts_on_a_reused_connection(self) -> None:
        """
        On a replica connection kept from an earlier response, a request
        gets its own whole first-byte time, from when it was sent, whether
        the time is shorter or longer than the idle time; and an earlier
        response's timeout does not end a later one.
        """
        for first_byte, idle in ((10, 3), (2, 30)):
            clock, client, conn, gw = self._start(first_byte=first_byte, idle=idle)
            conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            self.assertTrue(client.value().endswith(b"\r\n\r\nok"))
            client.clear()
            clock.advance(1)
            proto = GatewaySite(GatewayResource(gw)).buildProtocol(None)
            second = StringTransport()
            proto.makeConnection(second)
            proto.dataReceived(raw_request({"model": "demo"}))
            self.assertEqual(len(clock.tcpClients), 1, "the kept connection is reused")
            self.assertEqual(conn.transport.value().count(b"POST "), 2)
            clock.advance(first_byte - 0.1)
            self.assertEqual(second.value(), b"", (first_byte, idle))
            clock.advance(0.2)
            self.assertIn(b"HTTP/1.1 504 ", second.value())
            gw.close()


class ClientTimeoutTests(SynchronousTestCase):
    def test_not_while_proxying(self) -> None:
        """
        The front's client timeouts (from the gateway's config) stay out of
        a proxied request's way: not while it waits for a replica, nor while
        the replica streams events for longer than every one of them; the
        idle wait starts when the response ends.
        """
        clock = MemoryReactorClock()
        config = GatewayConfig(head_timeout=3, body_timeout=4, keep_alive_timeout=5)
        gw = Gateway(clock, RoutingSnapshot([Route("r1", "demo", "127.0.0.1:9")]), config)
        site = GatewaySite(GatewayResource(gw))
        self.assertEqual((site.head_timeout, site.body_timeout, site.keep_alive_timeout), (3, 4, 5))
        proto = site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(raw_request({"model": "demo", "stream": True}))
        clock.advance(4.5)  # connecting to the replica
        self.assertFalse(client.disconnecting)
        host, port, factory, _, _ = clock.tcpClients[0]
        self.assertEqual((host, port), ("127.0.0.1", 9))
        upstream = StringTransport()
        conn = factory.buildProtocol(None)
        conn.makeConnection(upstream)
        self.assertIn(b"POST /v1/chat/completions HTTP/1.1\r\n", upstream.value())
        clock.advance(4.5)  # the replica thinks
        self.assertFalse(client.disconnecting)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(20):
            clock.advance(4.5)
            event = b"data: %d\n\n" % i
            conn.dataReceived(b"%x\r\n%s\r\n" % (len(event), event))
        self.assertFalse(client.disconnecting)
        conn.dataReceived(b"0\r\n\r\n")
        out = client.value()
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n"), out[:100])
        self.assertIn(b"data: 19\n\n", out)
        self.assertTrue(out.endswith(b"0\r\n\r\n"))
        clock.advance(4.9)
        self.assertFalse(client.disconnecting)
        clock.advance(0.1)
        self.assertTrue(client.disconnecting)
        self.assertEqual(client.value(), out)
        gw.close()


class ReplicaLeftTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_unstarted_requests_move_when_their_replica_leaves(self) -> Any:
        """
        Requests a hung replica accepted and never answered go to another
        replica as soon as it leaves the routing table (as a wedged one
        does), long before the first-byte timeout: every client gets its
        answer, none an error, and the hung replica's requests are cancelled.
        """
        h = Harness(self, GatewayConfig(first_byte_timeout=300))
        hung, good = h.replica("hung"), h.replica("good")
        hung.mode = "hold"
        good.mode = "hold"
        h.route_list = [r for r in h.route_list if r.replica_id == "hung"]
        h.routes_for()
        calls = [h.chat(), h.chat()]
        while len(hung.received) < 2:
            yield deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(h.gateway.unstarted.waiting("hung"), 2)
        good.mode = "answer"
        h.add_route("good", "demo", good.address())
        h.route_list = [r for r in h.route_list if r.replica_id != "hung"]
        h.routes_for()
        self.assertEqual(h.gateway.unstarted.left(h.table.replica_ids()), 2)
        for d in calls:
            response = yield d
            self.assertEqual(response.code, 200)
            body = yield response.json()
            self.assertEqual(body["choices"][0]["message"]["content"], "good")
        self.assertEqual(h.gateway.unstarted.waiting("hung"), 0)
        self.assertEqual(h.gateway.in_flight("hung"), 0)
