"""
Engines on both ends of the agent stream: the advertised
address becomes the node's (and is checked), StartShard carries the engine
fields, heartbeats' signals reach the sink; the supervisor probes the
advertised host, treats a shard without a health path as ready while its
process lives, fills {host}, and stops with the profile's signal.
"""

from __future__ import annotations

import signal
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.client import AgentConfig, AgentCore
from llmgw.agent.service import Options
from llmgw.agent.state import ShardSpec
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentsvc import start_message
from llmgw.control.state.interfaces import ShardCommand
from llmgw.shards import DEFAULT_STALL_AFTER_S
from llmgw.testing.stream import frame, register
from tests.supervisor_harness import FakeOps, FakeProber, FakeSpawner, spec
from tests.test_agentsvc import Harness, only_ack


class AdvertiseTests(SynchronousTestCase):
    def test_advertised_address_is_the_nodes(self) -> None:
        """
        A Register's advertise_address is the node's address (what the
        gateway dials and {host} becomes); without one, the peer's.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        msg = register("node-a")
        msg.register.advertise_address = "10.9.8.7"
        proto.dataReceived(frame(msg))
        self.assertTrue(only_ack(self, transport).ok)
        node = h.inventory.get("node-a")
        assert node is not None
        self.assertEqual(node.address, "10.9.8.7")

    def test_bad_advertised_address_refused(self) -> None:
        """
        An advertise_address that is not a host is refused as an invalid
        argument, naming it.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        msg = register("node-a")
        msg.register.advertise_address = "http://evil/"
        proto.dataReceived(frame(msg))
        ack = only_ack(self, transport)
        self.assertFalse(ack.ok)
        self.assertEqual(ack.code, pb.Ack.CODE_INVALID_ARGUMENT)
        self.assertIn("advertise_address", ack.error)

    def test_heartbeat_signals_reach_the_sink(self) -> None:
        """
        A heartbeat's engine signals go to a sink that records them, with
        the node that sent them.
        """
        h = Harness(self)
        got: list[tuple[str, list[str]]] = []
        h.sink.record_engine_signals = lambda node, msgs: got.append(  # type: ignore[attr-defined]
            (node, [m.shard_id for m in msgs]))
        proto, _ = h.registered("node-a")
        proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat(
            shard_signals=[pb.ShardSignals(shard_id="s1", running=1, age_s=0)]))))
        self.assertEqual(got, [("node-a", ["s1"])])

    def test_start_message_carries_engine_fields(self) -> None:
        """
        StartShard carries engine, metrics path and names, stop signal, and
        ready_while_alive for a shard without a health path; the agent reads
        them back into its spec.
        """
        cmd = ShardCommand(node_id="n", shard_id="s", replica_id="r", model="m", profile="p",
                           argv=("x",), gpu_indices=(0,), port=9, health_path="",
                           engine="sglang", metrics_path="/metrics",
                           metric_names={"waiting": "sglang:num_queue_reqs"},
                           stop_signal="SIGINT")
        msg = start_message(cmd, epoch=3).start
        self.assertTrue(msg.ready_while_alive)
        parsed = ShardSpec.from_message(msg)
        self.assertEqual((parsed.health_path, parsed.engine, parsed.metrics_path,
                          parsed.stop_signal, parsed.metric_names),
                         ("", "sglang", "/metrics", "SIGINT",
                          {"waiting": "sglang:num_queue_reqs"}))

    def test_start_message_names_each_peer_once(self) -> None:
        """
        A StartShard names each of its command's weight peers once, in order.
        """
        cmd = ShardCommand(node_id="n", shard_id="s", replica_id="r", model="m", profile="p",
                           argv=("x",), gpu_indices=(0,), port=9,
                           model_peers=("10.0.0.2:7444", "10.0.0.3:7444"))
        self.assertEqual(list(start_message(cmd, epoch=3).start.model_peers),
                         ["10.0.0.2:7444", "10.0.0.3:7444"])

    def test_default_stall_after_left_out(self) -> None:
        """
        A StartShard leaves stall_after_s out when it is the default (the
        agent reads the default for none) and carries any other, 0 (never)
        included; the agent reads each back as it was.
        """
        for stall, sent in ((DEFAULT_STALL_AFTER_S, False), (0.0, True), (4.0, True)):
            cmd = ShardCommand(node_id="n", shard_id="s", replica_id="r", model="m", profile="p",
                               argv=("x",), gpu_indices=(0,), port=9, stall_after_s=stall)
            msg = start_message(cmd, epoch=3).start
            self.assertEqual(msg.HasField("stall_after_s"), sent)
            self.assertEqual(ShardSpec.from_message(msg).stall_after_s, stall)

    def test_agent_option(self) -> None:
        """
        --advertise-address refuses what is not a host, naming the option.
        """
        from twisted.python import usage

        with self.assertRaises(usage.UsageError) as cm:
            Options().parseOptions(["--control", "cp:7443", "--ca", "a", "--cert", "b", "--key",
                                    "c", "--advertise-address", "not a host"])
        self.assertIn("--advertise-address", str(cm.exception))


