"""
L{llmgw.httpdeadline}: a request must arrive in time however its bytes
trickle (head within 10 s of its first byte, all of it within 30 s), and
the deadline ends once it has arrived (a long-poll is not cut).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from llmgw.httpdeadline import HEAD_TIMEOUT, REQUEST_TIMEOUT, REQUESTS_PER_TURN, DeadlineSite

PEER = IPv4Address("TCP", "192.0.2.7", 40000)


class Answer(Resource):
    """
    Answers C{ok} at once, or, under C{/hold}, keeps the request open
    (a long-poll) in C{held}.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []

    def render(self, request: Any) -> Any:
        request.content.read()
        if request.path == b"/hold":
            self.held.append(request)
            return NOT_DONE_YET
        return b"ok"


def connect(site: Any) -> tuple[Any, StringTransport]:
    proto = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    return proto, transport


class RequestDeadlineTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.resource = Answer()
        # An idle timeout longer than the test runs: only the deadline acts.
        self.site = DeadlineSite(self.resource, reactor=self.clock, timeout=600)
        self.proto, self.transport = connect(self.site)

    def trickle(self, data: bytes, every: float) -> None:
        for i in range(len(data)):
            self.proto.dataReceived(data[i:i + 1])
            self.clock.advance(every)

    def test_head_trickled_gets_408(self) -> None:
        """
        A head that trickles in a byte a second is answered 408 and the
        connection closed 10 s after its first byte, although each byte
        would have reset twisted.web's idle timeout.
        """
        self.trickle(b"GET / HTTP/1.1\r\nHost: x", 0.4)
        self.assertEqual(self.transport.value(), b"")
        self.trickle(b"\r\nX-Slow: aaaa", 1.0)
        value = self.transport.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), value)
        self.assertIn(b"head was not complete within 10 s", value)
        self.assertTrue(self.transport.disconnecting)

    def test_head_in_time(self) -> None:
        """
        A head trickled within 10 s is served.
        """
        self.trickle(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0.3)
        self.assertIn(b"200 OK", self.transport.value())
        self.assertFalse(self.transport.disconnecting)

    def test_body_trickled_gets_408(self) -> None:
        """
        A body that keeps trickling is cut 30 s after the request's first
        byte: a 408, and the connection closed; the resource never sees it.
        """
        self.proto.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        self.trickle(b"a" * 99, 1.0)
        value = self.transport.value()
        self.assertIn(b"408 Request Timeout", value)
        self.assertIn(b"not complete within 30 s", value)
        self.assertNotIn(b"200 OK", value)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.clock.seconds(), 99.0)  # trickled on, unread
        self.assertEqual(value.count(b"HTTP/1.1"), 1)

    def test_whole_request_deadline_counts_from_first_byte(self) -> None:
        """
        The whole request's 30 s count from its first byte, not from the
        end of its head.
        """
        self.trickle(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n", 0.2)
        self.clock.advance(REQUEST_TIMEOUT - self.clock.seconds() - 0.5)
        self.assertEqual(self.transport.value(), b"")
        self.clock.advance(0.5)
        self.assertIn(b"408 Request Timeout", self.transport.value())

    def test_long_poll_not_cut(self) -> None:
        """
        A request that has arrived is not timed while its resource holds
        it (a long-poll): minutes later its answer still goes out.
        """
        self.proto.dataReceived(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(300)
        self.assertEqual(self.transport.value(), b"")
        self.assertFalse(self.transport.disconnecting)
        request = self.resource.held.pop()
        request.write(b"late")
        request.finish()
        self.assertIn(b"200 OK", self.transport.value())
        self.assertFalse(self.transport.disconnecting)

    def test_next_request_timed_from_its_own_first_byte(self) -> None:
        """
        On a kept-alive connection each request gets its own deadline,
        from its first byte: an idle wait between requests does not count.
        """
        self.proto.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(100)
        self.transport.clear()
        self.proto.dataReceived(b"GET / HTTP/1.1\r\n")
        self.clock.advance(HEAD_TIMEOUT - 1)
        self.assertEqual(self.transport.value(), b"")
        self.proto.dataReceived(b"Host: x\r\n\r\n")
        self.assertIn(b"200 OK", self.transport.value())
        self.clock.advance(100)
        self.assertFalse(self.transport.disconnecting)

    def test_lost_connection_cancels(self) -> None:
        """
        A connection lost mid-request leaves no timer behind.
        """
        self.proto.dataReceived(b"GET / HTTP/1.1\r\n")
        self.proto.connectionLost(Failure(ConnectionError()))
        self.assertEqual(self.clock.getDelayedCalls(), [] if not self.site._logDateTimeCall else
                         [self.site._logDateTimeCall])

    def test_unread_answer_aborted(self) -> None:
        """
        A peer that does not let the connection close after its 408 is
        aborted (twisted.web's abort timeout, 15 s).
        """
        self.proto.dataReceived(b"GET / HTTP/1.1\r\n")
        self.clock.advance(HEAD_TIMEOUT)
        self.assertIn(b"408", self.transport.value())
        self.assertFalse(self.transport.disconnected)
        self.clock.advance(15)
        self.assertTrue(self.transport.disconnected)


class FullTransport(StringTransport):
    """
    A transport whose buffer passes its high-water mark at C{mark} bytes, as
    a TCP transport's does when its client reads nothing: it pauses its
    producer then, and resumes it on L{drain}.
    """

    def __init__(self, mark: int) -> None:
        super().__init__(peerAddress=PEER)
        self.mark = mark

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.value()) > self.mark and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> bytes:
        out = self.value()
        self.clear()
        self.producer.resumeProducing()
        return out


class OutputWaitTests(SynchronousTestCase):
    """
    A channel whose answers wait to be written reads and answers nothing
    more until they drain.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.resource = Answer()
        self.site = DeadlineSite(self.resource, reactor=self.clock, timeout=600)

    def test_pipelined_answers_a_turn_at_a_time(self) -> None:
        """
        One read of many tiny pipelined requests, the transport taking
        everything: at most REQUESTS_PER_TURN are answered, nothing more is
        read, and the rest follow on later reactor turns.
        """
        proto = self.site.buildProtocol(PEER)
        transport = FullTransport(10**9)
        proto.makeConnection(transport)
        proto.dataReceived(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n" * 100)
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), REQUESTS_PER_TURN)
        self.assertEqual(transport.producerState, "paused")
        for _ in range(10):
            self.clock.advance(0)
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 100)
        self.assertEqual(transport.producerState, "producing")

    def test_pipelined_answers_stop_while_paused(self) -> None:
        """
        One read of many small pipelined requests answered at once: once
        the transport's buffer is full, the rest are neither answered nor
        is the socket read; as it drains, they are answered in order.
        """
        proto = self.site.buildProtocol(PEER)
        transport = FullTransport(1000)
        proto.makeConnection(transport)
        proto.dataReceived(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n" * 1000)
        first = transport.value().count(b"HTTP/1.1 200")
        self.assertLess(first, 20)
        self.assertEqual(transport.producerState, "paused")
        answered = 0
        for _ in range(1000):
            answered += transport.drain().count(b"HTTP/1.1 200")
            # At most REQUESTS_PER_TURN a turn: the next turn goes on.
            self.clock.advance(0)
            answered += transport.drain().count(b"HTTP/1.1 200")
            if answered == 1000:
                break
        self.assertEqual(answered, 1000)
        self.assertEqual(transport.producerState, "producing")
        self.assertFalse(transport.disconnecting)

    def test_paused_while_handling(self) -> None:
        """
        Paused while a request is with its resource (a long-poll writing),
        the channel stops reading too, and pipelined bytes that arrive stay
        unanswered until the transport drains and the request ends.
        """
        proto, transport = connect(self.site)
        proto.dataReceived(b"GET /hold HTTP/1.1\r\nHost: a\r\n\r\n")
        (held,) = self.resource.held
        proto.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        proto.dataReceived(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n" * 3)
        held.write(b"late")
        held.finish()
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 1)
        self.assertEqual(transport.producerState, "paused")
        proto.resumeProducing()
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 4)
        self.assertEqual(transport.producerState, "producing")
