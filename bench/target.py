"""
The process the simulated agents dial: either the real control plane
(C{--kind control}: built by L{llmgw.control.service.makeService} from
parsed L{Options}, exactly as C{twistd -n llmgw control} builds it, and
logging to a file as C{twistd -n} would) or the bare baseline (C{--kind
bare}: an C{Int32StringReceiver} behind the same L{ServerTLS} options that
only counts frames).

The control plane's command line here (L{control_argv}): the bench's
certificates, the agent port on 127.0.0.1 port 0, the admin API on
127.0.0.1 port 0, no gateway, no catalog (the reconciler runs with an
empty one: nothing placed, every reported shard stopped; the simulated
agents report none), the bench's heartbeat interval, and no per-address
cap (every simulated agent dials from 127.0.0.1). Everything else is
twistd's default, the admission gate and the collector tuning included.

Both answer the orchestrator on stdin/stdout (L{bench.common.ControlChannel}):

    await {count, timeout}     reply when COUNT agents have registered
    stats                      registered / connected counts
    dispatch {count, interval_ms}
                               send a StopShard for a made-up shard to COUNT
                               registered agents, one every INTERVAL_MS (0: all
                               in one reactor turn); the shard id carries the
                               send time (C{time.monotonic_ns()}), so the agent
                               that reads it knows the latency
    gc                         time in the cyclic collector since the last ask
    profile {action, path}     start / stop cProfile; stop dumps to PATH

Run by L{bench.agent_stream}; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import ServerFactory
from twisted.internet.stdio import StandardIO
from twisted.logger import globalLogBeginner, textFileLogObserver
from twisted.protocols.basic import Int32StringReceiver
from twisted.protocols.tls import TLSMemoryBIOFactory

from bench.common import ControlChannel, Profiler, pin, raise_nofile
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.service import ControlPlane, Options, makeService
from llmgw.control.state.interfaces import NotConnected, NotKeepingUp
from llmgw.tlsconf.options import ServerTLS, server_files
from llmgw.wire import DEFAULT_MAX_FRAME


class Registrations:
    """
    Counts distinct registered agents and remembers when the last one came.
    """

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.seen: set[Any] = set()
        self.last_ns = 0
        self._waiting: list[tuple[int, Deferred[dict[str, Any]]]] = []

    def registered(self, key: Any) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        self.last_ns = time.monotonic_ns()
        n = len(self.seen)
        still = []
        for count, d in self._waiting:
            if n >= count:
                d.callback({"registered": n, "t_ns": self.last_ns})
            else:
                still.append((count, d))
        self._waiting = still

    def wait_for(self, count: int, timeout: float) -> Deferred[dict[str, Any]]:
        d: Deferred[dict[str, Any]] = Deferred()
        if len(self.seen) >= count:
            d.callback({"registered": len(self.seen), "t_ns": self.last_ns})
            return d
        self._waiting.append((count, d))

        def expire() -> None:
            if not d.called:
                self._waiting = [(c, w) for c, w in self._waiting if w is not d]
                d.callback(
                    {"registered": len(self.seen), "t_ns": self.last_ns, "timed_out": True}
                )

        self.reactor.callLater(timeout, expire)
        return d


def control_argv(certs: Path, heartbeat_interval: float, extra: list[str] | None = None) -> list[str]:
    """
    The C{twistd llmgw control} options the benchmark runs the control
    plane with, then C{extra} (a benchmark's own, such as C{--signer}).
    """
    return [
        "--certs", str(certs),
        "--agent-listen", "127.0.0.1:0",
        "--admin", "127.0.0.1:0",
        "--gateway", "off",
        "--heartbeat", str(heartbeat_interval),
        "--max-connections-per-address", "0",
        *(extra or []),
    ]


def observe_registrations(sink: Any, regs: Registrations) -> None:
    """
    Tell L{Registrations} about every node the control plane's sink (the
    reconciler) hears register, after the sink has.
    """
    registered = sink.node_registered

    def node_registered(node_id: str) -> None:
        registered(node_id)
        regs.registered(node_id)

    sink.node_registered = node_registered


class BareStream(Int32StringReceiver):
    """
    The baseline: frames are counted, never parsed. The first frame on a
    connection counts as its registration.
    """

    MAX_LENGTH = DEFAULT_MAX_FRAME
    factory: BareFactory
    frames = 0

    def connectionMade(self) -> None:
        self.factory.open.add(self)

    def stringReceived(self, data: bytes) -> None:
        self.frames += 1
        self.factory.frames += 1
        if self.frames == 1:
            self.factory.regs.registered(self)
            self.factory.registered.append(self)

    def lengthLimitExceeded(self, length: int) -> None:
        self.transport.abortConnection()

    def connectionLost(self, reason: Any = None) -> None:
        self.factory.open.discard(self)


class BareFactory(ServerFactory):
    protocol = BareStream
    noisy = False

    def __init__(self, regs: Registrations) -> None:
        self.regs = regs
        self.open: set[BareStream] = set()
        self.registered: list[BareStream] = []
        self.frames = 0


def stop_frame(epoch: int) -> bytes:
    shard = f"bench-{time.monotonic_ns()}"
    return pb.ControlMessage(stop=pb.StopShard(shard_id=shard, epoch=epoch)).SerializeToString()


class GCTimes:
    """
    Time spent in the cyclic garbage collector, by generation, since the
    last call to L{take}.
    """

    def __init__(self) -> None:
        self._start = 0.0
        self._reset()
        gc.callbacks.append(self._callback)

    def _reset(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        g = info["generation"]
        self.counts[g] += 1
        self.seconds[g] += took
        self.longest = max(self.longest, took)

    def take(self) -> dict[str, Any]:
        out = {
            "collections": self.counts,
            "seconds": [round(x, 3) for x in self.seconds],
            "longest_ms": round(self.longest * 1000, 1),
            "tracked_objects": len(gc.get_objects()),
        }
        self._reset()
        return out


class Target:
    """
    The server under test and the orchestrator's requests.
    """

    def __init__(self, reactor: Any, kind: str, certs: Path, heartbeat_interval: float,
                 extra: list[str] | None = None) -> None:
        self.reactor = reactor
        self.kind = kind
        self.regs = Registrations(reactor)
        self.gc_times = GCTimes()
        if kind == "control":
            options = Options()
            options.parseOptions(control_argv(certs, heartbeat_interval, extra))
            self.options = options
            # Without a reactor, as twistd calls it: this process is the
            # control plane's own.
            self.cp: ControlPlane = makeService(options)
            observe_registrations(self.cp.sink, self.regs)
            self.cp.startService()
            self.port = self.cp.agent_listener.port.getHost().port
            join = getattr(self.cp, "join_listener", None)
            self.join_port = join.port.getHost().port if join is not None else 0
        else:
            tls = ServerTLS(server_files(certs))
            self.bare = BareFactory(self.regs)
            listening = self.reactor.listenTCP(
                0, TLSMemoryBIOFactory(tls, False, self.bare), backlog=self.backlog(),
                interface="127.0.0.1",
            )
            self.port = listening.getHost().port

    @staticmethod
    def backlog() -> int:
        """
        The bare server's listen backlog: the control plane's default, so
        that both meet the storm with the same kernel queue.
        """
        return int(Options()["backlog"])

    # -- requests -------------------------------------------------------------

    def op_await(self, req: dict[str, Any]) -> Deferred[dict[str, Any]]:
        return self.regs.wait_for(int(req["count"]), float(req.get("timeout", 60)))

    def op_gc(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.gc_times.take()

    def op_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"registered": len(self.regs.seen)}
        if self.kind == "control":
            agents = self.cp.agents
            out["connected"] = len(agents.connected_nodes())
            out["open"] = agents.open_connections()
            out["registrations"] = dict(agents.registrations)
            out["dispatch_refusals"] = dict(agents.dispatch_refusals)
            out["inventory"] = len(self.cp.inventory)
            out["sink"] = type(self.cp.sink).__name__
            limiter = self.cp.limiter
            out["admission"] = {
                "max_registering": limiter.max_registering,
                "registering_peak": limiter.registering_peak,
                "pauses": limiter.pauses,
                "paused_s": round(limiter.paused_seconds, 2),
                "refused": dict(limiter.refused),
            }
        else:
            out["connected"] = len(self.bare.open)
            out["frames"] = self.bare.frames
        return out

    def _targets(self, count: int) -> list[Any]:
        if self.kind == "control":
            pool: list[Any] = self.cp.agents.connected_nodes()
        else:
            pool = [p for p in self.bare.registered if p in self.bare.open]
        return random.Random(count).sample(pool, min(count, len(pool)))

    def _send_one(self, target: Any, errors: dict[str, int]) -> None:
        if self.kind == "control":
            try:
                self.cp.agents.stop_shard(target, f"bench-{time.monotonic_ns()}")
            except NotConnected:
                errors["not_connected"] = errors.get("not_connected", 0) + 1
            except NotKeepingUp:
                errors["not_keeping_up"] = errors.get("not_keeping_up", 0) + 1
        else:
            target.sendString(stop_frame(1))

    def op_dispatch(self, req: dict[str, Any]) -> Deferred[dict[str, Any]] | dict[str, Any]:
        targets = self._targets(int(req["count"]))
        interval = float(req.get("interval_ms", 0)) / 1000.0
        errors: dict[str, int] = {}
        t0 = time.monotonic_ns()
        if interval <= 0:
            for t in targets:
                self._send_one(t, errors)
            return {"sent": len(targets), "errors": errors,
                    "send_loop_ms": (time.monotonic_ns() - t0) / 1e6}
        done: Deferred[dict[str, Any]] = Deferred()
        it = iter(targets)

        def step() -> None:
            t = next(it, None)
            if t is None:
                done.callback({"sent": len(targets), "errors": errors,
                               "send_loop_ms": (time.monotonic_ns() - t0) / 1e6})
                return
            self._send_one(t, errors)
            self.reactor.callLater(interval, step)

        step()
        return done

    def handlers(self) -> dict[str, Any]:
        return {
            "await": self.op_await,
            "stats": self.op_stats,
            "gc": self.op_gc,
            "dispatch": self.op_dispatch,
            "profile": Profiler(),
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--kind", choices=["control", "bare"], required=True)
    p.add_argument("--certs", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--cpu", type=int, action="append", default=[])
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    p.add_argument("--control-arg", action="append", default=[],
                   help="one more `twistd llmgw control` argument (repeat it)")
    args = p.parse_args(argv)

    from twisted.internet import epollreactor

    if "twisted.internet.reactor" not in sys.modules:
        epollreactor.install()
    # prometheus_client's Twisted support (the control plane's metrics)
    # imports the global reactor: Linux's default, epoll, already; the
    # reactor twistd llmgw control runs on unless --reactor picks another.
    from twisted.internet import reactor

    if not isinstance(reactor, epollreactor.EPollReactor):
        raise SystemExit(f"bench.target wants the epoll reactor, not {type(reactor).__name__}")

    nofile = raise_nofile()
    cpus = pin(args.cpu)
    log_file = open(args.log, "a")  # noqa: SIM115 (open for the process's life)
    globalLogBeginner.beginLoggingTo(
        [textFileLogObserver(log_file)], redirectStandardIO=False
    )
    target = Target(reactor, args.kind, args.certs, args.heartbeat_interval, args.control_arg)

    def stop() -> None:
        if reactor.running:
            reactor.stop()

    hello = {"ready": True, "kind": args.kind, "port": target.port, "nofile": nofile,
             "join_port": getattr(target, "join_port", 0),
             "cpus": cpus, "reactor": type(reactor).__name__}
    StandardIO(ControlChannel(target.handlers(), hello, stop))
    reactor.run()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
