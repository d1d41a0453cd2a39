"""
L{llmgw.gateway.wire.send_now}: on real loopback TCP connections, and its
burst (the bytes of a reactor turn, sent after the turn's events) on a
clock.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway.wire import _Burst, send_now
from llmgw.transportpeek import queued


class Sink(Protocol):
    """
    Keeps what arrives; fires C{got} once C{want} bytes are here.
    """

    def __init__(self, want: int):
        self.want = want
        self.data = b""
        self.got: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if len(self.data) >= self.want and not self.got.called:
            self.got.callback(self.data)


class LoopbackTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def _pair(self, want: int) -> Any:
        sink = Sink(want)
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(lambda: sink))
        self.addCleanup(port.stopListening)
        sender = yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), Protocol())
        self.addCleanup(sender.transport.abortConnection)
        return sender.transport, sink

    @inlineCallbacks
    def test_sent_on_the_socket_after_the_turn(self) -> Any:
        """
        The bytes go out once the reactor's current work is done, on the
        socket itself: the transport never queues them nor asks the
        reactor to watch for writability (a plain write would, and send
        on its next turn).
        """
        transport, sink = yield self._pair(5)
        watched = []
        transport.startWriting = lambda: watched.append(True)  # type: ignore[method-assign]
        send_now(transport)(b"hello")
        self.assertFalse(queued(transport))
        self.assertEqual((yield sink.got), b"hello")
        self.assertEqual(watched, [])

    @inlineCallbacks
    def test_several_connections_in_one_turn(self) -> Any:
        """
        Writes to several connections in one turn all go out, each
        connection's in its order.
        """
        (t1, s1), (t2, s2) = (yield self._pair(6)), (yield self._pair(6))
        w1, w2 = send_now(t1), send_now(t2)
        w1(b"abc")
        w2(b"123")
        w1(b"def")
        w2(b"456")
        self.assertEqual(((yield s1.got), (yield s2.got)), (b"abcdef", b"123456"))

    @inlineCallbacks
    def test_closed_after_the_write(self) -> Any:
        """
        A connection closed right after a write (before the turn's end)
        still sends those bytes, then closes.
        """
        transport, sink = yield self._pair(3)
        closed: Deferred[None] = Deferred()
        sink.connectionLost = lambda reason: closed.callback(None)  # type: ignore[method-assign]
        send_now(transport)(b"bye")
        transport.loseConnection()
        yield closed
        self.assertEqual(sink.data, b"bye")

    @inlineCallbacks
    def test_closed_in_the_same_turn_as_the_queue_drains(self) -> Any:
        """
        Bytes written while the transport has bytes of its own queued go
        behind them at once, not to the burst: within the same turn the
        reactor may find the socket writable, send the queue and, the
        connection closing, close it (a slow client that has just read what
        was queued), before the burst would have sent them.
        """
        from llmgw.gateway import wire

        transport, sink = yield self._pair(7)
        closed: Deferred[None] = Deferred()
        sink.connectionLost = lambda reason: closed.callback(None)  # type: ignore[method-assign]
        write = send_now(transport)
        transport.write(b"abc")  # queued: the reactor has not turned
        write(b"TAIL")
        transport.loseConnection()
        # The turn's write event for this socket, before the burst's flush.
        why = transport.doWrite()
        if why:
            reactor._disconnectSelectable(transport, why, False)  # type: ignore[attr-defined]
        wire._burst_for(reactor).flush()
        yield closed
        self.assertEqual(sink.data, b"abcTAIL")

    def test_not_bytes(self) -> Any:
        """
        Anything but bytes is refused at the call, as the transport's own
        C{write} would refuse it, not later when the burst is sent.
        """
        d = self._pair(1)

        def check(pair: Any) -> None:
            self.assertRaises(TypeError, send_now(pair[0]), "text")

        return d.addCallback(check)

    @inlineCallbacks
    def test_order_kept_behind_queued_bytes(self) -> Any:
        """
        Bytes written while others are queued go behind them, in order.
        """
        transport, sink = yield self._pair(6)
        transport.write(b"abc")
        send_now(transport)(b"def")
        self.assertEqual((yield sink.got), b"abcdef")

    @inlineCallbacks
    def test_what_the_socket_does_not_take_is_queued(self) -> Any:
        """
        More than the socket takes at once (the receiver reads nothing yet)
        all arrives, in order, with what is written after it.
        """
        big = bytes(range(256)) * 40_000  # 10 MB: past any socket buffer
        transport, sink = yield self._pair(len(big) + 3)
        queued: list[int] = []
        plain = transport.write

        def spy(data: bytes) -> None:
            queued.append(len(data))
            plain(data)

        transport.write = spy  # type: ignore[method-assign]
        write = send_now(transport)
        write(big)
        write(b"end")
        data = yield sink.got
        self.assertEqual(data, big + b"end")
        # The socket took a part; the rest, and what followed, were queued.
        self.assertEqual(len(queued), 2)
        self.assertLess(queued[0], len(big))
        self.assertEqual(queued[1], 3)


class BurstTests(SynchronousTestCase):
    def test_sent_together_after_the_turn(self) -> None:
        """
        On a reactor without C{afterEvents}, the bytes of a turn wait for a
        C{callLater(0)} (which runs before the reactor next waits), then
        all go out in the order written; one flush for the whole turn.
        """
        clock = Clock()
        burst = _Burst(clock)
        sent: list[bytes] = []
        for data in (b"a", b"b", b"c"):
            burst.add(sent.append, data)
        self.assertEqual((sent, len(clock.getDelayedCalls())), ([], 1))
        clock.advance(0)
        self.assertEqual(sent, [b"a", b"b", b"c"])
        burst.add(sent.append, b"d")
        clock.advance(0)
        self.assertEqual(sent, [b"a", b"b", b"c", b"d"])

    def test_after_events(self) -> None:
        """
        On a reactor with C{afterEvents} (llmgw's own), the flush is asked
        of it once per turn, not of a timer.
        """
        asked: list[Any] = []

        class Reactor(Clock):
            def afterEvents(self, f: Any) -> None:
                asked.append(f)

        reactor_ = Reactor()
        burst = _Burst(reactor_)
        sent: list[bytes] = []
        burst.add(sent.append, b"a")
        burst.add(sent.append, b"b")
        self.assertEqual((len(asked), reactor_.getDelayedCalls(), sent), (1, [], []))
        asked.pop()()
        self.assertEqual(sent, [b"a", b"b"])

    def test_one_failure_is_not_the_others(self) -> None:
        """
        A send that raises is logged; the rest of the burst still goes out.
        """
        clock = Clock()
        burst = _Burst(clock)
        sent: list[bytes] = []

        def broken(data: bytes) -> None:
            raise RuntimeError("this connection is broken")

        burst.add(sent.append, b"a")
        burst.add(broken, b"b")
        burst.add(sent.append, b"c")
        clock.advance(0)
        self.assertEqual(sent, [b"a", b"c"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class OtherTransportTests(SynchronousTestCase):
    def test_plain_write_for_other_transports(self) -> None:
        """
        A transport that is not a TCP socket (TLS, a test's) gets its own
        C{write}.
        """
        t = StringTransport()
        self.assertEqual(send_now(t), t.write)
        send_now(t)(b"x")
        self.assertEqual(t.value(), b"x")
