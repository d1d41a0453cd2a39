"""
Tests for L{llmgw.wire}: node ids and frame decoding.
"""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.wire import (
    FrameError,
    InvalidNodeId,
    MessageStream,
    decode,
    state_name,
    validate_node_id,
)


class NodeIdTests(SynchronousTestCase):
    def test_valid(self) -> None:
        """
        Lowercase letters, digits, '-' and '.', up to 63 characters, pass.
        """
        for ok in ("a", "node-1", "gpu01.rack3", "a" * 63, "0"):
            self.assertEqual(validate_node_id(ok), ok)

    def test_invalid(self) -> None:
        """
        Empty, too long, uppercase, underscores, spaces, leading or trailing
        punctuation are refused with a message naming the id.
        """
        for bad in ("", "a" * 64, "Node", "a_b", "a b", "-a", "a-", ".a", "a/b", "ñ", "a\n", "node-a\n"):
            with self.assertRaises(InvalidNodeId):
                validate_node_id(bad)

    @given(st.text(max_size=80))
    def test_grammar_property(self, s: str) -> None:
        """
        Whatever is accepted is within the grammar.
        """
        try:
            validate_node_id(s)
        except InvalidNodeId:
            return
        self.assertTrue(0 < len(s) <= 63)
        self.assertTrue(set(s) <= set("abcdefghijklmnopqrstuvwxyz0123456789-."))


class DecodeTests(SynchronousTestCase):
    def test_roundtrip(self) -> None:
        """
        A serialized message decodes to itself.
        """
        msg = pb.AgentMessage(heartbeat=pb.Heartbeat(gpu_memory_used_mb=[1, 2]))
        self.assertEqual(decode(pb.AgentMessage, msg.SerializeToString()), msg)

    def test_empty_and_garbage(self) -> None:
        """
        An empty oneof and undecodable bytes raise FrameError.
        """
        self.assertRaises(FrameError, decode, pb.AgentMessage, b"")
        self.assertRaises(FrameError, decode, pb.AgentMessage, b"\xff\xff\xff")

    def test_state_names(self) -> None:
        """
        Wire states map to the lowercase names used everywhere else.
        """
        self.assertEqual(state_name(pb.ShardStatus.STATE_READY), "ready")
        self.assertEqual(state_name(99), "unknown(99)")


class _Recorder(MessageStream[pb.AgentMessage]):
    incoming = pb.AgentMessage

    def __init__(self) -> None:
        self.received: list[pb.AgentMessage] = []
        self.refused: list[str] = []

    def message_received(self, msg: pb.AgentMessage) -> None:
        self.received.append(msg)
        if len(self.received) == 1:
            # The first message makes the protocol close its stream.
            self.transport.loseConnection()

    def frame_refused(self, reason: str) -> None:
        self.refused.append(reason)


class DisconnectingGuardTests(SynchronousTestCase):
    def test_frames_after_close_dropped(self) -> None:
        """
        Frames that arrive in the same read as the one whose handler closed
        the stream are not delivered, nor is anything read afterwards.
        """
        proto = _Recorder()
        transport = StringTransport()
        proto.makeConnection(transport)
        hb = pb.AgentMessage(heartbeat=pb.Heartbeat()).SerializeToString()
        one = struct.pack("!I", len(hb)) + hb
        proto.dataReceived(one * 3)
        self.assertEqual(len(proto.received), 1)
        proto.dataReceived(one)
        self.assertEqual((len(proto.received), proto.refused), (1, []))
        self.assertTrue(transport.disconnecting)
