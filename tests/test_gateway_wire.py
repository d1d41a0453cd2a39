"""
L{llmgw.gateway.wire.send_now} on real loopback TCP connections.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway.wire import send_now


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
    def test_sent_before_the_reactor_turns(self) -> Any:
        """
        With nothing queued, the bytes leave at once: the transport queues
        none of them (a plain write would wait for the reactor's next turn).
        """
        transport, sink = yield self._pair(5)
        send_now(transport)(b"hello")
        self.assertEqual((transport._tempDataLen, transport.dataBuffer), (0, b""))
        self.assertEqual((yield sink.got), b"hello")

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
        write = send_now(transport)
        write(big)
        self.assertGreater(transport._tempDataLen + len(transport.dataBuffer), 0)
        write(b"end")
        data = yield sink.got
        self.assertEqual(data, big + b"end")


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