class LearnedAddressTests(SynchronousTestCase):
    def test_local_address_of_the_stream(self) -> None:
        """
        Without --advertise-address the agent advertises the local address
        of its stream, and its supervisor probes there; with one, that one.
        """
        from twisted.internet.address import IPv4Address
        from twisted.internet.task import Clock
        from twisted.internet.testing import StringTransport

        from llmgw.agent.gpus import GPUMonitor, SimulatedGPUs
        from llmgw.agent.supervisor import Supervisor

        clock = Clock()
        sup = Supervisor(clock, lambda *a, **k: None)
        monitor = GPUMonitor(SimulatedGPUs(1, 1024), clock)
        core = AgentCore(AgentConfig(node_id="n"), sup, monitor, clock)
        core.learn_address(StringTransport(hostAddress=IPv4Address("TCP", "10.1.2.3", 5555)))
        self.assertEqual((core.advertised, sup.probe_host), ("10.1.2.3", "10.1.2.3"))
        self.assertEqual(core.register_message().advertise_address, "10.1.2.3")
        fixed = AgentCore(AgentConfig(node_id="n", advertise_address="gpu-7.lan"),
                          Supervisor(clock, lambda *a, **k: None), monitor, clock)
        fixed.learn_address(StringTransport(hostAddress=IPv4Address("TCP", "10.1.2.3", 5555)))
        self.assertEqual((fixed.advertised, fixed.supervisor.probe_host), ("gpu-7.lan", "gpu-7.lan"))


class SupervisorEngineTests(SynchronousTestCase):
    def setUp(self) -> None:
        from twisted.internet.task import Clock

        from llmgw.agent.state import StateDir
        from llmgw.agent.supervisor import Supervisor

        self.clock = Clock()
        self.spawner = FakeSpawner()
        self.ops = FakeOps()
        self.prober = FakeProber()
        self.sup = Supervisor(self.clock, self.spawner, StateDir(self.mktemp()),
                              gpu_indices=[0, 1], ops=self.ops, prober=self.prober,
                              python="/usr/bin/python3", base_env={"PATH": "/usr/bin"})

    def start_ready(self, **kw: Any) -> Any:
        shard = self.sup.start(spec(**kw))
        self.clock.advance(0)
        self.prober.answer(True)
        return shard

    def test_probes_the_advertised_host(self) -> None:
        """
        Health checks go to the advertised host, and {host} in a command is
        filled with it when the control plane left it.
        """
        self.sup.probe_host = "10.0.0.9"
        self.sup.start(spec(argv=["{python}", "srv", "--host", "{host}"]))
        self.clock.advance(0)
        url = self.prober.answer(True)
        self.assertEqual(url, "http://10.0.0.9:8001/health")
        self.assertIn("10.0.0.9", self.spawner.calls[0]["args"])

    def test_ready_while_alive(self) -> None:
        """
        A shard with no health path is ready without any probe, and fails
        when its process ends.
        """
        shard = self.sup.start(spec(health_path=""))
        self.clock.advance(0)
        self.assertEqual(self.prober.pending, [])
        self.assertEqual(shard.state, "ready")
        self.spawner.processes[0].end(1)
        self.assertEqual(shard.state, "failed")

    def test_stop_signal(self) -> None:
        """
        A stop sends the profile's stop signal first, KILL after the grace.
        """
        shard = self.start_ready(stop_signal="SIGINT", stop_grace_s=5)
        self.sup.stop(shard.shard_id)
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGINT))
        self.clock.advance(5)
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGKILL))
