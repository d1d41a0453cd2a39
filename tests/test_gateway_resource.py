"""
The gateway's request handling in memory (a L{GatewaySite} on a
StringTransport, replicas answered by the test): which C{Host} it serves,
how it bounds JSON, what it echoes and logs of client strings, the labels
its metrics create, and what it forwards each way.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.follower import FollowerTable, RoutingSnapshot
from llmgw.gateway.front import FrontFactory
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.hostcheck import HostCheck
from llmgw.routing import Route


def parse(data: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """
    One response: status, headers (names in lower case), body (chunked
    framing removed).
    """
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    names = dict(headers)
    if b"content-length" in names:
        return status, headers, rest[: int(names[b"content-length"])]
    if names.get(b"transfer-encoding") == b"chunked":
        body = b""
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            body += rest[:n]
            rest = rest[n + 2 :]
        return status, headers, body
    return status, headers, rest


def post(body: bytes, host: bytes = b"127.0.0.1:8000", path: bytes = b"/v1/chat/completions",
         extra: bytes = b"") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
        + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


class Front:
    """
    A gateway on a memory reactor; each L{send} is a new client connection.
    """

    def __init__(self, table: Any = None, hosts: HostCheck | None = None, config: GatewayConfig | None = None):
        self.clock = MemoryReactorClock()
        if table is None:
            table = RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")])
        self.gateway = Gateway(self.clock, table, config, hosts=hosts)
        self.site = GatewaySite(GatewayResource(self.gateway))
        self.client: StringTransport | None = None

    def send(self, raw: bytes) -> StringTransport:
        proto = self.site.buildProtocol(None)
        self.client = StringTransport()
        proto.makeConnection(self.client)
        proto.dataReceived(raw)
        self.drain()
        return self.client

    def drain(self) -> None:
        """
        Run the calls due now, and those they schedule for now: a large
        body is parsed over several reactor turns.
        """
        now = self.clock.seconds()
        while any(c.getTime() <= now for c in self.clock.getDelayedCalls()):
            self.clock.advance(0)

    def answer(self, raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        t = self.send(raw)
        return parse(t.value())

    def upstream(self) -> tuple[Any, StringTransport]:
        """
        The replica's side of the newest connection the gateway opened.
        """
        _, _, factory, _, _ = self.clock.tcpClients[-1]
        conn = factory.buildProtocol(None)
        transport = StringTransport()
        conn.makeConnection(transport)
        return conn, transport

    def metrics(self) -> bytes:
        return generate_latest(self.gateway.registry)


def error_of(body: bytes) -> dict[str, Any]:
    return json.loads(body)["error"]  # type: ignore[no-any-return]


class LogCapture:
    def __init__(self, testcase: SynchronousTestCase):
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        testcase.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def text(self) -> str:
        return "\n".join(formatEvent(e) for e in self.events)


class HostTests(SynchronousTestCase):
    def test_foreign_host_is_421(self) -> None:
        """
        A request whose C{Host} is not a name the gateway serves (a page
        whose name rebinds to 127.0.0.1) gets 421 in OpenAI's shape, naming
        the option that lists names, and reaches no replica; nor does a
        C{GET /v1/models} get the model list. The refusal is logged with
        the peer.
        """
        log = LogCapture(self)
        front = Front()
        status, headers, body = front.answer(post(b'{"model": "demo"}', host=b"rebind.evil.example:8000"))
        self.assertEqual(status, 421)
        err = error_of(body)
        self.assertEqual(err["code"], "misdirected_request")
        self.assertIn("'rebind.evil.example:8000'", err["message"])
        self.assertIn("--gateway-hosts", err["message"])
        self.assertEqual(front.clock.tcpClients, [])
        assert front.client is not None
        self.assertTrue(front.client.value().startswith(b"HTTP/1.1 421 Misdirected Request\r\n"))
        status, _, body = front.answer(b"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        self.assertEqual(status, 421)
        self.assertNotIn(b"demo", body)
        self.assertIn("421", log.text())
        self.assertIn("192.168.1.1", log.text())
        self.assertIn("does not serve the host 'evil.example'", log.text())

    def test_foreign_host_is_421_without_a_screen(self) -> None:
        """
        The handler checks the host itself for a request no screen passed
        (a front that has none): a foreign host is 421 there too.
        """
        front = Front()
        front.site = FrontFactory(front.site.resource, front.clock)  # type: ignore[assignment]
        status, _, body = front.answer(post(b'{"model": "demo"}', host=b"rebind.evil.example:8000"))
        self.assertEqual(status, 421)
        self.assertEqual(error_of(body)["code"], "misdirected_request")
        self.assertEqual(front.clock.tcpClients, [])

    def test_served_hosts(self) -> None:
        """
        Loopback names (with or without a port) and listed names are
        served; C{/health} answers whatever the C{Host}, for load balancers.
        """
        front = Front(hosts=HostCheck(["gw.example.com"]))
        for host in (b"localhost", b"localhost:8000", b"127.0.0.1:8000", b"[::1]:8000", b"gw.example.com:80"):
            status, _, _ = front.answer(b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
            self.assertEqual(status, 200, host)
        status, _, body = front.answer(b"GET /health HTTP/1.1\r\nHost: lb.internal:8000\r\n\r\n")
        self.assertEqual((status, json.loads(body)), (200, {"status": "ok"}))


class JSONTests(SynchronousTestCase):
    def test_deep_json_is_400(self) -> None:
        """
        A body nesting 100,000 levels gets 400 with the reason, not a 500
        and a RecursionError traceback (trial fails a test that logs one);
        64 levels go through to a replica.
        """
        front = Front()
        deep = b'{"model": "demo", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, _, body = front.answer(post(deep))
        self.assertEqual(status, 400)
        err = error_of(body)
        self.assertEqual(err["code"], "json_too_deep")
        self.assertIn("64 levels", err["message"])
        self.assertEqual(front.clock.tcpClients, [])
        fine = b'{"model": "demo", "x": ' + b"[" * 63 + b"]" * 63 + b"}"
        front.send(post(fine))
        self.assertEqual(len(front.clock.tcpClients), 1)

    def test_two_model_keys_are_400(self) -> None:
        """
        A body naming C{"model"} twice (routed by one, read by the replica
        as the other) gets 400 and reaches no replica, also when the second
        is spelled with escapes.
        """
        front = Front()
        for body in (b'{"model": "demo", "model": "other"}', b'{"model": "other", "mod\\u0065l": "demo"}'):
            status, _, answer = front.answer(post(body))
            self.assertEqual(status, 400, body)
            err = error_of(answer)
            self.assertEqual(err["code"], "duplicate_key")
            self.assertIn("'model'", err["message"])
        self.assertEqual(front.clock.tcpClients, [])


class EchoTests(SynchronousTestCase):
    def test_long_client_strings_are_clipped(self) -> None:
        """
        A 1 MB model name, a 30 KB path or a 30 KB C{Host} comes back in an
        error body of under a kilobyte, with its length, and costs a log
        line of under a kilobyte.
        """
        log = LogCapture(self)
        front = Front(config=GatewayConfig(max_body=2 * 1024 * 1024))
        name = "m" * 1_000_000
        cases = [
            (post(json.dumps({"model": name}).encode()), 404, "1000000"),
            (b"GET /v1/" + b"p" * 30_000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", 404, "30004"),
            (b"GET /v1/models HTTP/1.1\r\nHost: " + b"h" * 30_000 + b"\r\n\r\n", 421, "30000"),
        ]
        for raw, code, length in cases:
            del log.events[:]
            status, _, body = front.answer(raw)
            self.assertEqual(status, code)
            self.assertLess(len(body), 1024)
            self.assertIn(length, error_of(body)["message"])
            self.assertTrue(log.events)
            for event in log.events:
                self.assertLess(len(formatEvent(event)), 1024)


class LabelTests(SynchronousTestCase):
    def test_unloaded_follower_creates_no_label_per_model(self) -> None:
        """
        A standalone gateway that has not loaded its routing table yet
        answers every model 503 (it may exist), but its metrics count them
        all under one C{_unknown} series: 3,000 distinct names leave
        C{/metrics} as large as 3 did (but for the counts' digits).
        """
        front = Front(table=FollowerTable(MemoryReactorClock(), "http://127.0.0.1:7480", http=object()))
        sizes = []
        for batch in (range(3), range(3, 3000)):
            for i in batch:
                status, _, _ = front.answer(post(json.dumps({"model": f"model-{i}"}).encode()))
                self.assertEqual(status, 503)
            sizes.append(len(front.metrics()))
        self.assertLess(sizes[1] - sizes[0], 20)
        self.assertIn(b'model="_unknown"', front.metrics())
        self.assertNotIn(b"model-1", front.metrics())

    def test_labels_only_for_known_models(self) -> None:
        """
        With a routing table, unknown models (404) share the C{_unknown}
        series; a model the table declares gets its own label even with no
        ready replica (503, at once with the admission queue off).
        """
        front = Front(table=RoutingSnapshot([], known=["later"]), config=GatewayConfig(queue_depth=0))
        for i in range(2000):
            front.answer(post(json.dumps({"model": f"nope-{i}"}).encode()))
        status, _, _ = front.answer(post(b'{"model": "later"}'))
        self.assertEqual(status, 503)
        text = front.metrics().decode()
        self.assertIn('model="later"', text)
        self.assertNotIn("nope-", text)
        self.assertLess(len(text), 20_000)

    def test_label_cap(self) -> None:
        """
        Past C{max_models} distinct labels, further models count as
        C{_unknown}: a backstop whatever the routing table says.
        """
        front = Front()
        m = front.gateway.metrics
        m.max_models = 10
        for i in range(50):
            m.count(f"model-{i}", "/v1/chat/completions", 200)
            m.observe(f"model-{i}", 0.1)
        text = front.metrics().decode()
        self.assertIn('model="model-9"', text)
        self.assertNotIn('model="model-10"', text)
        self.assertIn('model="_unknown"', text)


class ForwardingTests(SynchronousTestCase):
    def forwarded(self, extra: bytes, which: str | None = None) -> dict[bytes, list[bytes]]:
        front = Front(config=None if which is None else GatewayConfig(forwarded_headers=which))
        front.send(post(b'{"model": "demo"}', extra=extra))
        _, upstream = front.upstream()
        head = upstream.value().partition(b"\r\n\r\n")[0]
        headers: dict[bytes, list[bytes]] = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        return headers

    _FORGED = (
        b"Forwarded: for=6.6.6.6;proto=https\r\nX-Forwarded-For: 6.6.6.6\r\n"
        b"X-Real-IP: 6.6.6.6\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: admin.example\r\n"
    )

    def test_client_forwarding_headers_replaced(self) -> None:
        """
        By default, C{Forwarded}, C{X-Forwarded-For}, C{-Proto}, C{-Host}
        and C{X-Real-IP} sent by the client are dropped, and the replica
        gets the gateway's own C{X-Forwarded-For} and C{X-Forwarded-Proto},
        once each: the client's address and C{http}.
        """
        headers = self.forwarded(self._FORGED)
        self.assertEqual(headers[b"x-forwarded-for"], [b"192.168.1.1"])
        self.assertEqual(headers[b"x-forwarded-proto"], [b"http"])
        for name in (b"x-real-ip", b"x-forwarded-host", b"forwarded"):
            self.assertNotIn(name, headers)
        self.assertNotIn(b"6.6.6.6", b"".join(v for vs in headers.values() for v in vs))

    def test_none_forwarded(self) -> None:
        """
        With C{forwarded_headers="none"} the replica hears nothing of the
        client, and nothing of what the client forged.
        """
        headers = self.forwarded(self._FORGED, "none")
        for name in (b"x-forwarded-for", b"x-forwarded-proto", b"x-real-ip", b"x-forwarded-host", b"forwarded"):
            self.assertNotIn(name, headers)
        self.assertRaises(ValueError, GatewayConfig, forwarded_headers="some")

    def test_full_forwarding_headers_replaced(self) -> None:
        """
        With C{forwarded_headers="full"} the client's are dropped and the
        replica gets the gateway's own, once each: the client's address,
        C{http}, the C{Host} it asked for, also as X-Real-IP and RFC 7239's
        C{Forwarded}.
        """
        headers = self.forwarded(self._FORGED, "full")
        self.assertEqual(headers[b"x-forwarded-for"], [b"192.168.1.1"])
        self.assertEqual(headers[b"x-real-ip"], [b"192.168.1.1"])
        self.assertEqual(headers[b"x-forwarded-proto"], [b"http"])
        self.assertEqual(headers[b"x-forwarded-host"], [b"127.0.0.1:8000"])
        self.assertEqual(headers[b"forwarded"], [b'for=192.168.1.1;host="127.0.0.1:8000";proto=http'])
        self.assertNotIn(b"6.6.6.6", b"".join(v for vs in headers.values() for v in vs))

    def test_connection_options_stripped(self) -> None:
        """
        Headers that the client's C{Connection} names are for that hop only
        and are not forwarded; other headers are.
        """
        headers = self.forwarded(
            b"Connection: keep-alive, X-Hop-Secret\r\nConnection: x-other-hop\r\n"
            b"X-Hop-Secret: 1\r\nX-Other-Hop: 2\r\nX-Request-Id: abc\r\n"
        )
        self.assertNotIn(b"x-hop-secret", headers)
        self.assertNotIn(b"x-other-hop", headers)
        self.assertNotIn(b"connection", headers)
        self.assertEqual(headers[b"x-request-id"], [b"abc"])

    def test_replica_connection_options_stripped(self) -> None:
        """
        Headers the replica's C{Connection} names do not reach the client.
        """
        front = Front()
        client = front.send(post(b'{"model": "demo"}'))
        conn, _ = front.upstream()
        conn.dataReceived(
            b"HTTP/1.1 200 OK\r\nConnection: x-upstream-hop\r\nX-Upstream-Hop: 1\r\n"
            b"X-Kept: 2\r\nContent-Length: 2\r\n\r\nok"
        )
        status, headers, body = parse(client.value())
        self.assertEqual((status, body), (200, b"ok"))
        names = [n for n, _ in headers]
        self.assertNotIn(b"x-upstream-hop", names)
        self.assertIn(b"x-kept", names)


class UpstreamHeadTests(SynchronousTestCase):
    def test_malformed_replica_heads_are_502(self) -> None:
        """
        A replica's answer with a bare CR or LF in a header value, another
        control character, a header name that is not a token, a Content-
        Length that is not plain digits or a transfer coding other than
        C{chunked} alone gets the client a 502 and nothing of the replica's
        head; the request is not sent to the replica again.
        """
        log = LogCapture(self)
        heads = [
            b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: injected=1\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX-A: a\nSet-Cookie: injected=1\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX-A: a\x00injected\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX Injected: 1\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding\x0b: chunked\r\nX-Injected: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\nContent-Length: 0_2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\nTransfer-Encoding: xchunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            b"HTTP/1.1 200 Injected\x0bOK\r\nContent-Length: 2\r\n\r\nok",
        ]
        for head in heads:
            front = Front()
            client = front.send(post(b'{"model": "demo"}'))
            conn, upstream = front.upstream()
            conn.dataReceived(head)
            status, headers, body = parse(client.value())
            self.assertEqual(status, 502, head)
            self.assertEqual(error_of(body)["code"], "upstream_error")
            self.assertIn("malformed response", error_of(body)["message"])
            self.assertNotIn(b"njected", client.value().partition(b"\r\n\r\n")[0])
            self.assertTrue(upstream.disconnecting)
            self.assertEqual(len(front.clock.tcpClients), 1)
        self.assertIn("malformed response", log.text())


class KeyOnHeadTests(SynchronousTestCase):
    """
    The API key is checked on the request's head, before its body.
    """

    def front(self) -> Front:
        from llmgw.gateway.keys import KeyRing

        front = Front()
        front.gateway.keys = KeyRing({"team": "sk-good"})
        return front

    def test_refused_before_body(self) -> None:
        """
        A request with a missing or wrong key gets its 401 (OpenAI's shape)
        as soon as its head is read, though its body has not come (and
        never will), and the connection closes after the answer.
        """
        for auth in (b"", b"Authorization: Bearer sk-bad\r\n"):
            front = self.front()
            head = post(b"{}" * 500, extra=auth).partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
            t = front.send(head)
            status, _, body = parse(t.value())
            self.assertEqual(status, 401)
            self.assertEqual(error_of(body)["type"], "invalid_request_error")
            self.assertTrue(t.disconnecting)
            self.assertEqual(front.clock.tcpClients, [])

    def test_valid_key_reads_body(self) -> None:
        """
        With a valid key the body is read and the request forwarded, under
        the key the head's check found.
        """
        front = self.front()
        t = front.send(post(b'{"model": "demo"}', extra=b"Authorization: Bearer sk-good\r\n"))
        self.assertEqual(t.value(), b"")
        self.assertEqual(len(front.clock.tcpClients), 1)


class LargeBodyTests(SynchronousTestCase):
    def test_large_body_parsed_over_turns(self) -> None:
        """
        A body over 256 KiB is not parsed in the turn it arrives in: it is
        answered only after later reactor turns, and refused as load_json
        would refuse it.
        """
        front = Front(config=GatewayConfig(max_body=8 * 1024 * 1024))
        body = json.dumps({"model": "nope", **{f"k{i}": i for i in range(40_000)}}).encode()
        proto = front.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(body))
        self.assertEqual(client.value(), b"")
        front.drain()
        status, _, answer = parse(client.value())
        self.assertEqual(status, 404)
        bad = front.answer(post(b'{"model":"demo","x":[' + b"1," * 200_000 + b"NaN]}"))
        self.assertEqual((bad[0], error_of(bad[2])["code"]), (400, "invalid_json"))
