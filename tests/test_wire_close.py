"""
Bytes written through L{llmgw.gateway.wire.send_now} from a timer, with the
connection closed right after through L{llmgw.gateway.wire.after_sent}, reach
the peer on a reactor without C{afterEvents} (twistd's default epoll
reactor, which C{llmgw control} and C{llmgw local} run on).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import protocol, reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from llmgw.gateway.wire import after_sent, send_now

ANSWER = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"


class _Server(protocol.Protocol):
    def connectionMade(self) -> None:
        write = send_now(self.transport)

        def answer() -> None:
            write(ANSWER)
            after_sent(self.transport, self.transport.loseConnection)

        reactor.callLater(0.01, answer)  # type: ignore[attr-defined]


class _Client(protocol.Protocol):
    def __init__(self, done: Deferred[bytes]):
        self.done = done
        self.got: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        self.got.append(data)

    def connectionLost(self, reason: Any = None) -> None:
        self.done.callback(b"".join(self.got))


class SendThenCloseFromATimer(TestCase):
    async def test_bytes_arrive_before_the_close(self) -> None:
        """
        An answer written from a timer and followed at once by
        C{loseConnection} reaches the client (was: a close with no byte).
        """
        factory = protocol.ServerFactory()
        factory.protocol = _Server
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        done: Deferred[bytes] = Deferred()
        client = protocol.ClientCreator(reactor, _Client, done)
        await client.connectTCP("127.0.0.1", port.getHost().port)
        self.assertEqual(await done, ANSWER)
