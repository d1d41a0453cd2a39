"""
Tests for L{llmgw.shards}: the shard records both ends of the agent stream
share, and their one mapping to and from the stream's messages.
"""

from __future__ import annotations

from dataclasses import fields

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.state.interfaces import ShardCommand
from llmgw.shards import ReportedShard, ShardReport, ShardSpec
from llmgw.sourcespec import ModelSource
from llmgw.wire import STATE_VALUES

# Protobuf strings are UTF-8: no lone surrogates.
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
uint32 = st.integers(0, 2**32 - 1)
# proto3 reads a zero as unset, and these take their default then.
positive32 = st.integers(1, 2**32 - 1)
names = st.dictionaries(text, text, max_size=4)
states = st.sampled_from(sorted(STATE_VALUES))

# Any field values at all: the wire carries a source as sent, and the agent
# checks it before use.
sources = st.none() | st.builds(
    ModelSource, scheme=st.sampled_from(["hf", "https", "file", ""]), repo=text, revision=text,
    file=text, url=text, sha256=text, path=text,
)
specs = st.builds(
    ShardSpec,
    shard_id=text, replica_id=text, model=text, profile=text,
    argv=st.lists(text, max_size=5), gpu_indices=st.lists(uint32, max_size=8), port=uint32,
    rank=uint32, world_size=positive32, leader_address=text, env=names, health_path=text,
    startup_timeout_s=positive32, stop_grace_s=positive32, drain_timeout_s=positive32,
    engine=text.filter(bool), metrics_path=text, metric_names=names,
    stop_signal=text.filter(bool), epoch=st.integers(0, 2**64 - 1), source=sources,
)
reported = st.builds(
    ReportedShard,
    node_id=text, shard_id=text, replica_id=text, model=text, profile=text, rank=uint32,
    gpu_indices=st.lists(uint32, max_size=8), port=uint32, state=states, world_size=positive32,
    epoch=st.integers(0, 2**64 - 1), pgid=uint32, record_lost=st.booleans(),
)
reports = st.builds(
    ShardReport,
    node_id=text, replica_id=text, shard_id=text, state=states, error=text,
    exit_code=st.integers(-(2**31), 2**31 - 1), signal=st.integers(-(2**31), 2**31 - 1),
    last_output=text, crash_class=text,
)


def over_the_wire(msg: pb.StartShard | pb.RunningShard | pb.ShardStatus) -> bytes:
    return msg.SerializeToString()


class ShardSpecTests(SynchronousTestCase):
    @given(specs)
    def test_round_trip(self, spec: ShardSpec) -> None:
        """
        A spec sent as a StartShard, serialized and parsed, is read back
        equal.
        """
        got = pb.StartShard.FromString(over_the_wire(spec.to_message()))
        self.assertEqual(ShardSpec.from_message(got), spec)

    def test_fields_match_the_message(self) -> None:
        """
        The spec has a field of the same name for each of StartShard's, but
        ready_while_alive (an empty health path), and no other: a field added
        to one is missed at neither end.
        """
        self.assertEqual({f.name for f in fields(ShardSpec)} | {"ready_while_alive"},
                         set(pb.StartShard.DESCRIPTOR.fields_by_name))

    def test_older_control_plane(self) -> None:
        """
        What a control plane from before engines leaves unset takes the
        default: world size 1, the default health path, timeouts, engine
        and stop signal.
        """
        spec = ShardSpec.from_message(pb.StartShard(shard_id="s", argv=["x"]))
        self.assertEqual(
            (spec.world_size, spec.health_path, spec.startup_timeout_s, spec.stop_grace_s,
             spec.drain_timeout_s, spec.engine, spec.stop_signal, spec.metrics_path),
            (1, "/health", 600, 30, 60, "generic", "SIGTERM", ""),
        )

    def test_source(self) -> None:
        """
        A spec with a model source sends it as a ModelSource that reads back
        equal; one without sends none, and a StartShard of a control plane
        from before sources (no field 22) reads as no source. An agent from
        before sources reads a StartShard with one, its other fields intact.
        """
        source = ModelSource(scheme="hf", repo="org/repo", revision="main", file="x.gguf")
        spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p",
                         argv=["llama-server", "-m", "{weights}"], gpu_indices=[0], port=1,
                         source=source)
        wire = over_the_wire(spec.to_message())
        self.assertEqual(ShardSpec.from_message(pb.StartShard.FromString(wire)).source, source)
        plain = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                          gpu_indices=[], port=1)
        self.assertFalse(plain.to_message().HasField("source"))
        # The StartShard of a schema from before sources, in a pool of its own.
        old_schema = descriptor_pb2.FileDescriptorProto()
        pb.DESCRIPTOR.CopyToProto(old_schema)
        old_schema.name = "before_sources.proto"
        [start] = [m for m in old_schema.message_type if m.name == "StartShard"]
        [field_22] = [f for f in start.field if f.number == 22]
        start.field.remove(field_22)
        pool = descriptor_pool.DescriptorPool()
        pool.Add(old_schema)
        OldStartShard = message_factory.GetMessageClass(pool.FindMessageTypeByName("llmgw.v1.StartShard"))
        seen_by_old_agent = OldStartShard.FromString(wire)
        self.assertEqual((list(seen_by_old_agent.argv), seen_by_old_agent.port, seen_by_old_agent.model),
                         (["llama-server", "-m", "{weights}"], 1, "m"))
        from_old_plane = OldStartShard(shard_id="s", argv=["x"]).SerializeToString()
        self.assertIsNone(ShardSpec.from_message(pb.StartShard.FromString(from_old_plane)).source)

    def test_ready_while_alive(self) -> None:
        """
        An empty health path goes as ready_while_alive, so that an older
        agent, which reads an empty path as the default, is not told to wait
        for a check that the engine does not answer; a path goes as itself.
        """
        spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                         gpu_indices=[], port=1, health_path="")
        self.assertTrue(spec.to_message().ready_while_alive)
        self.assertFalse(ShardSpec(shard_id="s", replica_id="r", model="m", profile="p",
                                   argv=["x"], gpu_indices=[], port=1).to_message().ready_while_alive)

    def test_own_copies(self) -> None:
        """
        A spec holds tuples and dicts of its own: changing the list or dict it
        was made from changes nothing in it, and a spec made from lists equals
        one made from tuples.
        """
        argv, env = ["x"], {"A": "1"}
        spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=argv,
                         gpu_indices=[0], port=1, env=env)
        argv.append("y")
        env["B"] = "2"
        self.assertEqual((spec.argv, spec.gpu_indices, spec.env), (("x",), (0,), {"A": "1"}))
        self.assertEqual(spec, ShardSpec(shard_id="s", replica_id="r", model="m", profile="p",
                                         argv=("x",), gpu_indices=(0,), port=1, env={"A": "1"}))


