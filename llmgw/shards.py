"""
A shard in plain data, as both ends of the agent stream see it, and the one
mapping between each record and its protobuf message (DESIGN §3, §5).

L{ShardSpec} is what a C{StartShard} carries: which shard, where on its node,
how it runs and how it is watched. The catalog's per-rank launch
(L{llmgw.control.core.catalog.Profile.launch}), the control plane's command
(L{llmgw.control.state.interfaces.ShardCommand}) and the agent's record of a
live shard (L{llmgw.agent.state.ShardRecord}) all are or hold one.
L{ReportedShard} is an entry of a C{Register}'s running shards and
L{ShardReport} a C{ShardStatus}, each with the node that sent it.

Both ends convert with the records' C{to_message} and C{from_message} only,
so a field added to a message is added at both ends at once. Each record
goes to its message and back unchanged, with one limit of proto3: a zero
cannot be told from a field an older peer did not send, so where zero reads
as the default (a world size, a timeout, an engine) the record's zero does
too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.sourcespec import ModelSource
from llmgw.wire import STATE_VALUES, state_name

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_STARTUP_TIMEOUT_S = 600
DEFAULT_STOP_GRACE_S = 30
DEFAULT_DRAIN_TIMEOUT_S = 60
DEFAULT_ENGINE = "generic"
DEFAULT_STOP_SIGNAL = "SIGTERM"
#: Seconds of requests running with flat progress counters before a replica
#: is wedged, when a profile (or an older control plane) sets none.
DEFAULT_STALL_AFTER_S = 15.0


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """
    Everything an agent needs to start one shard without asking back.

    C{argv} and C{gpu_indices} are tuples, and C{env} and C{metric_names}
    dicts of their own, whatever sequence or mapping they were given as.
    """

    shard_id: str
    replica_id: str
    model: str
    profile: str
    argv: Sequence[str]
    gpu_indices: Sequence[int]
    port: int
    rank: int = 0
    world_size: int = 1
    #: Where rank 0 of a multi-shard replica is reached; "" for rank 0.
    leader_address: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    #: "" means ready while the process lives (no health check).
    health_path: str = DEFAULT_HEALTH_PATH
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    stop_grace_s: int = DEFAULT_STOP_GRACE_S
    drain_timeout_s: int = DEFAULT_DRAIN_TIMEOUT_S
    engine: str = DEFAULT_ENGINE
    #: Where the agent scrapes the engine's metrics; "" for nowhere.
    metrics_path: str = ""
    #: Signal -> metric names ("a,b": first present; "a+b": summed).
    metric_names: Mapping[str, str] = field(default_factory=dict)
    stop_signal: str = DEFAULT_STOP_SIGNAL
    #: The epoch of the control plane that sent it (DESIGN §5): the
    #: dispatcher stamps its own as it sends; 0 in a command not yet sent.
    epoch: int = 0
    #: Where the weights come from, when the agent is to put them on the
    #: node and fill C{{weights}} in C{argv}; C{None}: C{argv} names them.
    source: ModelSource | None = None
    #: Peers' addresses (HOST:PORT) that hold a complete copy of the
    #: source's weights, to fetch from before the source itself.
    model_peers: tuple[str, ...] = ()
    #: The profile's C{stall_after_s}: the agent heartbeats at once when the
    #: shard's standstill reaches it (0: never).
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    #: LoRA adapters the engine starts with, (name, source) in id order.
    adapters: tuple[tuple[str, ModelSource], ...] = ()
    #: How the engine sleeps (0: never; vLLM's level) and after how many
    #: idle seconds (0: never); L{llmgw.agent.sleep}.
    sleep_level: int = 0
    sleep_after_s: float = 0.0

    def __post_init__(self) -> None:
        # Frozen means no caller's list or dict can change a spec afterwards,
        # and a spec read back from the wire or from disk equals the one sent.
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "gpu_indices", tuple(self.gpu_indices))
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "metric_names", dict(self.metric_names))
        object.__setattr__(self, "model_peers", tuple(self.model_peers))
        # A state file keeps the source as the object of its fields.
        if self.source is not None and isinstance(self.source, Mapping):  # None: no ABC check
            object.__setattr__(self, "source", ModelSource(**self.source))
        object.__setattr__(self, "adapters", tuple(
            (str(n), ModelSource(**a) if isinstance(a, Mapping) else a) for n, a in self.adapters))

    def to_message(self) -> pb.StartShard:
        """
        The C{StartShard} that carries this spec.
        """
        return pb.StartShard(
            shard_id=self.shard_id,
            replica_id=self.replica_id,
            model=self.model,
            profile=self.profile,
            rank=self.rank,
            world_size=self.world_size,
            leader_address=self.leader_address,
            argv=self.argv,
            env=self.env,
            gpu_indices=self.gpu_indices,
            port=self.port,
            health_path=self.health_path,
            startup_timeout_s=self.startup_timeout_s,
            stop_grace_s=self.stop_grace_s,
            drain_timeout_s=self.drain_timeout_s,
            epoch=self.epoch,
            engine=self.engine,
            metrics_path=self.metrics_path,
            metric_names=self.metric_names,
            stop_signal=self.stop_signal,
            # An older agent knows no ready_while_alive and reads an empty
            # health path as the default one.
            ready_while_alive=not self.health_path,
            source=source_message(self.source) if self.source is not None else None,
            model_peers=self.model_peers,
            # Left out when it is the default, which the agent reads for none.
            stall_after_s=self.stall_after_s if self.stall_after_s != DEFAULT_STALL_AFTER_S else None,
            adapters=[pb.AdapterSource(name=n, source=source_message(a)) for n, a in self.adapters],
            sleep_level=self.sleep_level,
            sleep_after_s=self.sleep_after_s,
        )

    @classmethod
    def from_message(cls, m: pb.StartShard) -> ShardSpec:
        """
        The spec a C{StartShard} carries; what an older control plane left
        unset takes the default.
        """
        return cls(
            shard_id=m.shard_id,
            replica_id=m.replica_id,
            model=m.model,
            profile=m.profile,
            argv=m.argv,
            gpu_indices=m.gpu_indices,
            port=m.port,
            rank=m.rank,
            world_size=m.world_size or 1,
            leader_address=m.leader_address,
            env=m.env,
            health_path="" if m.ready_while_alive else (m.health_path or DEFAULT_HEALTH_PATH),
            startup_timeout_s=m.startup_timeout_s or DEFAULT_STARTUP_TIMEOUT_S,
            stop_grace_s=m.stop_grace_s or DEFAULT_STOP_GRACE_S,
            drain_timeout_s=m.drain_timeout_s or DEFAULT_DRAIN_TIMEOUT_S,
            epoch=m.epoch,
            engine=m.engine or DEFAULT_ENGINE,
            metrics_path=m.metrics_path,
            metric_names=m.metric_names,
            stop_signal=m.stop_signal or DEFAULT_STOP_SIGNAL,
            source=source_of(m.source) if m.HasField("source") else None,
            model_peers=tuple(m.model_peers),
            stall_after_s=(m.stall_after_s if m.HasField("stall_after_s") and m.stall_after_s >= 0
                           else DEFAULT_STALL_AFTER_S),
            adapters=tuple((a.name, source_of(a.source)) for a in m.adapters),
            sleep_level=m.sleep_level,
            sleep_after_s=m.sleep_after_s if m.sleep_after_s > 0 else 0.0,
        )


def source_message(source: ModelSource) -> pb.ModelSource:
    """
    The C{ModelSource} message that carries C{source}.
    """
    return pb.ModelSource(scheme=source.scheme, repo=source.repo, revision=source.revision,
                          file=source.file, url=source.url, sha256=source.sha256,
                          path=source.path)


def source_of(m: pb.ModelSource) -> ModelSource:
    """
    The source a C{ModelSource} message carries, as sent: whoever uses it
    checks it (L{ModelSource.problem}).
    """
    return ModelSource(scheme=m.scheme, repo=m.repo, revision=m.revision, file=m.file,
                       url=m.url, sha256=m.sha256, path=m.path)


@dataclass(frozen=True)
class ReportedShard:
    """
    A shard an agent says it runs (an entry of C{Register.running_shards}),
    with the node that says so. Starting and stopping shards count too: their
    GPUs and port are held.
    """

    node_id: str
    shard_id: str
    replica_id: str
    model: str
    profile: str
    rank: int
    gpu_indices: Sequence[int]
    port: int
    #: A lowercase state name (L{llmgw.wire.state_name}).
    state: str
    world_size: int = 1
    #: The epoch of the command that started it.
    epoch: int = 0
    #: Its main process group; 0 when none is known.
    pgid: int = 0
    #: The agent lost its record and found its processes by their marker: its
    #: profile is unknown (""), model and replica may be, and it is to be
    #: stopped.
    record_lost: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_indices", tuple(self.gpu_indices))

    @classmethod
    def of_spec(cls, node_id: str, spec: ShardSpec, state: str, pgid: int = 0,
                record_lost: bool = False) -> ReportedShard:
        """
        What a node reports of a shard it started from C{spec}.
        """
        return cls(
            node_id=node_id,
            shard_id=spec.shard_id,
            replica_id=spec.replica_id,
            model=spec.model,
            profile=spec.profile,
            rank=spec.rank,
            gpu_indices=spec.gpu_indices,
            port=spec.port,
            state=state,
            world_size=spec.world_size,
            epoch=spec.epoch,
            pgid=pgid,
            record_lost=record_lost,
        )

    def to_message(self) -> pb.RunningShard:
        """
        The C{RunningShard} that carries this report (the C{Register} that
        holds it names the node).
        """
        return pb.RunningShard(
            shard_id=self.shard_id,
            replica_id=self.replica_id,
            model=self.model,
            profile=self.profile,
            rank=self.rank,
            gpu_indices=self.gpu_indices,
            port=self.port,
            state=STATE_VALUES[self.state],  # type: ignore[arg-type]
            world_size=self.world_size,
            epoch=self.epoch,
            pgid=self.pgid,
            record_lost=self.record_lost,
        )

    @classmethod
    def from_message(cls, node_id: str, m: pb.RunningShard) -> ReportedShard:
        """
        What C{node_id}'s C{RunningShard} says.
        """
        return cls(
            node_id=node_id,
            shard_id=m.shard_id,
            replica_id=m.replica_id,
            model=m.model,
            profile=m.profile,
            rank=m.rank,
            gpu_indices=m.gpu_indices,
            port=m.port,
            state=state_name(m.state),
            world_size=m.world_size or 1,
            epoch=m.epoch,
            pgid=m.pgid,
            record_lost=m.record_lost,
        )


@dataclass(frozen=True)
class ShardReport:
    """
    A shard's transition as its node reported it (a C{ShardStatus}).

    C{state} is one of C{starting}, C{ready}, C{draining}, C{stopping},
    C{stopped}, C{failed}.
    """

    node_id: str
    replica_id: str
    shard_id: str
    state: str
    error: str = ""
    exit_code: int = 0
    signal: int = 0
    #: The end of the shard's output, sent with a failure only.
    last_output: str = ""
    #: The agent's reading of a failure ("oom", ...), "" when none.
    crash_class: str = ""

    def to_message(self) -> pb.ShardStatus:
        """
        The C{ShardStatus} that carries this report (the stream names the
        node).
        """
        return pb.ShardStatus(
            replica_id=self.replica_id,
            shard_id=self.shard_id,
            state=STATE_VALUES[self.state],  # type: ignore[arg-type]
            error=self.error,
            exit_code=self.exit_code,
            signal=self.signal,
            last_output=self.last_output,
            crash_class=self.crash_class,
        )

    @classmethod
    def from_message(cls, node_id: str, m: pb.ShardStatus) -> ShardReport:
        """
        What C{node_id}'s C{ShardStatus} says.
        """
        return cls(
            node_id=node_id,
            replica_id=m.replica_id,
            shard_id=m.shard_id,
            state=state_name(m.state),
            error=m.error,
            exit_code=m.exit_code,
            signal=m.signal,
            last_output=m.last_output,
            crash_class=m.crash_class,
        )
