"""
The agent's end of the agent stream (DESIGN §3, §5, §7).

L{AgentCore} is the factory and holds what outlives a connection: the
supervisor, the GPU monitor, the newest control-plane epoch seen, and
whether the last refusal was a configuration error. L{AgentStreamClient} is
one connection: it sends C{Register} as soon as it is connected, waits for
the C{Ack}, then sends heartbeats on a C{LoopingCall} and a C{ShardStatus}
on every shard transition, and carries out C{StartShard}, C{StopShard},
C{DrainShard} and C{SleepShard}.

L{make_client_service} dials through a C{ClientService} whose retry
policy counts failures itself: the backoff (jittered, capped at 30 s)
resets only once a Register was acknowledged, not when TCP or TLS connects.
(C{prepareConnection} cannot do this: in Twisted 26.10 a connection lost
while it is pending hits C{NoTransition} in C{ClientService}'s state
machine.) A configuration
error (the control plane refused this node's identity or protocol version;
its certificate does not name the dialled address; the handshake was
refused) is logged loudly and retried only at the longest backoff.
"""

from __future__ import annotations

import collections
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from OpenSSL import SSL
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

import llmgw
from llmgw.agent.gpus import GPUMonitor
from llmgw.agent.prefetch import CacheReport, Prefetcher
from llmgw.agent.supervisor import FAILED, STOPPED, Shard, Supervisor
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.shards import ReportedShard, ShardReport, ShardSpec
from llmgw.tlsconf.options import ServerIdentityError
from llmgw.wire import (
    NO_LEADER_MARKER,
    PROTOCOL_VERSION,
    MessageStream,
    parse_redirect,
)

Code = pb.Ack

#: Refusals that no retry can cure without an operator (DESIGN §3).
CONFIG_REFUSALS = {
    Code.CODE_UNAUTHENTICATED,
    Code.CODE_PERMISSION_DENIED,
    Code.CODE_FAILED_PRECONDITION,
}
MAX_BACKOFF = 30.0
INITIAL_BACKOFF = 1.0
#: How long a connected stream may wait for its Register Ack.
REGISTER_ACK_TIMEOUT = 30.0
#: Final statuses (stopped, failed) kept while no stream is open.
MAX_QUEUED_STATUSES = 64
#: Seconds between tries while the control plane's members say none leads.
NO_LEADER_RETRY = 1.0
#: Heartbeat intervals without an acknowledgement (plus a second of slack
#: for a loaded machine) after which a control plane that acknowledges
#: heartbeats is taken for frozen or cut off, and left.
SILENT_HEARTBEATS = 2


def silence_bound(heartbeat_interval: float) -> float:
    """
    Seconds without a heartbeat acknowledgement after which an agent
    leaves a control-plane member that acknowledges them (an HA member).
    """
    return SILENT_HEARTBEATS * heartbeat_interval + 1.0


@dataclass
class AgentConfig:
    """
    Who this agent is and how it talks.
    """

    node_id: str
    control: str = ""
    fabrics: dict[str, str] = field(default_factory=dict)
    heartbeat_interval: float = 5.0
    agent_version: str = llmgw.__version__
    #: Seconds since 1970 when the agent's certificate lapses (0: unknown).
    certificate_not_after: int = 0
    #: The address this node's shards are reached at (--advertise-address);
    #: "" means the local address of the stream to the control plane.
    advertise_address: str = ""


def shard_report(node_id: str, shard: Shard) -> ShardReport:
    """
    What the agent of C{node_id} reports of C{shard}'s state now; the end of
    its output goes only with a failure.
    """
    return ShardReport(
        node_id=node_id,
        replica_id=shard.spec.replica_id,
        shard_id=shard.shard_id,
        state=shard.state,
        error=shard.error,
        exit_code=shard.exit_code,
        signal=shard.signal,
        last_output=shard.last_output() if shard.state == FAILED else "",
        crash_class=shard.crash_class,
    )


def reported_shard(node_id: str, shard: Shard) -> ReportedShard:
    """
    How the agent of C{node_id} lists C{shard} in its C{Register}.
    """
    return ReportedShard.of_spec(node_id, shard.spec, shard.state, pgid=shard.pid or 0,
                                 record_lost=shard.record_lost)


