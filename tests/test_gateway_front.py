"""
Tests for L{llmgw.gateway.front}, the gateway's lean HTTP/1.1 server,
driven through a L{StringTransport}.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import ClientCreator, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from zope.interface import implementer

from llmgw.gateway.deadline import Deadline
from llmgw.gateway.front import (
    MAX_HEAD,
    READ_AHEAD,
    FrontFactory,
    HTTPFront,
)
from llmgw.gateway.frontflow import DRAIN_MAX, PASS_OUTPUT, SEND_TIMEOUT
from llmgw.gateway.frontrequest import FrontRequest
from llmgw.gateway.httphead import MAX_HEADERS
from tests.gateway_helpers import cyclic_leftovers


class HalfCloseTransport(StringTransport):
    """
    A transport that can close its sending side only, as TCP's can.
    """

    write_closed = False
    aborted = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


@implementer(IPushProducer)
class Producer:
    def __init__(self) -> None:
        self.paused = False
        self.events: list[str] = []

    def pauseProducing(self) -> None:
        self.paused = True
        self.events.append("pause")

    def resumeProducing(self) -> None:
        self.paused = False
        self.events.append("resume")

    def stopProducing(self) -> None:
        self.events.append("stop")


class Server:
    """
    A front with a handler that keeps each request for the test to answer
    (or answers at once when C{auto} is set).
    """

    def __init__(self, max_body: int = 1000, auto: bool = False, transport: StringTransport | None = None,
                 **factory_args: Any):
        self.requests: list[FrontRequest] = []
        self.auto = auto
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.factory = FrontFactory(self.handle, self.clock, max_body, **factory_args)
        self.proto: HTTPFront = self.factory.buildProtocol(None)
        self.transport = transport or StringTransport()
        self.proto.makeConnection(self.transport)

    def handle(self, request: FrontRequest) -> None:
        self.requests.append(request)
        if self.auto:
            answer(request, request.body or b"ok")

    def feed(self, data: bytes, bytewise: bool = False) -> None:
        if bytewise:
            for i in range(len(data)):
                self.proto.dataReceived(data[i : i + 1])
        else:
            self.proto.dataReceived(data)

    def output(self) -> bytes:
        out = self.transport.value()
        self.transport.clear()
        return out


def answer(request: FrontRequest, body: bytes, status: int = 200) -> None:
    request.start_response(status, [(b"Content-Type", b"text/plain")], len(body))
    request.write(body)
    request.finish()


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: gw\r\n%sContent-Length: %d\r\n\r\n%s" % (path, extra, len(body), body)


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """
    Parse a run of Content-Length framed responses.
    """
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b": ")
            headers[name.lower()] = value
        n = int(headers.get(b"content-length", b"0"))
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


class RequestTests(SynchronousTestCase):
    def test_parsed_request(self) -> None:
        """
        The handler gets the method, the target, its path without the
        query, the headers (names in lower case, values trimmed) and the
        body.
        """
        s = Server()
        s.feed(post(b"/v1/x?a=1", b'{"a": 1}', b"X-Thing:  yes \r\n"))
        (r,) = s.requests
        self.assertEqual((r.method, r.uri, r.path), (b"POST", b"/v1/x?a=1", b"/v1/x"))
        self.assertEqual(r.header(b"x-thing"), b"yes")
        self.assertEqual(r.header(b"host"), b"gw")
        self.assertIsNone(r.header(b"nope"))
        self.assertEqual(r.body, b'{"a": 1}')
        self.assertEqual(r.client_host, "192.168.1.1")
        self.assertEqual(r.peer, "192.168.1.1:54321")

    def test_bytewise(self) -> None:
        """
        A request that arrives a byte at a time is read the same.
        """
        s = Server()
        s.feed(post(b"/p", b"0123456789"), bytewise=True)
        self.assertEqual([r.body for r in s.requests], [b"0123456789"])

    def test_chunked_body(self) -> None:
        """
        A chunked request body (with extensions and a trailer) is
        reassembled, even when it arrives a byte at a time.
        """
        for bytewise in (False, True):
            s = Server()
            s.feed(
                b"POST /p HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\nA\r\n 012345678\r\n0\r\nX-Trailer: t\r\n\r\n",
                bytewise,
            )
            self.assertEqual([r.body for r in s.requests], [b"hello 012345678"])

    def test_keep_alive_pipelined_in_order(self) -> None:
        """
        Pipelined requests are taken one at a time: the second reaches the
        handler only when the first response is finished, and the answers
        go out in order on the same connection.
        """
        s = Server()
        s.feed(post(b"/1", b"a") + post(b"/2", b"b") + b"GET /3 HTTP/1.1\r\nHost: gw\r\n\r\n")
        self.assertEqual([r.path for r in s.requests], [b"/1"])
        answer(s.requests[0], b"one")
        self.assertEqual([r.path for r in s.requests], [b"/1", b"/2"])
        answer(s.requests[1], b"two")
        answer(s.requests[2], b"three")
        got = responses(s.output())
        self.assertEqual([(st, b) for st, _, b in got], [(200, b"one"), (200, b"two"), (200, b"three")])
        self.assertFalse(s.transport.disconnecting)

    def test_synchronous_answers_pipelined(self) -> None:
        """
        A handler that answers at once gets every pipelined request in
        turn, 32 to a reactor turn (PASS_REQUESTS), so that one read of tiny
        requests does not hold the reactor for all their answers.
        """
        s = Server(auto=True)
        s.feed(b"".join(post(b"/%d" % i, b"x%d" % i) for i in range(50)))
        self.assertEqual(len(s.requests), 32)
        s.clock.advance(0)
        self.assertEqual(len(s.requests), 50)
        self.assertEqual([b for _, _, b in responses(s.output())], [b"x%d" % i for i in range(50)])

    def test_connection_close(self) -> None:
        """
        C{Connection: close} (and HTTP/1.0 without keep-alive) closes the
        connection after the response, which says so.
        """
        for request in (
            post(b"/p", b"x", b"Connection: close\r\n"),
            b"GET /p HTTP/1.0\r\n\r\n",
        ):
            s = Server(auto=True)
            s.feed(request)
            ((_, headers, _),) = responses(s.output())
            self.assertEqual(headers[b"connection"], b"close")
            self.assertTrue(s.transport.disconnecting)

    def test_http10_keep_alive(self) -> None:
        """
        An HTTP/1.0 client asking for keep-alive gets it when the response
        has a length.
        """
        s = Server(auto=True)
        s.feed(b"GET /p HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
        ((_, headers, _),) = responses(s.output())
        self.assertEqual(headers[b"connection"], b"keep-alive")
        self.assertFalse(s.transport.disconnecting)


class ResponseTests(SynchronousTestCase):
    def test_chunked_response(self) -> None:
        """
        A response without a length is chunked, each write a chunk, as it
        is written; the last chunk marks its end.
        """
        s = Server()
        s.feed(post(b"/p", b"x"))
        r = s.requests[0]
        r.start_response(200, [(b"content-type", b"text/event-stream")])
        head = s.output()
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"), head)
        self.assertIn(b"Transfer-Encoding: chunked\r\n", head)
        self.assertIn(b"content-type: text/event-stream\r\n", head)
        self.assertIn(b"Date: ", head)
        r.write(b"data: 1\n\n")
        self.assertEqual(s.output(), b"9\r\ndata: 1\n\n\r\n")
        r.finish()
        self.assertEqual(s.output(), b"0\r\n\r\n")
        self.assertFalse(s.transport.disconnecting)

    def test_held_head_goes_with_the_first_bytes(self) -> None:
        """
        A head started with C{hold} is not sent until the body's first
        bytes, and then goes with them in one write; L{flush} sends it
        alone, and L{finish} or L{abort} send it when nothing was written.
        """
        s = Server()
        writes: list[bytes] = []
        s.proto.send = writes.append
        s.feed(post(b"/p", b"x") + post(b"/p", b"y") + post(b"/p", b"z"))
        r = s.requests[0]
        r.start_response(200, [(b"content-type", b"text/event-stream")], hold=True)
        self.assertEqual(writes, [])
        r.write(b"data: 1\n\n")
        (first,) = writes
        self.assertTrue(first.startswith(b"HTTP/1.1 200 OK\r\n"), first)
        self.assertTrue(first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n"), first)
        r.write(b"data: 2\n\n")
        self.assertEqual(writes[1], b"9\r\ndata: 2\n\n\r\n")
        r.finish()
        self.assertEqual(writes[2], b"0\r\n\r\n")

        del writes[:]
        r = s.requests[1]
        r.start_response(200, [], hold=True)
        r.flush()
        self.assertEqual(len(writes), 1)
        self.assertTrue(writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n"))
        r.write(b"")
        self.assertEqual(len(writes), 1)
        r.finish()

        del writes[:]
        r = s.requests[2]
        r.start_response(404, [], 0, hold=True)
        r.finish()
        (only,) = writes
        self.assertTrue(only.startswith(b"HTTP/1.1 404 Not Found\r\n") and only.endswith(b"\r\n\r\n"), only)

    def test_held_head_sent_on_abort(self) -> None:
        """
        An aborted response whose head was held still sends the head
        before the connection closes.
        """
        s = Server()
        s.feed(post(b"/p", b"x"))
        r = s.requests[0]
        r.start_response(200, [], hold=True)
        r.abort()
        self.assertTrue(s.output().startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertTrue(s.transport.disconnecting)

    def test_http10_response_until_close(self) -> None:
        """
        To an HTTP/1.0 client a response without a length is ended by
        closing the connection.
        """
        s = Server()
        s.feed(b"POST /p HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx")
        r = s.requests[0]
        r.start_response(200, [])
        r.write(b"abc")
        r.finish()
        out = s.output()
        self.assertNotIn(b"chunked", out)
        self.assertTrue(out.endswith(b"\r\n\r\nabc"))
        self.assertTrue(s.transport.disconnecting)

    def test_head_has_no_body(self) -> None:
        """
        The answer to HEAD has the headers (its length included) but no
        body.
        """
        s = Server(auto=True)
        s.feed(b"HEAD /p HTTP/1.1\r\nHost: gw\r\n\r\n")
        out = s.output()
        self.assertTrue(out.endswith(b"Content-Length: 2\r\n" + s.factory.date_line() + b"\r\n"), out)

    def test_reason_phrase(self) -> None:
        """
        The status line carries the given reason, or the standard one.
        """
        s = Server()
        s.feed(post(b"/p", b"x") + post(b"/p", b"y"))
        s.requests[0].start_response(404, [], 0)
        s.requests[0].finish()
        s.requests[1].start_response(599, [], 0, b"Odd")
        s.requests[1].finish()
        out = s.output()
        self.assertIn(b"HTTP/1.1 404 Not Found\r\n", out)
        self.assertIn(b"HTTP/1.1 599 Odd\r\n", out)

    def test_abort(self) -> None:
        """
        An aborted response sends what was written, without the last
        chunk, and closes the connection.
        """
        s = Server()
        s.feed(post(b"/p", b"x"))
        r = s.requests[0]
        r.start_response(200, [])
        r.write(b"part")
        r.abort()
        out = s.output()
        self.assertTrue(out.endswith(b"4\r\npart\r\n"))
        self.assertTrue(s.transport.disconnecting)

    def test_handler_failure_is_500(self) -> None:
        """
        A handler that raises gets the client a 500 in OpenAI's error shape,
        and the failure is logged.
        """
        s = Server()

        def broken(request: FrontRequest) -> None:
            raise RuntimeError("boom")

        s.factory.handle = broken
        s.feed(post(b"/p", b"x"))
        ((status, _, body),) = responses(s.output())
        self.assertEqual(status, 500)
        self.assertEqual(json.loads(body)["error"]["code"], "internal_error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class LimitTests(SynchronousTestCase):
    def test_declared_length_over_limit(self) -> None:
        """
        A Content-Length over the limit goes to the handler as soon as the
        head is read, marked C{too_large} and with no body: the body is
        never read, and the connection closes after the answer.
        """
        s = Server()
        s.feed(b"POST /1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 1500\r\n\r\n")
        (r1,) = s.requests
        self.assertEqual((r1.too_large, r1.body, r1.keep_alive), (True, b"", False))
        answer(r1, b"no", 413)
        ((status, headers, body),) = responses(s.output())
        self.assertEqual((status, headers[b"connection"], body), (413, b"close", b"no"))
        self.assertTrue(s.transport.disconnecting)
        s.feed(b"y" * 1500 + post(b"/2", b"small"))
        self.assertEqual(len(s.requests), 1)

    def test_huge_content_length(self) -> None:
        """
        A Content-Length of 19 digits or more is over any limit (it is not
        wrapped into a smaller number), and leading zeros do not count.
        """
        for value, too_large in ((b"1" + b"0" * 20, True), (b"9" * 19, True),
                                 (b"0" * 30 + b"5", False)):
            s = Server()
            s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: %s\r\n\r\nhello" % value)
            (r,) = s.requests
            self.assertEqual(r.too_large, too_large, value)
            self.assertEqual(r.body, b"" if too_large else b"hello")

    def test_chunked_over_limit(self) -> None:
        """
        A chunked body goes to the handler, C{too_large} and empty, as soon
        as what arrived of it passes the limit; the rest is not read and
        the connection closes after the answer.
        """
        s = Server()
        s.feed(b"POST /2 HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
        s.feed(b"%x\r\n%s\r\n" % (600, b"y" * 600))
        self.assertEqual(s.requests, [])
        s.feed(b"%x\r\n%s\r\n" % (600, b"y" * 600))
        (r,) = s.requests
        self.assertEqual((r.path, r.too_large, r.body, r.keep_alive), (b"/2", True, b"", False))
        answer(r, b"no", 413)
        self.assertTrue(s.transport.disconnecting)

    def test_refused_body_drained_after_half_close(self) -> None:
        """
        After a 413 for a body not read, a transport that can half-close
        closes only its sending side, so that the client still sending
        reads its answer rather than a reset; what arrives next is dropped,
        and past L{DRAIN_MAX} bytes the connection is aborted.
        """
        s = Server()
        s.transport = HalfCloseTransport()
        s.proto = s.factory.buildProtocol(None)
        s.proto.makeConnection(s.transport)
        s.feed(b"POST /1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 9999999\r\n\r\n" + b"y" * 100)
        answer(s.requests[0], b"no", 413)
        self.assertEqual((s.transport.write_closed, s.transport.disconnecting), (True, False))
        s.feed(b"y" * (DRAIN_MAX // 2))
        self.assertFalse(s.transport.aborted)
        s.feed(b"y" * (DRAIN_MAX // 2 + 1))
        self.assertTrue(s.transport.aborted)
        self.assertEqual(len(s.requests), 1)

    def test_expect_continue(self) -> None:
        """
        C{Expect: 100-continue} gets the go-ahead for a body within the
        limit; for one over it, the handler is asked at once (to refuse it)
        and the connection closes after the answer, the body never read.
        """
        s = Server()
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
        self.assertEqual(s.output(), b"HTTP/1.1 100 Continue\r\n\r\n")
        s.feed(b"abc")
        self.assertEqual(s.requests[0].body, b"abc")
        answer(s.requests[0], b"ok")
        s.output()
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        r = s.requests[1]
        self.assertTrue(r.too_large)
        self.assertEqual(s.output(), b"")
        answer(r, b"too big", 413)
        out = s.output()
        self.assertTrue(out.startswith(b"HTTP/1.1 413 "))
        self.assertIn(b"Connection: close\r\n", out)
        self.assertTrue(s.transport.disconnecting)

    def test_bad_input(self) -> None:
        """
        Malformed requests get an OpenAI-shaped error with a fitting status,
        logged with who sent it, and their connection is closed; the handler
        never sees them.
        """
        cases = [
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
            (b"GET / HTTP/2.0\r\n\r\n", 505),
            (b"GET / FTP/1.0\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\nNoColon\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\nName : v\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\n folded: v\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\nA: b\nInjected: c\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\nA: b\rc\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx", 400),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: gw\r\n" + b"A: b\r\n" * (MAX_HEADERS + 1) + b"\r\n", 431),
            (b"GET / HTTP/1.1\r\nHost: gw\r\nA: " + b"b" * MAX_HEAD, 431),
        ]
        events: list[dict[str, Any]] = []
        observer: Any = events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        for data, status in cases:
            s = Server()
            s.feed(data)
            out = s.output()
            ((got, headers, body),) = responses(out)
            self.assertEqual(got, status, data[:60])
            self.assertEqual(headers[b"content-type"], b"application/json")
            self.assertTrue(json.loads(body)["error"]["message"])
            self.assertTrue(s.transport.disconnecting, data[:60])
            self.assertEqual(s.requests, [])
            # Nothing more is read from a refused connection.
            s.feed(post(b"/p", b"x"))
            self.assertEqual(s.requests, [])
        refusals = [e for e in events if e.get("log_format", "").startswith("refused a request from")]
        self.assertEqual(len(refusals), len(cases))
        self.assertEqual(refusals[0]["peer"], "192.168.1.1:54321")

    def test_chunked_framing_refused(self) -> None:
        """
        Malformed chunked framing is refused with the decoder's reason: a
        bad size, a size line over its bound or data without its CRLF get a
        400, a trailer line over its bound a 431; the connection closes and
        the handler never sees the request.
        """
        start = b"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
        cases = [
            (b"0x5\r\nhello\r\n0\r\n\r\n", 400, "bad_request", "Bad chunk size b'0x5'"),
            (b"5;" + b"e" * 1100 + b"\r\nhello\r\n0\r\n\r\n", 400, "bad_request", "chunk-size line is too long"),
            (b"5\r\nhello!\r\n0\r\n\r\n", 400, "bad_request", "not followed by CRLF"),
            (b"0\r\nX: " + b"t" * MAX_HEAD + b"\r\n\r\n", 431, "head_too_large", "trailer is too long"),
        ]
        for data, status, code, message in cases:
            for bytewise in (False, True):
                s = Server()
                s.feed(start + data, bytewise)
                ((got, _, body),) = responses(s.output())
                error = json.loads(body)["error"]
                self.assertEqual((got, error["code"]), (status, code), data[:30])
                self.assertIn(message, error["message"])
                self.assertTrue(s.transport.disconnecting)
                self.assertEqual(s.requests, [])

    def test_read_ahead_bounded(self) -> None:
        """
        While a response is in progress the connection reads ahead at most
        about L{READ_AHEAD} bytes of the next requests, then stops reading
        until the response is done.
        """
        s = Server()
        s.feed(post(b"/1", b"x"))
        s.feed(post(b"/2", b"y" * 500))
        self.assertEqual(s.transport.producerState, "producing")
        s.feed(post(b"/3", b"z" * READ_AHEAD))
        self.assertEqual(s.transport.producerState, "paused")
        answer(s.requests[0], b"one")
        # /2 is in progress now, and /3 still more than the read-ahead.
        self.assertEqual([r.path for r in s.requests], [b"/1", b"/2"])
        self.assertEqual(s.transport.producerState, "paused")
        answer(s.requests[1], b"two")
        self.assertEqual(s.transport.producerState, "producing")
        self.assertEqual([r.path for r in s.requests], [b"/1", b"/2", b"/3"])


class HardeningTests(SynchronousTestCase):
    """
    What an attacker's raw socket found (in the security review of the
    front): each refused with the status that says why, before the
    handler sees anything.
    """

    def refused(self, data: bytes, bytewise: bool = False) -> tuple[int, bytes, str]:
        s = Server()
        s.feed(data, bytewise)
        out = s.output()
        ((status, headers, body),) = responses(out)
        self.assertEqual(headers[b"connection"], b"close")
        self.assertTrue(s.transport.disconnecting)
        self.assertEqual(s.requests, [])
        return status, out, json.loads(body)["error"]["message"]

    def test_header_names_are_tokens(self) -> None:
        """
        A header name with a byte outside tchar (a vertical tab after
        Transfer-Encoding, a space inside the name, a non-ASCII byte) is a
        400, and so is a method that is not a token.
        """
        for line in (b"Transfer-Encoding\x0b: chunked", b"X Y: z", b"X\x80: z", b"X(: y", b"@: y"):
            status, _, message = self.refused(b"GET / HTTP/1.1\r\nHost: gw\r\n" + line + b"\r\n\r\n")
            self.assertEqual(status, 400, line)
            self.assertIn("control character" if b"\x0b" in line else "token", message)
        status, _, _ = self.refused(b"G(T / HTTP/1.1\r\nHost: gw\r\n\r\n")
        self.assertEqual(status, 400)

    def test_control_bytes_in_values(self) -> None:
        """
        A control byte (NUL, DEL, ESC, vertical tab) in a header value or
        the request target is a 400; a tab inside a value is allowed, and
        so is obs-text (bytes over 0x7f).
        """
        for value in (b"a\x00b", b"a\x7fb", b"a\x1bb", b"a\x0bb"):
            status, _, message = self.refused(b"GET / HTTP/1.1\r\nHost: gw\r\nX: " + value + b"\r\n\r\n")
            self.assertEqual(status, 400, value)
            self.assertIn("control character", message)
        status, _, _ = self.refused(b"GET /a\x01b HTTP/1.1\r\nHost: gw\r\n\r\n")
        self.assertEqual(status, 400)
        s = Server()
        s.feed(b"GET / HTTP/1.1\r\nHost: gw\r\nX: a\tb \xe9\r\n\r\n")
        (r,) = s.requests
        self.assertEqual(r.header(b"x"), b"a\tb \xe9")

    def test_host_exactly_once(self) -> None:
        """
        HTTP/1.1 needs exactly one Host header: none, or two, is a 400.
        HTTP/1.0 may have none, not two.
        """
        for data in (b"GET / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                     b"GET / HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n"):
            status, _, message = self.refused(data)
            self.assertEqual(status, 400, data)
            self.assertIn("Host", message)
        s = Server()
        s.feed(b"GET / HTTP/1.0\r\n\r\n")
        self.assertEqual(len(s.requests), 1)

    def test_http10_chunked_closes(self) -> None:
        """
        An HTTP/1.0 request with Transfer-Encoding: chunked is read, but
        its connection closes after the response (RFC 9112 §6.1), even
        when it asks for keep-alive.
        """
        s = Server()
        s.feed(b"POST /p HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"2\r\nhi\r\n0\r\n\r\n" + post(b"/next", b"x"))
        (r,) = s.requests
        self.assertEqual((r.body, r.keep_alive), (b"hi", False))
        answer(r, b"ok")
        self.assertIn(b"Connection: close\r\n", s.output())
        self.assertTrue(s.transport.disconnecting)
        self.assertEqual(len(s.requests), 1)

    def test_bare_lf_refused_promptly(self) -> None:
        """
        A head whose lines end in a bare LF (it would never complete) is
        refused with a 400 as soon as the LF arrives, whole or a byte at a
        time, not after the head timeout; so is a bare CR.
        """
        for data in (b"GET / HTTP/1.1\nHost: gw\n\n", b"GET / HTTP/1.1\r\nHost: gw\n",
                     b"GET / HTTP/1.1\rHost: gw"):
            for bytewise in (False, True):
                status, _, message = self.refused(data, bytewise)
                self.assertEqual(status, 400, data)
                self.assertIn("bare", message)

    def test_431_reason_phrase(self) -> None:
        """
        A 431 says "Request Header Fields Too Large" on its status line.
        """
        status, out, _ = self.refused(b"GET / HTTP/1.1\r\nHost: gw\r\nA: " + b"b" * MAX_HEAD)
        self.assertEqual(status, 431)
        self.assertTrue(out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), out[:60])

    def test_refusal_quotes_a_bounded_prefix(self) -> None:
        """
        A refusal quotes at most a short prefix of the client's bytes.
        """
        status, _, message = self.refused(b"GET / HTTP/1.1\r\nHost: gw\r\nX" + b"y" * 20000 + b"\r\n\r\n")
        self.assertEqual(status, 400)
        self.assertLess(len(message), 300)

    def head_cpu(self, size: int, bytewise: bool) -> float:
        """
        The least CPU time, over three tries, that a front spends reading
        a head of C{size} bytes.
        """
        data = b"GET / HTTP/1.1\r\nHost: gw\r\nX: " + b"a" * size + b"\r\n\r\n"
        best = float("inf")
        for _ in range(3):
            s = Server()
            started = time.process_time()
            s.feed(data, bytewise)
            best = min(best, time.process_time() - started)
            self.assertEqual(len(s.requests), 1)
        return best

    def test_head_parse_is_linear(self) -> None:
        """
        A head that arrives a byte per read costs time linear in its size:
        a 60 KiB head costs no more than about four times a 15 KiB one (a
        search from the start on every read makes it sixteen times).
        Measured as CPU time with a generous bound (8x); the 60 KiB head
        a byte at a time also stays within a fixed budget.
        """
        small = self.head_cpu(15 * 1024, True)
        large = self.head_cpu(60 * 1024, True)
        self.assertLess(large, 8 * small + 0.01, (small, large))
        self.assertLess(large, 1.0)


class CapTests(SynchronousTestCase):
    def test_connection_cap(self) -> None:
        """
        Past C{max_connections} open client connections a new one gets no
        protocol (closed at accept, counted); when one closes, another is
        accepted.
        """
        factory = FrontFactory(lambda r: None, Clock(), max_connections=2)
        protos = [factory.buildProtocol(None) for _ in range(2)]
        for p in protos:
            p.makeConnection(StringTransport())
        self.assertIsNone(factory.buildProtocol(None))
        self.assertEqual((factory.connections, factory.refused_connections), (2, 1))
        protos[0].connectionLost(Failure(ConnectionError("gone")))
        self.assertIsNotNone(factory.buildProtocol(None))
        self.flushLoggedErrors()

    def test_no_cap(self) -> None:
        """
        C{max_connections=0} means no cap.
        """
        factory = FrontFactory(lambda r: None, Clock(), max_connections=0)
        for _ in range(5):
            self.assertIsNotNone(factory.buildProtocol(None))

    def test_open_file_limit_raised(self) -> None:
        """
        Starting the factory raises the soft open-file limit towards what
        the cap needs (two files per connection and headroom), within the
        hard limit.
        """
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        if hard != resource.RLIM_INFINITY and hard < 600:
            raise SkipTest("the hard open-file limit is too low to test raising the soft one")
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        factory = FrontFactory(lambda r: None, Clock(), max_connections=100)
        factory.doStart()
        self.addCleanup(factory.doStop)
        self.assertGreaterEqual(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 2 * 100 + 1024
                                if hard == resource.RLIM_INFINITY or hard >= 1224 else hard)


class FlowTests(SynchronousTestCase):
    def test_backpressure(self) -> None:
        """
        While the client's connection has too much unsent the response's
        producer is paused (at once, if it comes while so), and resumed
        when the connection drains.
        """
        s = Server()
        s.feed(post(b"/p", b"x"))
        r = s.requests[0]
        p = Producer()
        r.set_producer(p)
        self.assertIs(s.transport.producer, s.proto)
        s.proto.pauseProducing()
        self.assertTrue(p.paused)
        s.proto.resumeProducing()
        self.assertFalse(p.paused)
        s.proto.pauseProducing()
        r.clear_producer()
        late = Producer()
        r.set_producer(late)
        self.assertTrue(late.paused)

    def test_client_gone(self) -> None:
        """
        A connection lost in the middle of a response tells the request's
        C{on_lost}; one lost after the response does not.
        """
        s = Server()
        s.feed(post(b"/1", b"x"))
        lost: list[Failure] = []
        s.requests[0].on_lost = lost.append
        s.proto.connectionLost(Failure(ConnectionError("gone")))
        self.assertEqual(len(lost), 1)
        self.assertTrue(s.requests[0].finished)

        s = Server()
        s.feed(post(b"/1", b"x"))
        s.requests[0].on_lost = lost.append
        answer(s.requests[0], b"ok")
        s.proto.connectionLost(Failure(ConnectionError("gone")))
        self.assertEqual(len(lost), 1)


GET = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"


class FullTransport(HalfCloseTransport):
    """
    A transport whose buffer passes its high-water mark at C{mark} bytes
    written, as a TCP transport's does when its client reads nothing: it
    pauses its producer then, and resumes it on L{drain}.
    """

    def __init__(self, mark: int) -> None:
        super().__init__()
        self.mark = mark

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.value()) > self.mark and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> None:
        self.clear()
        self.producer.resumeProducing()


def turn(clock: Clock) -> None:
    """
    One reactor turn's timed calls: those due now, not those they make.
    """
    for call in [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]:
        clock.calls.remove(call)
        call.func(*call.args, **call.kw)


class OutputWaitTests(SynchronousTestCase):
    """
    A connection whose answers wait to be written neither reads nor parses.
    """

    def test_nothing_parsed_while_paused(self) -> None:
        """
        While the transport has paused the connection (its buffer full),
        pipelined requests that arrive are kept, not parsed or answered, and
        the socket is not read; when the transport drains they are answered
        on a later turn, and reading resumes.
        """
        s = Server(auto=True)
        s.proto.pauseProducing()
        self.assertEqual(s.transport.producerState, "paused")
        s.feed(GET * 10)
        self.assertEqual(s.requests, [])
        s.proto.resumeProducing()
        self.assertEqual(s.requests, [])
        s.clock.advance(0)
        self.assertEqual(len(s.requests), 10)
        self.assertEqual(len(responses(s.output())), 10)
        self.assertEqual(s.transport.producerState, "producing")

    def test_pass_output_bounded(self) -> None:
        """
        One read of many pipelined requests answered at once is answered
        only until about L{PASS_OUTPUT} bytes are written; the rest waits
        for a later turn, and reading stops meanwhile. Paused by the
        transport in between, the connection goes on only when it drains.
        """
        s = Server(auto=True)
        body = b"m" * 10_000
        s.handle = lambda r: (s.requests.append(r), answer(r, body))  # type: ignore[method-assign]
        s.factory.handle = s.handle
        s.feed(GET * 100)
        first = len(s.requests)
        self.assertLessEqual(first * 10_000, PASS_OUTPUT + 10_000)
        self.assertGreater(first, 1)
        self.assertEqual(s.transport.producerState, "paused")
        turn(s.clock)
        second = len(s.requests)
        self.assertEqual(second, 2 * first)
        s.proto.pauseProducing()
        turn(s.clock)
        self.assertEqual(len(s.requests), second)
        s.proto.resumeProducing()
        for _ in range(10):
            s.clock.advance(0)
        self.assertEqual(len(s.requests), 100)
        self.assertEqual([b for _, _, b in responses(s.output())], [body] * 100)
        self.assertEqual(s.transport.producerState, "producing")

    def test_paused_mid_pass(self) -> None:
        """
        When the transport pauses the connection in the middle of a pass
        (an answer filled its buffer), no further request is parsed until
        it drains.
        """
        s = Server(auto=True, transport=FullTransport(1000))
        s.feed(GET * 100)
        n = len(s.requests)
        self.assertLessEqual(n, 11)
        s.clock.advance(0)
        self.assertEqual(len(s.requests), n)
        self.assertEqual(s.transport.producerState, "paused")
        s.feed(GET * 100)
        self.assertEqual(len(s.requests), n)
        while len(s.requests) < 200:
            s.transport.drain()
            s.clock.advance(0)
        self.assertEqual(len(s.requests), 200)

    def test_handled_request_ends_while_paused(self) -> None:
        """
        A request answered later (proxied) whose answer ends while the
        transport has paused the connection: the next pipelined request is
        not dispatched until the transport drains.
        """
        s = Server()
        s.feed(GET + GET)
        s.proto.pauseProducing()
        answer(s.requests[0], b"one")
        self.assertEqual(len(s.requests), 1)
        self.assertEqual(s.transport.producerState, "paused")
        s.proto.resumeProducing()
        s.clock.advance(0)
        self.assertEqual(len(s.requests), 2)

    def test_client_that_never_reads_is_aborted(self) -> None:
        """
        A connection stalled with requests buffered whose output does not
        drain within C{send_timeout} is aborted; one that drains in time
        goes on.
        """
        s = Server(auto=True, transport=FullTransport(1000))
        s.feed(GET * 100)
        s.clock.advance(SEND_TIMEOUT - 1)
        self.assertFalse(s.transport.aborted)
        s.clock.advance(1)
        self.assertTrue(s.transport.aborted)
        s.proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(s.clock.getDelayedCalls(), [])

        s = Server(auto=True, transport=FullTransport(1000), send_timeout=5)
        s.feed(GET * 100)
        for _ in range(3):
            s.clock.advance(4)
            s.transport.drain()
            s.clock.advance(0)
        self.assertFalse(s.transport.aborted)
        s.clock.advance(5)
        self.assertTrue(s.transport.aborted)


class TimeoutTests(SynchronousTestCase):
    """
    Slow and idle clients, on the front's one timer per connection.
    """

    def assertOnlyLinger(self, clock: Clock, proto: Any) -> None:
        """
        After the front closed a connection, its one timer is the linger
        that aborts a client that never reads; it goes with the connection.
        """
        [call] = clock.getDelayedCalls()
        self.assertEqual(call.getTime() - clock.seconds(), 30.0)
        proto.connectionLost(Failure(ConnectionError("closed")))
        self.assertEqual(clock.getDelayedCalls(), [])

    def assertClosedQuietly(self, s: Server) -> None:
        self.assertTrue(s.transport.disconnecting)
        self.assertEqual(s.output(), b"")
        self.assertOnlyLinger(s.clock, s.proto)

    def assertTimedOut408(self, s: Server, words: str) -> None:
        self.assertTrue(s.transport.disconnecting)
        ((status, headers, body),) = responses(s.output())
        self.assertEqual(status, 408)
        self.assertEqual(headers[b"connection"], b"close")
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "request_timeout")
        self.assertIn(words, error["message"])
        self.assertOnlyLinger(s.clock, s.proto)

    def test_defaults(self) -> None:
        """
        By default a head has 10 s, a whole request 30 s, a stalled body
        60 s and an idle kept-alive connection 120 s.
        """
        factory = FrontFactory(lambda r: None, Clock())
        self.assertEqual(
            (factory.head_timeout, factory.request_timeout, factory.body_timeout, factory.keep_alive_timeout),
            (10.0, 30.0, 60.0, 120.0),
        )

    def test_head_timeout(self) -> None:
        """
        A request head still incomplete C{head_timeout} seconds after the
        connection started gets a 408 in OpenAI's shape, and the
        connection closes; a byte now and then does not extend it.
        """
        s = Server()
        s.feed(b"POST /v1/chat/completions HTTP/1.1\r\n")
        for _ in range(9):
            s.clock.advance(1)
            s.feed(b"X")
        s.clock.advance(0.9)
        self.assertFalse(s.transport.disconnecting)
        self.assertEqual(s.output(), b"")
        s.clock.advance(0.1)
        self.assertTimedOut408(s, "not complete within 10 s")
        self.assertEqual(s.requests, [])

    def test_head_timeout_from_first_byte(self) -> None:
        """
        On a kept-alive connection the head's time runs from the first
        byte of that request, even when the idle wait would end later.
        """
        s = Server()
        s.feed(post(b"/1", b"x"))
        answer(s.requests[0], b"ok")
        s.output()
        s.clock.advance(50)
        s.feed(b"POST /2 HT")
        s.clock.advance(9.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertTimedOut408(s, "not complete within 10 s")

    def test_nothing_sent(self) -> None:
        """
        A connection that sends no request (or only the empty lines
        allowed before one) within the head's time is closed without an
        answer.
        """
        s = Server()
        s.clock.advance(9.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertClosedQuietly(s)

        s = Server()
        for _ in range(10):
            s.feed(b"\r\n")
            s.clock.advance(1)
        self.assertClosedQuietly(s)

    def test_keep_alive_timeout(self) -> None:
        """
        A kept-alive connection with no request for C{keep_alive_timeout}
        seconds after its last response is closed without an answer; a
        request meanwhile starts the wait again after its response.
        """
        s = Server(auto=True)
        s.feed(post(b"/1", b"x"))
        s.output()
        s.clock.advance(100)
        s.feed(post(b"/2", b"x"))
        s.output()
        s.clock.advance(119.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertClosedQuietly(s)

    def test_body_timeout(self) -> None:
        """
        A body that keeps arriving may take longer than C{body_timeout} in
        all (within the whole request's time); one that stalls for
        C{body_timeout} seconds gets a 408 and the connection closes,
        Content-Length framed or chunked.
        """
        s = Server(request_timeout=1000)
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 10\r\n\r\n")
        for _ in range(5):
            s.clock.advance(59)
            s.feed(b"x")
        s.clock.advance(59.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertTimedOut408(s, "nothing arrived for 60 s")
        self.assertEqual(s.requests, [])

        s = Server(request_timeout=1000)
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
        s.clock.advance(59)
        s.feed(b"cde\r\n")
        s.clock.advance(59)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(1)
        self.assertTimedOut408(s, "nothing arrived for 60 s")

    def test_request_timeout_despite_trickle(self) -> None:
        """
        A request whose bytes keep trickling in (a byte every 5 s, never a
        stall) gets a 408 once C{request_timeout} (30 s by default) has
        passed since its first byte, head or body, and its handler never
        sees it; the head alone is due within 10 s whatever the body's
        time.
        """
        s = Server()
        s.clock.advance(3)
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n")
        for _ in range(5):
            s.clock.advance(5)
            s.feed(b"x")
        # 28 s since the connection (the request's start) by now.
        s.clock.advance(1.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertTimedOut408(s, "not complete within 30 s")
        self.assertEqual(s.requests, [])

        s = Server(auto=True, request_timeout=20)
        s.feed(post(b"/1", b"x"))
        s.output()
        s.clock.advance(50)
        # The next request's time starts at its first byte.
        s.feed(b"POST /2 HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(19):
            s.clock.advance(1)
            s.feed(b"1\r\nx\r\n")
        s.clock.advance(0.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertTimedOut408(s, "not complete within 20 s")
        self.assertEqual(len(s.requests), 1)

    def test_configured(self) -> None:
        """
        The three timeouts are the factory's to set.
        """
        clock = Clock()
        factory = FrontFactory(lambda r: None, clock, head_timeout=2, body_timeout=3, keep_alive_timeout=5)
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\nx")
        clock.advance(2.9)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertIn(b"nothing arrived for 3 s", transport.value())
        self.assertOnlyLinger(clock, proto)

    def test_not_while_handled_or_streaming(self) -> None:
        """
        No timeout runs while a request is with its handler: not while it
        waits (for a replica), nor while its response streams for longer
        than every timeout, nor for a pipelined request read ahead
        meanwhile. The idle wait starts when the response ends.
        """
        s = Server()
        s.feed(post(b"/1", b"x") + b"POST /2 HTTP/1.1\r\n")
        (r,) = s.requests
        s.clock.advance(1000)
        self.assertFalse(s.transport.disconnecting)
        r.start_response(200, [(b"Content-Type", b"text/event-stream")])
        for i in range(10):
            s.clock.advance(500)
            r.write(b"data: %d\n\n" % i)
        self.assertFalse(s.transport.disconnecting)
        self.assertEqual(s.clock.getDelayedCalls(), [])
        r.finish()
        out = s.output()
        self.assertIn(b"data: 9\n\n", out)
        self.assertNotIn(b"408", out)
        # The read-ahead head of /2 now has its 10 s.
        s.clock.advance(10)
        self.assertTimedOut408(s, "not complete within 10 s")

        s = Server()
        s.feed(post(b"/1", b"x"))
        s.clock.advance(5000)
        answer(s.requests[0], b"ok")
        s.output()
        s.clock.advance(119.9)
        self.assertFalse(s.transport.disconnecting)
        s.clock.advance(0.1)
        self.assertClosedQuietly(s)

    def test_cancelled_on_close(self) -> None:
        """
        The timer goes with the connection: when it is lost (in a head, a
        body, the idle wait or a response), closed after a response, or
        refused for bad input.
        """
        for data in [b"", b"POST /p HT", b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 9\r\n\r\nab", post(b"/1", b"x")]:
            s = Server()
            s.feed(data)
            s.proto.connectionLost(Failure(ConnectionError("gone")))
            self.assertEqual(s.clock.getDelayedCalls(), [], data)

        s = Server(auto=True)
        s.feed(post(b"/1", b"x"))
        s.proto.connectionLost(Failure(ConnectionError("gone")))
        self.assertEqual(s.clock.getDelayedCalls(), [])

        s = Server(auto=True)
        s.feed(post(b"/1", b"x", b"Connection: close\r\n"))
        self.assertTrue(s.transport.disconnecting)
        self.assertOnlyLinger(s.clock, s.proto)

        s = Server()
        s.feed(b"BAD\r\n\r\n")
        self.assertTrue(s.transport.disconnecting)
        self.assertOnlyLinger(s.clock, s.proto)

    def test_linger_aborts_a_client_that_never_reads(self) -> None:
        """
        A closed connection whose client never reads what is left is
        aborted 30 s later.
        """
        s = Server()
        s.feed(b"BAD\r\n\r\n")
        aborted: list[bool] = []
        s.transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
        s.clock.advance(29.9)
        self.assertEqual(aborted, [])
        s.clock.advance(0.1)
        self.assertEqual(aborted, [True])

    def test_one_timer_no_churn(self) -> None:
        """
        A connection holds at most one timer, and a kept-alive connection
        serving many requests (each in one read, or a body a byte at a
        time) makes no new timer per request or per byte: a later deadline
        is only noted, and the timer, coming due before it, is made again
        for the rest (once per timeout, not per request).
        """
        s = Server(auto=True)
        made: list[Any] = []
        call_later = s.clock.callLater

        def counting(*a: Any, **kw: Any) -> Any:
            made.append(a)
            return call_later(*a, **kw)

        s.clock.callLater = counting  # type: ignore[method-assign]
        for i in range(100):
            s.feed(post(b"/%d" % i, b"x"))
            s.clock.advance(1)
            self.assertEqual(len(s.clock.getDelayedCalls()), 1)
        timeout = s.factory.keep_alive_timeout
        self.assertLessEqual(len(made), 100 // timeout + 1)
        self.assertEqual(len(responses(s.output())), 100)
        # A body a byte at a time: the head's deadline is sooner than the
        # idle wait's (one new call), the body's progress only moves it.
        before = len(made)
        s.feed(post(b"/slow", b"y" * 50), bytewise=True)
        self.assertEqual(len(made), before + 1)
        self.assertEqual(len(s.clock.getDelayedCalls()), 1)


class LoopbackTests(TestCase):
    """
    The front on a real loopback socket (bounded: one connection, a few
    hundred KiB).
    """

    timeout = 10

    @inlineCallbacks
    def test_413_reaches_a_client_still_sending(self) -> Any:
        """
        A client that declares a body over the limit and goes on sending it
        reads the whole 413 (the gateway half-closes and drains, so the
        answer is not lost to a reset), and the handler never got a body.
        """
        from twisted.internet import reactor

        seen: list[FrontRequest] = []

        def handle(request: FrontRequest) -> None:
            seen.append(request)
            answer(request, b"too large", 413)

        server_gone: Deferred[None] = Deferred()

        class Factory(FrontFactory):
            def connection_ended(self) -> None:
                super().connection_ended()
                server_gone.callback(None)

        factory = Factory(handle, reactor, max_body=1000)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        done: Deferred[bytes] = Deferred()

        class Client(Protocol):
            got = b""

            def connectionMade(self) -> None:
                self.transport.write(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 10000000\r\n\r\n")
                self.transport.write(b"y" * (512 * 1024))

            def dataReceived(self, data: bytes) -> None:
                self.got += data

            def connectionLost(self, reason: Any = None) -> None:
                done.callback(self.got)

        yield ClientCreator(reactor, Client).connectTCP("127.0.0.1", port.getHost().port)
        got = yield done
        ((status, headers, body),) = responses(got)
        self.assertEqual((status, body, headers[b"connection"]), (413, b"too large", b"close"))
        (request,) = seen
        self.assertEqual((request.too_large, request.body), (True, b""))
        # The gateway's side closes once the client has closed its own.
        yield server_gone


class EndTests(SynchronousTestCase):
    def test_ended_connection_freed_at_once(self) -> None:
        """
        A client connection that has ended, with a request answered on it
        and its idle wait armed, is freed when its last reference goes: it
        leaves nothing for the cyclic garbage collector, which a gateway
        serving many short connections would otherwise keep busy (and
        pausing) with every one of them.
        """

        def run() -> None:
            # Not L{Server}: its handler, a method of its own, would hold
            # it (and the factory, and the connection) in a cycle.
            factory = FrontFactory(lambda request: answer(request, request.body), Clock(), 1000)
            proto = factory.buildProtocol(None)
            transport = StringTransport()
            proto.makeConnection(transport)
            proto.dataReceived(post(b"/v1/x", b"hello"))
            self.assertEqual(responses(transport.value())[0][2], b"hello")
            # As a socket's transport does at the end.
            transport.unregisterProducer()
            proto.connectionLost(Failure(ConnectionDone()))

        self.assertEqual(cyclic_leftovers(run, HTTPFront, FrontRequest, Deadline), 0)


class ScreenTests(SynchronousTestCase):
    """
    The factory's C{screen} sees each request's head before its body.
    """

    def test_refused_before_body(self) -> None:
        """
        A request the screen refuses goes to the handler as soon as its
        head is read, with no body and no C{100 Continue} sent; with a body
        announced the connection is not kept alive, and after the answer
        only its sending side closes (what the client still sends is read
        and dropped).
        """
        heads: list[bytes] = []

        def screen(request: FrontRequest) -> bool:
            heads.append(request.path)
            return False

        s = Server(screen=screen)
        s.transport.loseWriteConnection = lambda: setattr(s.transport, "half_closed", True)  # type: ignore[attr-defined]
        s.feed(b"POST /p HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n")
        (r,) = s.requests
        self.assertEqual((heads, r.body, r.keep_alive, r.too_large), ([b"/p"], b"", False, False))
        self.assertEqual(s.output(), b"")
        answer(r, b"no")
        self.assertNotIn(b"100 Continue", s.output())
        self.assertTrue(getattr(s.transport, "half_closed", False))
        s.feed(b"x" * 1000)
        self.assertEqual(len(s.requests), 1)

    def test_refused_without_body_kept_alive(self) -> None:
        """
        A request with no body that the screen refuses is answered and the
        connection goes on to the next request.
        """
        s = Server(auto=True, screen=lambda request: request.path != b"/no")
        s.feed(b"GET /no HTTP/1.1\r\nHost: gw\r\n\r\n" + post(b"/yes", b"body"))
        self.assertEqual([r.body for r in s.requests], [b"", b"body"])
        self.assertFalse(s.transport.disconnecting)

    def test_allowed_reads_body(self) -> None:
        """
        A request the screen lets through is read whole before its handler
        sees it.
        """
        s = Server(screen=lambda request: True)
        s.feed(post(b"/p", b"hello"), bytewise=True)
        self.assertEqual([r.body for r in s.requests], [b"hello"])


class PerAddressTests(SynchronousTestCase):
    """
    The optional cap on client connections from one address.
    """

    def test_cap(self) -> None:
        """
        With C{max_per_address}, a connection from an address that holds
        that many already is refused at accept (no protocol), counted and
        logged with the address; other addresses are not affected, and a
        connection's end frees its place. Without it there is no cap.
        """
        clock = Clock()
        factory = FrontFactory(lambda r: None, clock, max_per_address=2)
        a = IPv4Address("TCP", "10.0.0.1", 1000)
        b = IPv4Address("TCP", "10.0.0.2", 1000)
        logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        first, second = factory.buildProtocol(a), factory.buildProtocol(a)
        for proto in (first, second):
            assert proto is not None
            proto.makeConnection(StringTransport(peerAddress=a))
        self.assertIsNone(factory.buildProtocol(a))
        self.assertEqual(factory.refused_connections, 1)
        self.assertTrue(any(e.get("peer") == "10.0.0.1" and "per-address" in e.get("log_format", "")
                            for e in logged))
        self.assertIsNotNone(factory.buildProtocol(b))
        assert first is not None
        first.connectionLost(Failure(ConnectionError("gone")))
        self.assertIsNotNone(factory.buildProtocol(a))
        self.assertIsNone(factory.buildProtocol(a))

        unlimited = FrontFactory(lambda r: None, clock)
        for _ in range(100):
            self.assertIsNotNone(unlimited.buildProtocol(a))
