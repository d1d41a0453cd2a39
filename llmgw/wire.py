"""
Framing and message helpers shared by both ends of the agent stream.

Every frame is a 4-byte unsigned big-endian length and then that many bytes
of protobuf: an C{AgentMessage} from an agent, a C{ControlMessage} from the
control plane (DESIGN §3).
"""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from twisted.logger import Logger
from twisted.protocols.basic import Int32StringReceiver

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.states import ShardState

PROTOCOL_VERSION = 1

#: The largest frame either end accepts unless configured otherwise.
DEFAULT_MAX_FRAME = 4 * 1024 * 1024

# DNS-label-like: lowercase letters, digits, "-" and ".", starting and ending
# with a letter or digit, 63 characters at most (DESIGN §4).
_NODE_ID = re.compile(r"^[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?$")


class InvalidNodeId(ValueError):
    """
    A node id is outside the grammar of DESIGN §4.
    """


def validate_node_id(node_id: str) -> str:
    """
    Return C{node_id} when it is a valid node id.

    @raise InvalidNodeId: it is empty, too long, or has characters other than
        lowercase letters, digits, C{-} and C{.}.
    """
    if not node_id:
        raise InvalidNodeId("node id is empty")
    if len(node_id) > 63:
        raise InvalidNodeId(f"node id {node_id[:70]!r} is longer than 63 characters")
    if not _NODE_ID.fullmatch(node_id):
        raise InvalidNodeId(
            f"node id {node_id!r} must be lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit"
        )
    return node_id


class FrameError(ValueError):
    """
    A frame could not be decoded into the message it should hold.
    """


M = TypeVar("M", bound=Message)


def decode(message_class: type[M], data: bytes) -> M:
    """
    Parse one frame's payload.

    @raise FrameError: the bytes are not a valid C{message_class}, or the
        message's oneof is empty.
    """
    msg = message_class()
    try:
        msg.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise FrameError(f"undecodable {message_class.__name__} ({len(data)} bytes): {e}") from e
    try:
        which = msg.WhichOneof("msg")
    except ValueError:
        # Join messages have no oneof: each is the only thing its connection says.
        which = ""
    if which is None:
        raise FrameError(f"empty or unknown {message_class.__name__} ({len(data)} bytes)")
    return msg


class MessageStream(Int32StringReceiver, Generic[M]):
    """
    A length-prefixed protobuf stream with an explicit frame limit.

    Subclasses set C{incoming} to the message class the peer sends and
    implement L{message_received} and L{frame_refused}.
    """

    log = Logger()
    incoming: type[M]
    MAX_LENGTH = DEFAULT_MAX_FRAME
    # A TCP or TLS transport: ITransport does not declare the methods we use
    # (abortConnection, registerProducer, getPeerCertificate, disconnecting).
    transport: Any

    def peer_name(self) -> str:
        """
        Who is at the other end, for log lines.
        """
        return str(self.transport.getPeer()) if self.transport else "?"

    def dataReceived(self, data: bytes) -> None:
        # After an abort, whatever still arrives in the same read is dropped
        # rather than appended to the receive buffer.
        if self.transport is None or self.transport.disconnecting:
            return
        super().dataReceived(data)

    def lengthLimitExceeded(self, length: int) -> None:
        # Int32StringReceiver checks the prefix before buffering, so an
        # oversized frame is refused on its first four bytes.
        self.log.warn(
            "closing stream from {peer}: frame of {length} bytes is over the "
            "{limit} byte limit",
            peer=self.peer_name(),
            length=length,
            limit=self.MAX_LENGTH,
        )
        self.transport.abortConnection()

    def stringReceived(self, data: bytes) -> None:
        # Frames already buffered are still delivered after loseConnection().
        if self.transport is None or self.transport.disconnecting:
            return
        try:
            msg = decode(self.incoming, data)
        except FrameError as e:
            self.frame_refused(str(e))
            return
        self.message_received(msg)

    def send_message(self, msg: Message) -> None:
        """
        Serialize and write one frame.
        """
        self.sendString(msg.SerializeToString())

    def message_received(self, msg: M) -> None:
        raise NotImplementedError

    def frame_refused(self, reason: str) -> None:
        raise NotImplementedError


def ack(message_id: str, ok: bool = True, code: int = 0, error: str = "") -> pb.ControlMessage:
    """
    Build an C{Ack} control message.
    """
    return pb.ControlMessage(
        ack=pb.Ack(message_id=message_id, ok=ok, code=code, error=error)  # type: ignore[arg-type]
    )


STATE_NAMES = {
    pb.ShardStatus.STATE_UNSPECIFIED: "unspecified",
    pb.ShardStatus.STATE_STARTING: ShardState.STARTING,
    pb.ShardStatus.STATE_READY: ShardState.READY,
    pb.ShardStatus.STATE_DRAINING: ShardState.DRAINING,
    pb.ShardStatus.STATE_STOPPED: ShardState.STOPPED,
    pb.ShardStatus.STATE_FAILED: ShardState.FAILED,
    pb.ShardStatus.STATE_STOPPING: ShardState.STOPPING,
    pb.ShardStatus.STATE_FETCHING: ShardState.FETCHING,
}
STATE_VALUES = {name: value for value, name in STATE_NAMES.items()}


def state_name(state: int) -> str:
    """
    The lowercase name used in logs and the admin API for a wire state.
    """
    return STATE_NAMES.get(state, f"unknown({state})")  # type: ignore[call-overload]


# -- HA redirects (DESIGN §17) ---------------------------------------------------------

#: How a control-plane member that does not lead refuses a Register: a
#: failed-precondition Ack whose error ends with this marker and the
#: leader's agent address, which the agent dials next.
REDIRECT_MARKER = "the leader's agent address is "


def redirect_error(leader_address: str, leader_id: str = "") -> str:
    """The Ack error of a member that is not the leader."""
    who = f" (member {leader_id})" if leader_id else ""
    return f"this control-plane member is not the leader{who}; {REDIRECT_MARKER}{leader_address}"


def parse_redirect(error: str) -> str | None:
    """The leader's agent address in a redirect Ack's error, or None."""
    i = error.rfind(REDIRECT_MARKER)
    if i < 0:
        return None
    address = error[i + len(REDIRECT_MARKER):].strip()
    return address if address and " " not in address else None


#: How a member refuses a Register while no member leads: the agent tries
#: the next member soon, at a fixed delay, rather than backing off.
NO_LEADER_MARKER = "no control-plane member leads yet"
