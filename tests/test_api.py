"""
Tests for the committed generated protobuf modules.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2, generate


def _strip_version(data: bytes) -> bytes:
    # The generator's own version line is not part of the schema.
    return b"\n".join(
        line for line in data.splitlines() if not line.startswith(b"# Protobuf Python Version")
    )


class GeneratedCodeTests(SynchronousTestCase):
    def test_generated_modules_are_current(self) -> None:
        """
        agent_pb2.py and agent_pb2.pyi are what agent.proto generates today;
        after a schema change, run `python -m llmgw.api.v1.generate`.
        """
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate.generate(Path(tmp))
        for name, data in fresh.items():
            committed = (generate.HERE / name).read_bytes()
            self.assertEqual(
                _strip_version(committed), _strip_version(data),
                f"{name} is stale: run python -m llmgw.api.v1.generate",
            )

    def test_contract_names(self) -> None:
        """
        The message and field names of DESIGN §3.1 are present.
        """
        self.assertEqual(agent_pb2.DESCRIPTOR.package, "llmgw.v1")
        self.assertEqual(
            [f.name for f in agent_pb2.AgentMessage.DESCRIPTOR.oneofs_by_name["msg"].fields],
            ["register", "heartbeat", "shard", "certificate_request"],
        )
        self.assertEqual(
            [f.name for f in agent_pb2.ControlMessage.DESCRIPTOR.oneofs_by_name["msg"].fields],
            ["ack", "start", "stop", "drain", "prefetch", "drop", "certificate_issued", "load_adapter", "sleep"],
        )
        start = agent_pb2.StartShard.DESCRIPTOR.fields_by_name
        for name in ("shard_id", "replica_id", "model", "profile", "rank", "world_size",
                     "leader_address", "argv", "env", "gpu_indices", "port", "health_path",
                     "startup_timeout_s", "stop_grace_s", "epoch"):
            self.assertIn(name, start)
        self.assertEqual(agent_pb2.ShardStatus.State.Name(0), "STATE_UNSPECIFIED")
        self.assertEqual(agent_pb2.Ack.Code.Name(5), "CODE_RESOURCE_EXHAUSTED")