class ShardCommandTests(SynchronousTestCase):
    @given(specs, text)
    def test_to_node(self, spec: ShardSpec, node_id: str) -> None:
        """
        A command addressed to a node carries every field of its spec, and
        goes as the same StartShard.
        """
        cmd = ShardCommand.to_node(node_id, spec)
        self.assertEqual(cmd.node_id, node_id)
        self.assertEqual({f.name: getattr(cmd, f.name) for f in fields(ShardSpec)},
                         {f.name: getattr(spec, f.name) for f in fields(ShardSpec)})
        self.assertEqual(cmd.to_message(), spec.to_message())


class ReportedShardTests(SynchronousTestCase):
    @given(reported)
    def test_round_trip(self, shard: ReportedShard) -> None:
        """
        A reported shard sent as a RunningShard, serialized and parsed, is
        read back equal, with the node the Register names.
        """
        got = pb.RunningShard.FromString(over_the_wire(shard.to_message()))
        self.assertEqual(ReportedShard.from_message(shard.node_id, got), shard)

    def test_fields_match_the_message(self) -> None:
        """
        The record has a field of the same name for each of RunningShard's,
        and the node.
        """
        self.assertEqual({f.name for f in fields(ReportedShard)},
                         set(pb.RunningShard.DESCRIPTOR.fields_by_name) | {"node_id"})

    @given(specs, text, states)
    def test_of_spec(self, spec: ShardSpec, node_id: str, state: str) -> None:
        """
        What a node reports of a shard it started is the spec's identity,
        place and epoch.
        """
        shard = ReportedShard.of_spec(node_id, spec, state, pgid=7)
        self.assertEqual(
            (shard.node_id, shard.shard_id, shard.replica_id, shard.model, shard.profile,
             shard.rank, shard.gpu_indices, shard.port, shard.state, shard.world_size,
             shard.epoch, shard.pgid, shard.record_lost),
            (node_id, spec.shard_id, spec.replica_id, spec.model, spec.profile, spec.rank,
             spec.gpu_indices, spec.port, state, spec.world_size, spec.epoch, 7, False),
        )

    def test_older_agent(self) -> None:
        """
        An agent from before world sizes were reported is read as world
        size 1; a state this end does not know is named, not refused.
        """
        shard = ReportedShard.from_message("n", pb.RunningShard(shard_id="s", state=99))  # type: ignore[arg-type]
        self.assertEqual((shard.world_size, shard.state), (1, "unknown(99)"))

    def test_positional(self) -> None:
        """
        The fields the reconciler's tests give by position keep their order:
        node, shard, replica, model, profile, rank, GPUs, port, state, world
        size.
        """
        shard = ReportedShard("n", "s", "r", "m", "p", 1, [2], 3, "ready", 4)
        self.assertEqual((shard.node_id, shard.shard_id, shard.replica_id, shard.model,
                          shard.profile, shard.rank, shard.gpu_indices, shard.port, shard.state,
                          shard.world_size), ("n", "s", "r", "m", "p", 1, (2,), 3, "ready", 4))


class ShardReportTests(SynchronousTestCase):
    @given(reports)
    def test_round_trip(self, report: ShardReport) -> None:
        """
        A report sent as a ShardStatus, serialized and parsed, is read back
        equal, with the node of the stream it came on.
        """
        got = pb.ShardStatus.FromString(over_the_wire(report.to_message()))
        self.assertEqual(ShardReport.from_message(report.node_id, got), report)

    def test_fields_match_the_message(self) -> None:
        """
        The record has a field of the same name for each of ShardStatus's,
        and the node.
        """
        self.assertEqual({f.name for f in fields(ShardReport)},
                         set(pb.ShardStatus.DESCRIPTOR.fields_by_name) | {"node_id"})
