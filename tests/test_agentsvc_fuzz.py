"""
Property tests: random frames and messages thrown at the agent stream.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.state.inventory import Inventory
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import PeerCertTransport, frame

node_ids = st.one_of(st.text(max_size=70), st.sampled_from(["node-a", "", "A", "x" * 64]))

registers = st.builds(
    lambda node, version, n: pb.AgentMessage(register=pb.Register(
        protocol_version=version, node_id=node,
        gpus=[pb.GPU(index=i % 3, memory_total_mb=1000) for i in range(n)],
    )),
    node_ids, st.integers(0, 3), st.integers(0, 5),
)
heartbeats = st.builds(
    lambda used, probs: pb.AgentMessage(heartbeat=pb.Heartbeat(
        gpu_memory_used_mb=used, new_problems=probs)),
    st.lists(st.integers(0, 2**63), max_size=5), st.lists(st.text(max_size=20), max_size=3),
)
statuses = st.builds(
    lambda sid, state, out: pb.AgentMessage(shard=pb.ShardStatus(
        shard_id=sid, state=state, last_output=out)),
    st.text(max_size=20), st.integers(0, 5), st.text(max_size=50),
)
messages = st.one_of(registers, heartbeats, statuses).map(lambda m: frame(m))
raw_frames = st.binary(max_size=200).map(lambda b: struct.pack("!I", len(b)) + b)
chunks = st.lists(st.one_of(messages, raw_frames, st.binary(max_size=64)), max_size=12)


class FuzzTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(chunks, st.booleans())
    def test_never_raises_never_registers(self, pieces: list[bytes], split: bool) -> None:
        """
        Whatever bytes arrive, in whatever pieces, dataReceived does not
        raise and no node is registered without a verified identity.
        """
        inventory = Inventory()
        service = AgentService(inventory, RecordingSink(), Clock(), epoch=1, max_frame=4096)
        proto = service.buildProtocol(None)
        transport = PeerCertTransport(None, peerAddress=IPv4Address("TCP", "10.0.0.9", 1))
        proto.makeConnection(transport)
        proto.handshakeCompleted()
        data = b"".join(pieces)
        step = 7 if split else max(1, len(data))
        for i in range(0, len(data), step):
            proto.dataReceived(data[i : i + step])
        self.assertEqual(len(inventory), 0)
        self.assertEqual(service.connected_nodes(), [])