def describe_failure(failure: Failure) -> tuple[str, bool]:
    """
    What a lost connection before registration means: a sentence for the
    log, and whether it is a configuration error.
    """
    e = failure.value
    if isinstance(e, ServerIdentityError):
        return str(e), True
    if isinstance(e, SSL.Error):
        text = str(e)
        if "alert" in text or "certificate" in text:
            # Under TLS 1.3 a refused client certificate arrives as an alert on
            # the first read, after the client thought the handshake done.
            return (
                f"the TLS handshake was refused ({text}): the control plane does not "
                "accept this node's certificate, or its own is not from our CA", True,
            )
        return f"TLS error: {text}", False
    return failure.getErrorMessage() or type(e).__name__, False


class AgentStreamClient(MessageStream[pb.ControlMessage]):
    """
    One connection to the control plane.
    """

    incoming = pb.ControlMessage
    log = Logger()

    def __init__(self, core: AgentCore):
        self.core = core
        #: Fires with True once the Register is acknowledged, or False when
        #: the stream closes before that.
        self.registered: defer.Deferred[bool] = defer.Deferred()
        self.is_registered = False
        self._heartbeat: LoopingCall | None = None
        self._ack_timer: IDelayedCall | None = None
        #: This stream dials the member whose avoidance for its silence
        #: lapsed (L{ControlTargets.probing}).
        self._probing = False
        self._refusal: tuple[str, bool] | None = None
        #: This stream was refused with a redirect that is followed; and the
        #: control plane acknowledges heartbeats (a member of an HA control
        #: plane does), so silence means it is gone.
        self._redirected = False
        self._last_heartbeat_ack = 0.0
        #: Fires when the member has acknowledged nothing for
        #: L{silence_bound}: re-armed by every acknowledgement.
        self._silence: IDelayedCall | None = None

    def peer_name(self) -> str:
        return self.core.config.control or super().peer_name()

    def connectionMade(self) -> None:
        # Under TLS this is TCP connect; the Register waits in the TLS layer
        # until the handshake is done.
        self.core.attach(self)
        self.core.learn_address(self.transport)
        self.send_message(pb.AgentMessage(register=self.core.register_message()))
        targets = self.core.targets
        self._probing = targets is not None and targets.probing == self.peer_name()
        # A member left for its silence and dialled again may still be
        # frozen (its kernel accepts the connection, nothing answers): it
        # gets as long as its silence was allowed, not the Register timeout.
        timeout = silence_bound(self.core.config.heartbeat_interval) if self._probing else REGISTER_ACK_TIMEOUT
        self._ack_timer = self.core.clock.callLater(timeout, self._ack_expired)

    def _ack_expired(self) -> None:
        self._ack_timer = None
        if self._probing:
            self.log.warn("the control plane at {control}, left for its silence, is silent still; "
                          "leaving it for the other members at once", control=self.peer_name())
            self.core.left_silent(self.peer_name())
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        self.log.warn("no Register Ack from the control plane at {control} within {timeout}s; "
                      "reconnecting", control=self.peer_name(), timeout=REGISTER_ACK_TIMEOUT)
        self.transport.abortConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if self._ack_timer is not None and self._ack_timer.active():
            self._ack_timer.cancel()
        self._ack_timer = None
        self._disarm_silence()
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        self.core.detach(self)
        if self.is_registered and self.core.stopping:
            self.log.info("stream to the control plane at {control} closed: the agent is "
                          "stopping; its shards keep running", control=self.peer_name())
            return
        if self.is_registered:
            self.log.warn("stream to the control plane at {control} closed: {reason}; shards keep "
                          "running, reconnecting", control=self.peer_name(),
                          reason=reason.getErrorMessage())
            if self.core.targets is not None:
                # The member may be gone (a leader killed): the next dial
                # goes to the next one, which names the new leader.
                self.core.targets.failed()
            return
        if self._redirected:
            self.registered.callback(False)
            return
        if self._refusal is not None:
            why, config = self._refusal
        else:
            why, config = describe_failure(reason)
        self.core.connection_failed(why, config)
        self.registered.callback(False)

    # -- inbound --------------------------------------------------------------

    def frame_refused(self, reason: str) -> None:
        self.log.warn("ignoring a frame from the control plane at {control}: {reason}",
                      control=self.peer_name(), reason=reason)

    def message_received(self, msg: pb.ControlMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "ack":
            self._ack(msg.ack)
        elif kind == "start":
            if self.core.accept_epoch("StartShard", msg.start.shard_id, msg.start.epoch):
                self.core.supervisor.start(ShardSpec.from_message(msg.start))
        elif kind == "stop":
            if self.core.accept_epoch("StopShard", msg.stop.shard_id, msg.stop.epoch):
                self.core.supervisor.stop(msg.stop.shard_id)
        elif kind == "drain":
            if self.core.accept_epoch("DrainShard", msg.drain.shard_id, msg.drain.epoch):
                self.core.supervisor.drain(msg.drain.shard_id)
        elif kind == "prefetch":
            if self.core.accept_epoch("PrefetchModel", msg.prefetch.pin, msg.prefetch.epoch):
                self.core.prefetcher.prefetch(msg.prefetch)
        elif kind == "drop":
            if self.core.accept_epoch("DropModel", msg.drop.pin, msg.drop.epoch):
                self.core.prefetcher.drop(msg.drop)
        elif kind == "sleep" and self.core.accept_epoch("SleepShard", msg.sleep.shard_id, msg.sleep.epoch):
            self.core.sleep_shard(msg.sleep.shard_id)
        elif kind == "load_adapter" and self.core.accept_epoch("LoadAdapter", msg.load_adapter.shard_id, msg.load_adapter.epoch):
            self.core.supervisor.weights.adapters.load(self.core.supervisor, msg.load_adapter)
        elif kind == "certificate_issued" and self.core.renewal is not None:
            self.core.renewal.issued(msg.certificate_issued)

    def _ack(self, ack: pb.Ack) -> None:
        if ack.message_id == "certificate":
            # About a renewal only: never a reason to leave the stream.
            if self.core.renewal is not None:
                self.core.renewal.answered(ack)
            return
        if ack.ok:
            if ack.message_id == "register" and not self.is_registered:
                self._registered()
            elif ack.message_id == "heartbeat":
                self.core.heartbeat_acks = True
                self._last_heartbeat_ack = self.core.clock.seconds()
                self._arm_silence()
            else:
                self.log.debug("control plane acknowledged {id}", id=ack.message_id)
            return
        code = pb.Ack.Code.Name(ack.code)
        if ack.message_id.startswith("shard:"):
            self.log.warn("the control plane refused our status for shard {shard}: {error} "
                          "({code})", shard=ack.message_id[len("shard:"):], error=ack.error,
                          code=code)
            return
        # A member of an HA control plane that does not lead names the leader.
        leader = parse_redirect(ack.error) if ack.code == Code.CODE_FAILED_PRECONDITION else None
        if leader is not None and self.core.redirect(leader, self.peer_name()):
            self._redirected = True
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        config = ack.code in CONFIG_REFUSALS and leader is None
        if NO_LEADER_MARKER in ack.error:
            self.core.no_leader = True
        self._refusal = (f"the control plane refused this agent ({code}): {ack.error}", config)
        self.transport.loseConnection()  # type: ignore[union-attr]

    def _registered(self) -> None:
        self.is_registered = True
        if self._ack_timer is not None and self._ack_timer.active():
            self._ack_timer.cancel()
        self._ack_timer = None
        self._heartbeat = LoopingCall(self.send_heartbeat)
        self._heartbeat.clock = self.core.clock
        self._heartbeat.start(self.core.config.heartbeat_interval, now=False)
        self._last_heartbeat_ack = self.core.clock.seconds()
        if self.core.heartbeat_acks:
            # This control plane acknowledged heartbeats before: silence
            # counts from now, before its first acknowledgement.
            self._arm_silence()
        self.core.registered(self)
        self.registered.callback(True)

    def _arm_silence(self) -> None:
        self._disarm_silence()
        self._silence = self.core.clock.callLater(
            silence_bound(self.core.config.heartbeat_interval), self._silent)

    def _disarm_silence(self) -> None:
        if self._silence is not None and self._silence.active():
            self._silence.cancel()
        self._silence = None

    def _silent(self) -> None:
        # On its own timer rather than at the next heartbeat: a frozen
        # member (SIGSTOP: the connection stays open, nothing answers) is
        # left as soon as the bound passes.
        self._silence = None
        if self.transport is None or self.transport.disconnecting:  # type: ignore[attr-defined]
            return
        silence = self.core.clock.seconds() - self._last_heartbeat_ack
        self.log.warn("the control plane at {control} acknowledged no heartbeat for {silence:.1f}s; "
                      "leaving it for the other members at once", control=self.peer_name(), silence=silence)
        self.core.left_silent(self.peer_name())
        self.transport.abortConnection()  # type: ignore[union-attr]

    # -- outbound --------------------------------------------------------------

    def send_heartbeat(self) -> None:
        try:
            self.send_message(pb.AgentMessage(heartbeat=self.core.heartbeat_message()))
        except Exception:
            self.log.failure("sending a heartbeat failed")

    def send_status(self, status: pb.ShardStatus) -> None:
        self.send_message(pb.AgentMessage(shard=status))


class AgentCore(Factory):
    """
    The agent's state that outlives connections, and the factory of
    L{AgentStreamClient}s.
    """

    log = Logger()
    noisy = False

    def __init__(
        self,
        config: AgentConfig,
        supervisor: Supervisor,
        monitor: GPUMonitor,
        clock: Any,
        epoch_file: Path | None = None,
        max_backoff: float = MAX_BACKOFF,
        jitter: Callable[[], float] = random.random,
        scraper: Any = None,
        model_cache: Any = None,
    ):
        self.config = config
        #: The node's weight cache (L{llmgw.models.cache.ModelCache}), or
        #: None; its content travels in Register and heartbeats, and
        #: prefetch commands fill it (the peer listener's address is
        #: L{peer_address}'s).
        self.model_cache = model_cache
        self.cache_report = CacheReport(model_cache)
        self.prefetcher = Prefetcher(model_cache)
        self.supervisor = supervisor
        self.monitor = monitor
        self.clock = clock
        self.epoch_file = epoch_file
        self.max_backoff = max_backoff
        self.jitter = jitter
        self._policy = backoffPolicy(INITIAL_BACKOFF, max_backoff, 2.0, jitter)
        self.newest_epoch = self._load_epoch()
        self.proto: AgentStreamClient | None = None
        self.config_error: str | None = None
        #: Why the last connection attempt failed, if it did.
        self.last_failure: str | None = None
        #: Connection attempts that failed since the last acknowledged Register.
        self.failures = 0
        self._queued: collections.deque[pb.ShardStatus] = collections.deque(maxlen=MAX_QUEUED_STATUSES)
        #: Set while the agent shuts down: a closing stream is expected then.
        self.stopping = False
        #: The control plane's members this agent knows
        #: (L{llmgw.agent.targets.ControlTargets}), when it was given them;
        #: a redirect to follow at once; members said none leads.
        self.targets: Any = None
        self._redirect_pending = False
        self.no_leader = False
        #: The control plane acknowledges heartbeats (an HA member does):
        #: its silence means it is frozen or cut off.
        self.heartbeat_acks = False
        #: Registrations that were acknowledged, for tests and metrics.
        self.registrations = 0
        #: Renews the node's certificate over the stream
        #: (L{llmgw.agent.renewal.CertificateRenewal}), or None.
        self.renewal: Any = None
        #: Puts a shard's engine to sleep now (L{llmgw.agent.sleep.Sleeper.sleep_now}).
        self.sleep_shard: Callable[[str], object] = lambda shard_id: None
        #: Engine signals for heartbeats (L{llmgw.agent.scrape.Scraper}), or None.
        self.scraper = scraper
        if scraper is not None:
            scraper.on_stall = self.heartbeat_now
        #: The address shards are advertised at: the configured one, else
        #: learned from each connection (L{learn_address}).
        self.advertised = config.advertise_address
        #: The peer listener's HOST:PORT for Register, given the advertised
        #: host (L{llmgw.agent.peers.AgentPeers.reported}); "": none.
        self.peer_address: Callable[[str], str] = lambda advertised: ""
        if self.advertised:
            supervisor.probe_host = self.advertised
        supervisor.add_listener(self.shard_changed)

    def buildProtocol(self, addr: Any) -> AgentStreamClient:
        return AgentStreamClient(self)

    # -- backoff -----------------------------------------------------------------

    def retry_delay(self, attempt: int) -> float:
        """
        The delay before reconnect attempt C{attempt}: exponential with
        jitter, capped; always the cap after a configuration error.
        """
        if self.config_error is not None:
            return self.max_backoff + self.jitter()
        if self._redirect_pending:
            # No backoff for a redirect (they are bounded in ControlTargets),
            # nor after leaving a silent member: the others are alive.
            self._redirect_pending = False
            return 0.0
        if self.no_leader:
            self.no_leader = False
            return NO_LEADER_RETRY + self.jitter() * NO_LEADER_RETRY
        # ClientService's own count resets when TCP connects; ours only when
        # a Register is acknowledged. A registered stream that closed counts 1.
        return self._policy(max(self.failures, 1) - 1)

    def left_silent(self, member: str) -> None:
        """
        The stream to C{member} was left because it fell silent: dial the
        next member at once, and follow no redirect back to C{member} until
        a registration (the members name it as leader until etcd's lease
        on it runs out).
        """
        self._redirect_pending = True
        if self.targets is not None:
            self.targets.left_silent(member)

    def redirect(self, leader: str, by: str) -> bool:
        """
        The control-plane member C{by} does not lead and names C{leader};
        whether the agent goes there next (at once).
        """
        if self.targets is not None and self.targets.is_silent(leader):
            # The member just left for its silence: the others name it until
            # a new leader is elected, so ask again soon rather than wait on it.
            self.no_leader = True
            self.log.info("the control plane at {by} names {leader} as the leader, which fell silent; "
                          "asking again until another leads", by=by, leader=leader)
            return False
        if self.targets is None or not self.targets.redirect(leader):
            return False
        self._redirect_pending = True
        self.log.info("the control plane at {by} is not the leader; going to the leader at {leader}",
                      by=by, leader=leader)
        return True

    def connection_failed(self, why: str, config: bool) -> None:
        self.failures += 1
        self.last_failure = why
        if self.targets is not None and not config:
            self.targets.failed()
        if config:
            self.config_error = why
            self.log.critical(
                "CONFIGURATION ERROR connecting to the control plane at {control}: {why}. "
                "Retrying every {delay}s until it is fixed.",
                control=self.config.control, why=why, delay=self.max_backoff)
        else:
            self.log.warn("connection to the control plane at {control} failed before "
                          "registering: {why}", control=self.config.control, why=why)

    # -- epochs --------------------------------------------------------------------

    def _load_epoch(self) -> int:
        newest = max((s.spec.epoch for s in self.supervisor.shards.values()), default=0)
        if self.epoch_file is not None:
            try:
                newest = max(newest, int(self.epoch_file.read_text().strip() or 0))
            except (OSError, ValueError):
                pass
        return newest

    def accept_epoch(self, what: str, shard_id: str, epoch: int) -> bool:
        """
        Whether a command from C{epoch} may run: not older than the newest
        epoch seen (DESIGN §5). A newer epoch becomes the newest.
        """
        if epoch < self.newest_epoch:
            self.log.warn(
                "refusing {what} for shard {shard} from control plane epoch {epoch}: a newer "
                "control plane (epoch {newest}) has spoken since",
                what=what, shard=shard_id, epoch=epoch, newest=self.newest_epoch)
            return False
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
            self._save_epoch()
        return True

    def _save_epoch(self) -> None:
        if self.epoch_file is None:
            return
        tmp = self.epoch_file.with_name(f".{self.epoch_file.name}.tmp")
        try:
            tmp.write_text(f"{self.newest_epoch}\n")
            os.replace(tmp, self.epoch_file)
        except OSError:
            self.log.failure("could not record the control plane epoch in {path}",
                             path=str(self.epoch_file))

    # -- messages ------------------------------------------------------------------

    def register_message(self) -> pb.Register:
        reg = self._register_message()
        self.cache_report.fill_register(reg)
        return reg

    def _register_message(self) -> pb.Register:
        gpus = [
            pb.GPU(index=g.index, uuid=g.uuid, name=g.name, memory_total_mb=g.memory_total_mb,
                   memory_used_mb=g.memory_used_mb, problems=list(g.problems))
            for g in self.monitor.gpus()
        ]
        # The Register carries every problem; none is new after it.
        self.monitor.forget_new_problems()
        return pb.Register(
            protocol_version=PROTOCOL_VERSION,
            node_id=self.config.node_id,
            agent_version=self.config.agent_version,
            gpus=gpus,
            fabrics=[pb.Fabric(name=n, address=a) for n, a in sorted(self.config.fabrics.items())],
            # Stopping shards too: their GPUs and ports are held until their
            # process groups are empty.
            running_shards=[reported_shard(self.config.node_id, s).to_message()
                            for s in self.supervisor.held_shards()],
            certificate_not_after=self.config.certificate_not_after,
            stray_processes=[
                pb.StrayProcess(pid=p.pid, pgid=p.pgid, shard_id=p.shard_id, reason=p.reason,
                                command=p.command)
                for p in self.supervisor.live_strays()
            ],
            advertise_address=self.advertised,
            peer_address=self.peer_address(self.advertised),
        )

    def heartbeat_now(self, why: str = "") -> None:
        """
        Send a heartbeat now, outside the interval, if registered: a shard's
        standstill reached its threshold, and the control plane must not
        wait a whole interval to hear it.
        """
        proto = self.proto
        if proto is not None and proto.is_registered and proto.transport is not None:
            proto.send_heartbeat()

    def heartbeat_message(self) -> pb.Heartbeat:
        hb = self._heartbeat_message()
        self.cache_report.fill_heartbeat(hb)
        return hb

    def _heartbeat_message(self) -> pb.Heartbeat:
        problems = self.monitor.take_new_problems()
        return pb.Heartbeat(
            gpu_memory_used_mb=self.monitor.memory_used(),
            new_problems=[p.problem for p in problems],
            new_gpu_problems=[
                pb.GPUProblem(gpu_index=p.gpu_index, problem=p.problem)
                for p in problems if p.gpu_index >= 0
            ],
            shard_signals=self.scraper.heartbeat_signals() if self.scraper is not None else [],
            fetches=[pb.FetchProgress(shard_id=sid, done=done, total=total, rate=rate)
                     for sid, done, total, rate in self.supervisor.fetch_progress()],
        )

    def learn_address(self, transport: Any) -> None:
        """
        Without --advertise-address, advertise the local address of the
        stream to the control plane: the one it can reach us at.
        """
        if self.config.advertise_address:
            return
        host = getattr(getattr(transport, "getHost", lambda: None)(), "host", "")
        if host and host != self.advertised:
            if self.advertised:
                self.log.warn("this node's address changed from {old} to {new}; shards started "
                              "before keep the old one in their commands", old=self.advertised,
                              new=host)
            self.advertised = host
            self.supervisor.probe_host = host

    # -- connection map ----------------------------------------------------------------

    def attach(self, proto: AgentStreamClient) -> None:
        self.proto = proto

    def detach(self, proto: AgentStreamClient) -> None:
        if self.proto is proto:
            self.proto = None

    def registered(self, proto: AgentStreamClient) -> None:
        self.registrations += 1
        self.failures = 0
        if self.targets is not None:
            self.targets.registered()
        self.last_failure = None
        if self.config_error is not None:
            self.log.info("the configuration error is resolved: registered with the control "
                          "plane at {control}", control=self.config.control)
        self.config_error = None
        self.log.info(
            "registered with the control plane at {control} as {node}: {gpus} GPUs, "
            "{running} running shards",
            control=self.config.control, node=self.config.node_id,
            gpus=len(self.monitor.gpus()), running=len(self.supervisor.live_shards()),
        )
        while self._queued and self.proto is proto:
            proto.send_status(self._queued.popleft())
        if self.renewal is not None:
            self.renewal.registered()

    def shard_changed(self, shard: Shard) -> None:
        """
        A shard transition: send it now, or keep a final one for the next
        stream (live states travel in the next Register anyway).
        """
        status = shard_report(self.config.node_id, shard).to_message()
        if self.proto is not None and self.proto.transport is not None:
            self.proto.send_status(status)
        elif shard.state in (STOPPED, FAILED):
            self._queued.append(status)


def make_client_service(core: AgentCore, endpoint: Any) -> ClientService:
    """
    Dial C{endpoint} forever, with L{AgentCore.retry_delay} between
    attempts.
    """
    service = ClientService(
        _LoggingEndpoint(endpoint, core),
        core,
        retryPolicy=core.retry_delay,
        clock=core.clock,
    )
    service.setName("agent-stream")
    return service


@implementer(IStreamClientEndpoint)
class _LoggingEndpoint:
    """
    An endpoint that logs why a connection attempt failed before any
    protocol existed (refused, unreachable, timed out).
    """

    def __init__(self, endpoint: Any, core: AgentCore):
        self.endpoint = endpoint
        self.core = core

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        d = self.endpoint.connect(factory)

        def failed(f: Failure) -> Failure:
            if not f.check(defer.CancelledError):
                self.core.connection_failed(f"cannot connect: {f.getErrorMessage()}", False)
            return f

        return d.addErrback(failed)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<control plane {self.core.config.control}>"
