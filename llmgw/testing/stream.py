"""
Helpers for driving the agent stream in tests: frames in, frames out.
"""

from __future__ import annotations

import struct
from typing import Any

from google.protobuf.message import Message
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import StringTransport
from twisted.protocols.basic import Int32StringReceiver
from twisted.python.failure import Failure

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.wire import PROTOCOL_VERSION


def frame(msg: Message | bytes) -> bytes:
    """
    One length-prefixed frame holding C{msg}.
    """
    data = msg if isinstance(msg, bytes) else msg.SerializeToString()
    return struct.pack("!I", len(data)) + data


def parse_frames(data: bytes, message_class: Any = pb.ControlMessage) -> list[Any]:
    """
    Every complete frame in C{data}, decoded.
    """
    out = []
    while len(data) >= 4:
        (n,) = struct.unpack("!I", data[:4])
        if len(data) < 4 + n:
            break
        msg = message_class()
        msg.ParseFromString(data[4 : 4 + n])
        out.append(msg)
        data = data[4 + n :]
    return out


def register(
    node_id: str,
    gpus: int = 2,
    memory_mb: int = 81920,
    running: list[pb.RunningShard] | None = None,
    fabrics: dict[str, str] | None = None,
    version: int = PROTOCOL_VERSION,
) -> pb.AgentMessage:
    """
    A C{Register} for a node with C{gpus} identical GPUs.
    """
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=version,
            node_id=node_id,
            agent_version="test",
            gpus=[
                pb.GPU(index=i, uuid=f"GPU-{node_id}-{i}", name="Test GPU",
                       memory_total_mb=memory_mb)
                for i in range(gpus)
            ],
            fabrics=[pb.Fabric(name=k, address=v) for k, v in (fabrics or {}).items()],
            running_shards=running or [],
        )
    )


class PeerCertTransport(StringTransport):
    """
    A C{StringTransport} that answers C{getPeerCertificate} like a TLS
    transport after the handshake, and records aborts.
    """

    def __init__(self, peer_certificate: Any = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.peer_certificate = peer_certificate
        self.aborted = False

    def getPeerCertificate(self) -> Any:
        return self.peer_certificate

    def abortConnection(self) -> None:
        self.aborted = True
        self.disconnecting = True

    def frames(self) -> list[Any]:
        return parse_frames(self.value())


class RecordingAgent(Int32StringReceiver):
    """
    The smallest agent: sends what it is told, records what the control
    plane sends, and how the connection ended. Not a real agent (see
    L{llmgw.agent}); it lets tests speak the wire protocol directly.
    """

    MAX_LENGTH = 64 * 1024 * 1024

    def __init__(self) -> None:
        self.received: list[pb.ControlMessage] = []
        #: Fires with None when the connection ends; C{reason} says how.
        self.lost: Deferred[None] = Deferred()
        self.made: Deferred[RecordingAgent] = Deferred()
        self._waiters: list[tuple[int, Deferred[list[pb.ControlMessage]]]] = []
        self.reason: Failure | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        self.made.callback(self)

    def stringReceived(self, data: bytes) -> None:
        msg = pb.ControlMessage()
        msg.ParseFromString(data)
        self.received.append(msg)
        ready = [(n, d) for n, d in self._waiters if len(self.received) >= n]
        self._waiters = [(n, d) for n, d in self._waiters if len(self.received) < n]
        for _, d in ready:
            d.callback(list(self.received))

    def send(self, msg: Message) -> None:
        self.sendString(msg.SerializeToString())

    def wait_for(self, count: int) -> Deferred[list[pb.ControlMessage]]:
        """
        Fires with everything received once C{count} messages have arrived.
        """
        if len(self.received) >= count:
            return succeed(list(self.received))
        d: Deferred[list[pb.ControlMessage]] = Deferred()
        self._waiters.append((count, d))
        return d

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.reason = reason
        waiters, self._waiters = self._waiters, []
        for _, d in waiters:
            d.errback(reason)
        self.lost.callback(None)
