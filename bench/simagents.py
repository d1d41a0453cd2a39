"""
Simulated agents: many node agents in one process, each with its own
certificate, speaking the real agent stream (L{llmgw.wire} framing,
C{agent_pb2} messages) over real mutual TLS (L{AgentClientTLS}) on the epoll
reactor.

Each agent sends a C{Register} (8 GPUs, one fabric, no running shards) as
soon as it connects, then a C{Heartbeat} every heartbeat interval once it is
up: acknowledged by the control plane, or, against the bare baseline (which
never answers), once its TLS handshake is done. A lost connection is dialled
again after 1-2 s, as an agent's backoff would. A C{StopShard} whose shard id
is C{bench-<monotonic ns>} is timed from that send time to the moment the
agent reads it.

Requests from the orchestrator (L{bench.common.ControlChannel}):

    storm {host, port, kind, t0_ns, jitter_s, timeout, cpu}
                       dial every agent at T0 + uniform(0, JITTER); reply when
                       all are up (or at TIMEOUT) with per-agent timestamps
    stats              counts and heartbeats sent
    latencies          the dispatch latencies read so far (and forget them)
    disconnect         stop heartbeats and reconnects, abort every stream;
                       reply once all are closed

Run by L{bench.agent_stream}; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import ClientFactory
from twisted.internet.stdio import StandardIO
from twisted.internet.task import LoopingCall
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from bench.common import ControlChannel, Profiler, pin, raise_nofile
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.tlsconf.options import AgentClientTLS, TLSFiles
from llmgw.wire import PROTOCOL_VERSION, MessageStream

GPUS = 8
#: Heartbeats are sent from a wheel of this many slots per interval, so that
#: 10,000 agents need one timer, not 10,000.
SLOTS = 100


def register_message(node_id: str, not_after: float) -> bytes:
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=PROTOCOL_VERSION,
            node_id=node_id,
            agent_version="bench-sim/1",
            gpus=[
                pb.GPU(
                    index=i,
                    uuid=f"GPU-{node_id}-{i:02d}-0000-0000-000000000000",
                    name="NVIDIA H100 80GB HBM3",
                    memory_total_mb=81559,
                    memory_used_mb=0,
                )
                for i in range(GPUS)
            ],
            fabrics=[pb.Fabric(name="ib", address=f"10.{hash(node_id) % 250}.0.1")],
            certificate_not_after=int(not_after),
        )
    ).SerializeToString()


#: A few heartbeats that differ in memory used, so the inventory sees changes.
HEARTBEATS = [
    pb.AgentMessage(
        heartbeat=pb.Heartbeat(gpu_memory_used_mb=[v + i for i in range(GPUS)])
    ).SerializeToString()
    for v in (0, 3, 7, 11)
]


class SimNode:
    """
    One simulated agent: its identity and TLS options, and what happened to it.
    """

    def __init__(self, node_id: str, creator: AgentClientTLS, register: bytes) -> None:
        self.node_id = node_id
        self.creator = creator
        self.register = register
        self.stream: SimStream | None = None
        self.up = False
        self.dial_ns = 0
        self.hs_ns = 0
        self.up_ns = 0
        self.dials = 0
        self.slot = 0
        self.hb_sent = 0


@implementer(IHandshakeListener)
class SimStream(MessageStream[pb.ControlMessage]):
    incoming = pb.ControlMessage

    def __init__(self, fleet: Fleet, node: SimNode) -> None:
        self.fleet = fleet
        self.node = node

    def connectionMade(self) -> None:
        self.node.stream = self
        # Buffered by the TLS layer until the handshake is done.
        self.sendString(self.node.register)

    def handshakeCompleted(self) -> None:
        node = self.node
        if not node.hs_ns:
            node.hs_ns = time.monotonic_ns()
        if self.fleet.kind == "bare":
            self.fleet.node_up(node)

    def message_received(self, msg: pb.ControlMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "ack":
            if msg.ack.ok:
                if msg.ack.message_id == "register":
                    self.fleet.node_up(self.node)
            else:
                self.fleet.refusals[msg.ack.error[:120]] = (
                    self.fleet.refusals.get(msg.ack.error[:120], 0) + 1
                )
        elif kind == "stop":
            self.fleet.command_read(msg.stop.shard_id)

    def frame_refused(self, reason: str) -> None:
        self.fleet.bad_frames += 1

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.fleet.lost(self.node, reason)


class SimFactory(ClientFactory):
    noisy = False

    def __init__(self, fleet: Fleet, node: SimNode) -> None:
        self.fleet = fleet
        self.node = node

    def buildProtocol(self, addr: Any) -> SimStream:
        return SimStream(self.fleet, self.node)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.fleet.lost(self.node, reason)


class Fleet:
    """
    All the simulated agents of this process, and the orchestrator's requests.
    """

    def __init__(self, reactor: Any, nodes: list[SimNode], heartbeat_interval: float) -> None:
        self.reactor = reactor
        self.nodes = nodes
        self.heartbeat_interval = heartbeat_interval
        self.kind = "control"
        self.host = "127.0.0.1"
        self.port = 0
        self.closing = False
        self.up_count = 0
        self.reconnects = 0
        self.lost_after_up = 0
        self.bad_frames = 0
        self.refusals: dict[str, int] = {}
        self.lost_reasons: dict[str, int] = {}
        self.latencies: list[int] = []
        self.stray_commands = 0
        self.hb_sent = 0
        self._slots: list[list[SimNode]] = [[] for _ in range(SLOTS)]
        self._slot = 0
        self._wheel: LoopingCall | None = None
        self._all_up: Deferred[None] | None = None
        self._all_down: Deferred[None] | None = None
        self._open = 0
        self._rng = random.Random(0)

    # -- lifecycle of one agent --------------------------------------------------

    def dial(self, node: SimNode) -> None:
        if self.closing:
            return
        node.dials += 1
        if not node.dial_ns:
            node.dial_ns = time.monotonic_ns()
        self._open += 1
        factory = TLSMemoryBIOFactory(node.creator, True, SimFactory(self, node))
        self.reactor.connectTCP(self.host, self.port, factory, timeout=30)

    def node_up(self, node: SimNode) -> None:
        if node.up:
            return
        node.up = True
        if not node.up_ns:
            node.up_ns = time.monotonic_ns()
        self.up_count += 1
        self._slots[node.slot].append(node)
        if self.up_count == len(self.nodes) and self._all_up is not None:
            d, self._all_up = self._all_up, None
            d.callback(None)

    def lost(self, node: SimNode, reason: Failure) -> None:
        self._open -= 1
        node.stream = None
        if node.up:
            node.up = False
            self.up_count -= 1
            self._slots[node.slot].remove(node)
            if not self.closing:
                self.lost_after_up += 1
        if self.closing:
            if self._open == 0 and self._all_down is not None:
                d, self._all_down = self._all_down, None
                d.callback(None)
            return
        why = reason.getErrorMessage()[:120]
        self.lost_reasons[why] = self.lost_reasons.get(why, 0) + 1
        self.reconnects += 1
        self.reactor.callLater(1 + self._rng.random(), self.dial, node)

    def command_read(self, shard_id: str) -> None:
        now = time.monotonic_ns()
        if shard_id.startswith("bench-"):
            self.latencies.append(now - int(shard_id[6:]))
        else:
            self.stray_commands += 1

    def _tick(self, count: int) -> None:
        # LoopingCall skips ticks it was late for and says how many passed:
        # send for every slot they covered, or a busy process would leave
        # whole slots of agents silent for an interval.
        for _ in range(min(count, SLOTS)):
            slot = self._slots[self._slot]
            self._slot = (self._slot + 1) % SLOTS
            hb = HEARTBEATS[self._slot % len(HEARTBEATS)]
            for node in slot:
                stream = node.stream
                if stream is not None and not stream.transport.disconnecting:
                    stream.sendString(hb)
                    self.hb_sent += 1

    # -- requests -------------------------------------------------------------------

    def op_storm(self, req: dict[str, Any]) -> Deferred[dict[str, Any]]:
        pin(req.get("cpu") or None)
        self.kind = req["kind"]
        self.host = req["host"]
        self.port = int(req["port"])
        self.closing = False
        for node in self.nodes:
            node.dial_ns = node.hs_ns = node.up_ns = node.dials = 0
            node.slot = self._rng.randrange(SLOTS)
        self.reconnects = self.lost_after_up = 0
        self.lost_reasons = {}
        self.refusals = {}
        jitter = float(req["jitter_s"])
        t0 = int(req["t0_ns"])
        now = time.monotonic_ns()
        for node in self.nodes:
            at = max(0.0, (t0 - now) / 1e9 + self._rng.uniform(0, jitter))
            self.reactor.callLater(at, self.dial, node)
        self._wheel = LoopingCall.withCount(self._tick)
        self._wheel.clock = self.reactor
        self._wheel.start(self.heartbeat_interval / SLOTS, now=False)

        done: Deferred[None] = Deferred()
        self._all_up = done
        timeout = self.reactor.callLater(
            float(req.get("timeout", 60)), lambda: done.called or done.callback(None)
        )

        def report(_: None) -> dict[str, Any]:
            if timeout.active():
                timeout.cancel()
            self._all_up = None
            return {
                "up": self.up_count,
                "agents": len(self.nodes),
                "reconnects": self.reconnects,
                "lost_reasons": self.lost_reasons,
                "refusals": self.refusals,
                "dial_ns": [n.dial_ns for n in self.nodes],
                "hs_ns": [n.hs_ns for n in self.nodes],
                "up_ns": [n.up_ns for n in self.nodes],
            }

        return done.addCallback(report)

    def op_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "up": self.up_count,
            "heartbeats_sent": self.hb_sent,
            "reconnects": self.reconnects,
            "lost_after_up": self.lost_after_up,
            "lost_reasons": self.lost_reasons,
            "refusals": self.refusals,
            "bad_frames": self.bad_frames,
            "stray_commands": self.stray_commands,
        }

    def op_latencies(self, req: dict[str, Any]) -> dict[str, Any]:
        lat, self.latencies = self.latencies, []
        return {"latencies_ns": lat}

    def op_disconnect(self, req: dict[str, Any]) -> Deferred[dict[str, Any]] | dict[str, Any]:
        self.closing = True
        if self._wheel is not None and self._wheel.running:
            self._wheel.stop()
        for node in self.nodes:
            if node.stream is not None and node.stream.transport is not None:
                node.stream.transport.abortConnection()
        if self._open <= 0:
            return {"open": 0}
        done: Deferred[None] = Deferred()
        self._all_down = done
        self.reactor.callLater(
            float(req.get("timeout", 30)), lambda: done.called or done.callback(None)
        )
        return done.addCallback(lambda _: {"open": self._open})

    def handlers(self) -> dict[str, Any]:
        return {
            "storm": self.op_storm,
            "stats": self.op_stats,
            "latencies": self.op_latencies,
            "disconnect": self.op_disconnect,
            "profile": Profiler(),
        }


def load_nodes(certs: Path, ids: list[str]) -> list[SimNode]:
    nodes = []
    for node_id in ids:
        files = TLSFiles.load(
            certs / "ca.pem", certs / f"agent-{node_id}.pem", certs / f"agent-{node_id}.key"
        )
        creator = AgentClientTLS("127.0.0.1", files)
        not_after = files.cert.not_valid_after_utc.timestamp()
        nodes.append(SimNode(node_id, creator, register_message(node_id, not_after)))
    return nodes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--certs", type=Path, required=True)
    p.add_argument("--prefix", default="sim-")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    args = p.parse_args(argv)

    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor

    nofile = raise_nofile()
    t = time.monotonic()
    ids = [f"{args.prefix}{i:05d}" for i in range(args.first, args.first + args.count)]
    fleet = Fleet(reactor, load_nodes(args.certs, ids), args.heartbeat_interval)
    load_s = time.monotonic() - t

    def stop() -> None:
        if reactor.running:
            reactor.stop()

    hello = {"ready": True, "agents": len(ids), "load_s": round(load_s, 3), "nofile": nofile}
    StandardIO(ControlChannel(fleet.handlers(), hello, stop))
    reactor.run()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
