"""
One agent's stream on the control plane's side (DESIGN §5), from TCP accept
to close: the TLS handshake and the identity its certificate proves, the
Register and what it is checked against, the node's heartbeats and shard
statuses handed to the inventory and the status sink, and the commands
written to the node, queued while its transport is paused.

The streams of all nodes, and the delivery of commands to them, are
L{llmgw.control.shell.agentsvc.AgentService}'s.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from OpenSSL import SSL
from twisted.internet.interfaces import IDelayedCall, IHandshakeListener, IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.joining import certificate_requested
from llmgw.control.shell.limits import (
    MessageRate,
    connection_registered,
    pause_reading,
    resume_reading,
)
from llmgw.control.state.interfaces import NotConnected, NotKeepingUp
from llmgw.control.state.inventory import GPUInfo, Node, StrayProcess, bounded_strays
from llmgw.control.state.modelindex import CachedCopy, CacheRoom
from llmgw.engines import advertise_address_problem
from llmgw.shards import ReportedShard, ShardReport
from llmgw.tlsconf.options import IdentityError, peer_node_id
from llmgw.wire import (
    PROTOCOL_VERSION,
    InvalidNodeId,
    MessageStream,
    ack,
    validate_node_id,
)

if TYPE_CHECKING:
    from llmgw.control.shell.agentsvc import AgentService

Code = pb.Ack

#: A refused peer gets this long to read its Ack before the connection is aborted.
REFUSAL_LINGER = 5.0


def node_from_register(reg: pb.Register, address: str, now: float) -> Node:
    """
    The inventory record for a C{Register}.
    """
    return Node(
        id=reg.node_id,
        gpus=[
            GPUInfo(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total_mb=g.memory_total_mb,
                memory_used_mb=g.memory_used_mb,
                problems=list(g.problems),
            )
            for g in reg.gpus
        ],
        fabrics={f.name: f.address for f in reg.fabrics},
        agent_version=reg.agent_version,
        # The address the agent advertises for its shards wins.
        address=reg.advertise_address or address,
        last_seen=now,
        registered_at=now,
        certificate_not_after=float(reg.certificate_not_after),
        stray_processes=bounded_strays(
            StrayProcess(pid=p.pid, pgid=p.pgid, shard_id=p.shard_id, reason=p.reason, command=p.command)
            for p in reg.stray_processes
        ),
    )


def cached_copies(msgs: Iterable[pb.CachedModel]) -> list[CachedCopy]:
    """
    A cache report's models as the inventory keeps them.
    """
    return [CachedCopy(key=m.key, source=m.source, size=m.size, state=m.state,
                       last_used=m.last_used, revision=m.revision) for m in msgs]


def peer_address_problem(address: str) -> str | None:
    """
    What is wrong with a Register's C{peer_address} (HOST:PORT, IPv6 in
    brackets), or C{None} (empty is fine: no peer listener).
    """
    if not address:
        return None
    host, sep, port = address.rpartition(":")
    if (not sep or not host or len(address) > 300 or not port.isdigit()
            or not 0 < int(port) < 65536 or any(c.isspace() for c in address)):
        return f"peer_address {address[:300]!r} is not HOST:PORT"
    return None


def _validate_register(reg: pb.Register) -> str | None:
    """
    What is wrong with a C{Register}'s content, or C{None}.
    """
    indices = [g.index for g in reg.gpus]
    if len(set(indices)) != len(indices):
        return f"GPU indices repeat: {sorted(indices)}"
    shard_ids = [s.shard_id for s in reg.running_shards]
    if any(not s for s in shard_ids):
        return "a running shard has no shard_id"
    if len(set(shard_ids)) != len(shard_ids):
        return "running shard ids repeat"
    return advertise_address_problem(reg.advertise_address)


@implementer(IHandshakeListener, IPushProducer)
class AgentStreamProtocol(MessageStream[pb.AgentMessage]):
    """
    One agent's stream, from TCP accept to close.

    It speaks for exactly one node once registered: the node its verified
    certificate names.
    """

    incoming = pb.AgentMessage
    log = Logger()

    node_id: str | None = None
    #: The node id the client certificate proves, once the handshake is done.
    identity: str | None = None
    identity_error: str | None = None
    #: The client certificate's serial number, once the handshake is done
    #: (so a CRL loaded later can find the streams it revokes).
    certificate_serial: int | None = None

    def __init__(self, factory: AgentService):
        self.factory = factory
        self.MAX_LENGTH = factory.max_frame
        self._paused = False
        self._pending: collections.deque[pb.ControlMessage] = collections.deque()
        self._timer: IDelayedCall | None = None
        self._reported_running: set[str] = set()
        self._producing = False
        self._closing = False
        self.rate: MessageRate | None = None
        if factory.message_rate > 0:
            self.rate = MessageRate(
                factory.clock, factory.message_rate, factory.message_burst,
                lambda: pause_reading(self), lambda: resume_reading(self), self.peer_name,
            )

    # -- connection lifetime ------------------------------------------------

    def connectionMade(self) -> None:
        self.factory.opened(self)
        if self.factory.tls:
            # For TLS this runs at TCP accept, before the handshake.
            self._set_timer(self.factory.handshake_timeout, self._handshake_expired)
        else:
            self._start_streaming()

    def handshakeCompleted(self) -> None:
        cert = self.transport.getPeerCertificate()
        if cert is None:
            self.identity_error = "the agent presented no client certificate"
        else:
            self.certificate_serial = cert.get_serial_number()
            try:
                self.identity = peer_node_id(cert.to_cryptography())
            except IdentityError as e:
                self.identity_error = str(e)
        self._start_streaming()

    def _start_streaming(self) -> None:
        if not self._producing:
            self.transport.registerProducer(self, True)
            self._producing = True
        self._set_timer(self.factory.register_timeout, self._register_expired)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self._cancel_timer()
        self._pending.clear()
        if self.rate is not None:
            self.rate.stop()
        self.factory.closed(self)
        if self.identity is None and self.identity_error is None and reason.check(SSL.Error):
            # The handshake failed: a revoked, expired or foreign certificate.
            self.log.warn(
                "TLS handshake from {peer} failed: {reason}",
                peer=self.peer_name(),
                reason=reason.getErrorMessage(),
            )
        if self.node_id is not None:
            self.factory.detach(self.node_id, self)
            self.log.info(
                "agent stream for {node} closed: {reason}",
                node=self.node_id,
                reason=reason.getErrorMessage(),
            )

    def _set_timer(self, seconds: float, fn: Any) -> None:
        timer = self._timer
        if timer is not None and timer.active() and getattr(timer, "func", None) == fn:
            # Every message pushes the silence deadline back: moving the
            # pending call allocates nothing, where a new call per heartbeat
            # (2,000 a second at 10,000 agents) fed the cyclic collector.
            timer.reset(seconds)
            return
        self._cancel_timer()
        self._timer = self.factory.clock.callLater(seconds, fn)

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _handshake_expired(self) -> None:
        self._timer = None
        self.log.warn(
            "aborting connection from {peer}: TLS handshake not done within {timeout}s",
            peer=self.peer_name(),
            timeout=self.factory.handshake_timeout,
        )
        self.factory.count_registration("handshake_timeout")
        self.transport.abortConnection()

    def _register_expired(self) -> None:
        self._timer = None
        self.log.warn(
            "closing connection from {peer}: no Register within {timeout}s",
            peer=self.peer_name(),
            timeout=self.factory.register_timeout,
        )
        self.factory.count_registration("register_timeout")
        self.transport.abortConnection()

    def _silence_expired(self) -> None:
        # Read first, then judge: after a pause of this process's own (it
        # was stopped, say), the reactor runs due timers before it reads the
        # sockets, where the heartbeats that prove the peer alive may be
        # waiting. A call scheduled now runs only after the next read; any
        # message received before it resets the timer.
        self._timer = self.factory.clock.callLater(0, self._silence_confirmed)

    def _silence_confirmed(self) -> None:
        self._timer = None
        self.log.warn(
            "closing the stream of {node} ({peer}): silent for {timeout}s "
            "(the node's state is left to expiry)",
            node=self.node_id,
            peer=self.peer_name(),
            timeout=self.factory.silence_timeout,
        )
        self.transport.abortConnection()

    def abort(self) -> None:
        self._closing = True
        self.transport.abortConnection()

    # -- inbound ------------------------------------------------------------

    def peer_name(self) -> str:
        peer = self.transport.getPeer() if self.transport else None
        host = getattr(peer, "host", "?")
        port = getattr(peer, "port", "?")
        who = f"{host}:{port}"
        if self.identity:
            who += f" (certificate {self.identity})"
        return who

    def frame_refused(self, reason: str) -> None:
        self._refuse(Code.CODE_INVALID_ARGUMENT, reason, message_id="frame")

    def lengthLimitExceeded(self, length: int) -> None:  # noqa: N802
        # Counted by cause for llmgw_agent_frames_refused.
        self.factory.frames_refused["oversized"] += 1
        super().lengthLimitExceeded(length)

    def message_received(self, msg: pb.AgentMessage) -> None:
        if self._closing:
            return
        if self.rate is not None:
            # Over its rate, the agent is not read until the bucket refills.
            self.rate.taken()
        kind = msg.WhichOneof("msg")
        if self.node_id is None:
            if kind != "register":
                self._refuse(
                    Code.CODE_INVALID_ARGUMENT,
                    f"the first message must be a Register, not a {kind}",
                )
                return
            self._register(msg.register)
            return
        # Any message at all proves the node is alive.
        self._set_timer(self.factory.silence_timeout, self._silence_expired)
        self.factory.inventory.touch(self.node_id, self.factory.clock.seconds())
        if kind == "heartbeat":
            self._heartbeat(msg.heartbeat)
        elif kind == "shard":
            self._shard_status(msg.shard)
        elif kind == "register":
            self._reregister(msg.register)
        elif kind == "certificate_request":
            certificate_requested(self, msg.certificate_request)

    def _refuse(self, code: int, error: str, message_id: str = "register") -> None:
        """
        Tell the peer what was wrong, log it with who sent it, and close.
        """
        self.log.warn(
            "refusing agent stream from {peer} (node {node}): {error}",
            peer=self.peer_name(),
            node=self.node_id or "unregistered",
            error=error,
            code=pb.Ack.Code.Name(code),
        )
        if self.node_id is None:
            self.factory.count_registration(pb.Ack.Code.Name(code).removeprefix("CODE_").lower())
        self._closing = True
        self._cancel_timer()
        self.send_message(ack(message_id, ok=False, code=code, error=error))
        # A transport with a registered producer waits for it to unregister
        # before it closes.
        if self._producing:
            self.transport.unregisterProducer()
            self._producing = False
        self.transport.loseConnection()
        # A peer that never reads its refusal must not hold the socket.
        self._timer = self.factory.clock.callLater(REFUSAL_LINGER, self.transport.abortConnection)

    def _check_identity(self, claimed: str) -> tuple[int, str] | None:
        if self.identity is not None:
            if self.identity != claimed:
                return (
                    Code.CODE_PERMISSION_DENIED,
                    f"certificate authorizes node {self.identity!r}, not {claimed!r}",
                )
            return None
        if self.factory.require_identity:
            why = self.identity_error or "no verified client certificate"
            return Code.CODE_UNAUTHENTICATED, f"no verified node identity: {why}"
        return None

    def _register(self, reg: pb.Register) -> None:
        if reg.protocol_version != PROTOCOL_VERSION:
            self._refuse(
                Code.CODE_FAILED_PRECONDITION,
                f"protocol version {reg.protocol_version} is not supported "
                f"(this control plane speaks {PROTOCOL_VERSION})",
            )
            return
        try:
            validate_node_id(reg.node_id)
        except InvalidNodeId as e:
            self._refuse(Code.CODE_INVALID_ARGUMENT, str(e))
            return
        refusal = self._check_identity(reg.node_id)
        if refusal is not None:
            self._refuse(*refusal)
            return
        problem = _validate_register(reg)
        if problem is not None:
            self._refuse(Code.CODE_INVALID_ARGUMENT, problem)
            return
        # A member of an HA control plane that does not lead names the leader.
        if self.factory.gate is not None:
            refusal = self.factory.gate()
            if refusal is not None:
                self._refuse(*refusal)
                return
        if not self.factory.admit(reg.node_id):
            self._refuse(
                Code.CODE_RESOURCE_EXHAUSTED,
                f"this control plane holds its maximum of {self.factory.max_nodes} agents",
            )
            return

        node_id = reg.node_id
        now = self.factory.clock.seconds()
        host = getattr(self.transport.getPeer(), "host", "")
        self.factory.inventory.upsert(node_from_register(reg, host, now))
        self._cache_report(reg)
        self.node_id = node_id
        self.factory.attach(node_id, self)
        self.factory.count_registration("ok")
        # One line per registration, 10,000 in a storm: the text is made
        # here with an f-string, and the format has few fields, because
        # the log observer's PEP 3101 formatting costs per field. The
        # parts stay in the event as fields of their own.
        gpus = len(reg.gpus)
        fabrics = ",".join([f.name for f in reg.fabrics]) or "none"
        running = len(reg.running_shards)
        self.log.info(
            "agent {node} registered from {peer}: {summary}",
            node=node_id,
            peer=self.peer_name(),
            summary=f"{gpus} GPUs, fabrics {fabrics}, {running} running shards, "
            f"agent version {reg.agent_version}",
            gpus=gpus,
            fabrics=fabrics,
            running=running,
            version=reg.agent_version,
        )
        self.send_message(ack("register"))
        self._warn_unaccounted(node_id, reg)
        self._set_timer(self.factory.silence_timeout, self._silence_expired)
        # Out of the agent port's admission gate: the next connection may come in.
        connection_registered(self.transport)

        # Adoption comes before any other command, so the reconciler never
        # concludes the node is empty and places duplicates (DESIGN §6.5).
        shards = [ReportedShard.from_message(node_id, s) for s in reg.running_shards]
        self._reported_running = {s.shard_id for s in shards}
        if shards:
            # The sink stops what it does not claim, once this handler has
            # returned: nothing here dispatches.
            unclaimed = self.factory.sink.adopt(node_id, shards)
            for shard in unclaimed:
                self.log.warn(
                    "shard {shard} on {node} is unclaimed and will be stopped: nothing in the "
                    "catalog claims it (model {model}, profile {profile})",
                    node=node_id,
                    shard=shard.shard_id,
                    model=shard.model,
                    profile=shard.profile,
                )
        else:
            # An empty report still tells the sink the node runs nothing.
            self.factory.sink.adopt(node_id, [])
        self.factory.sink.node_registered(node_id)

    def _reregister(self, reg: pb.Register) -> None:
        # The node's hardware changed (a GPU fell off, say): take the new view.
        if reg.node_id != self.node_id:
            self._refuse(
                Code.CODE_PERMISSION_DENIED,
                f"this stream speaks for node {self.node_id!r}, not {reg.node_id!r}",
            )
            return
        problem = _validate_register(reg)
        if reg.protocol_version != PROTOCOL_VERSION:
            problem = f"protocol version changed to {reg.protocol_version}"
        if problem is not None:
            self._refuse(Code.CODE_INVALID_ARGUMENT, problem)
            return
        now = self.factory.clock.seconds()
        host = getattr(self.transport.getPeer(), "host", "")
        self.factory.inventory.upsert(node_from_register(reg, host, now))
        self._cache_report(reg)
        self._reported_running |= {s.shard_id for s in reg.running_shards}
        self.log.info(
            "agent {node} registered again on its live stream: {gpus} GPUs",
            node=self.node_id,
            gpus=len(reg.gpus),
        )
        self.send_message(ack("register"))
        self._warn_unaccounted(self.node_id, reg)
        self.factory.sink.node_registered(self.node_id)

    def _cache_report(self, reg: pb.Register) -> None:
        # A Register carries the whole cache; an older agent's (no fields)
        # reads as an empty cache of unknown size with no peer listener.
        peer = reg.peer_address
        problem = peer_address_problem(peer)
        if problem is not None:
            # Not worth refusing the node over: it serves no peers, that is all.
            self.log.warn("agent {node} at {peer}: {problem}; other nodes will not fetch from it",
                          node=reg.node_id, peer=self.peer_name(), problem=problem)
            peer = ""
        self.factory.inventory.apply_cache(
            reg.node_id, cached_copies(reg.cached_models),
            CacheRoom(reg.cache_capacity, reg.cache_free), peer)

    def _warn_unaccounted(self, node_id: str, reg: pb.Register) -> None:
        """
        Log loudly what a Register says is running unaccounted for: the
        stray processes (one line, their pids; the list is in the
        inventory) and each shard whose record the agent lost.
        """
        if reg.stray_processes:
            strays = bounded_strays(
                StrayProcess(pid=p.pid, pgid=p.pgid, shard_id=p.shard_id) for p in reg.stray_processes
            )
            pids = ", ".join(f"{s.pid} (group {s.pgid}, shard {s.shard_id or '?'})" for s in strays)
            more = len(reg.stray_processes) - len(strays)
            self.log.warn(
                "agent {node} reports {count} stray processes that carry its shard marker but "
                "belong to no shard it knows; they are left running, stop them by hand: {pids}",
                node=node_id,
                count=len(reg.stray_processes),
                pids=pids + (f" and {more} more" if more > 0 else ""),
            )
        for s in reg.running_shards:
            if s.record_lost:
                self.log.warn(
                    "agent {node} lost the record of shard {shard} (process group {pgid}, model "
                    "{model}) and found it running by its marker; it is reported so that it is "
                    "claimed or stopped",
                    node=node_id,
                    shard=s.shard_id,
                    pgid=s.pgid,
                    model=s.model or "unknown",
                )

    def _heartbeat(self, hb: pb.Heartbeat) -> None:
        assert self.node_id is not None
        problems = [(p.gpu_index, p.problem) for p in hb.new_gpu_problems]
        attributed = {p for _, p in problems}
        # Unattributed problems go to the first GPU: keeping one GPU out of
        # placement is the conservative reading.
        problems += [(-1, p) for p in hb.new_problems if p not in attributed]
        for index, text in problems:
            self.log.warn(
                "node {node} reports a GPU problem on GPU {gpu}: {problem}",
                node=self.node_id,
                gpu=index if index >= 0 else "?",
                problem=text,
            )
        self.factory.inventory.apply_heartbeat(
            self.node_id, list(hb.gpu_memory_used_mb), problems
        )
        if hb.cache_changed or hb.cache_capacity:
            self.factory.inventory.apply_cache(
                self.node_id, cached_copies(hb.cached_models) if hb.cache_changed else None,
                CacheRoom(hb.cache_capacity, hb.cache_free))
        # Engine signals: an older agent sends none; a sink without the
        # method (a test fake) gets none.
        record = getattr(self.factory.sink, "record_engine_signals", None)
        if record is not None:
            record(self.node_id, hb.shard_signals)
        fetches = getattr(self.factory.sink, "record_fetches", None)
        if fetches is not None:
            fetches(self.node_id, hb.fetches)
        if self.factory.ack_heartbeats:
            # So that an agent learns when a silent member is gone.
            self.send_message(ack("heartbeat"))

    def _shard_status(self, st: pb.ShardStatus) -> None:
        assert self.node_id is not None
        owner = self.factory.sink.shard_node(st.shard_id)
        if owner != self.node_id and st.shard_id not in self._reported_running:
            self.log.warn(
                "refusing a status for shard {shard} from node {node}: that shard "
                "belongs to {owner}",
                node=self.node_id,
                shard=st.shard_id,
                owner=owner or "no node this control plane knows",
            )
            # The answer is a courtesy: a peer that does not read gets none,
            # rather than a write buffer that grows with each refusal.
            if not self._paused:
                self.send_message(
                    ack(
                        f"shard:{st.shard_id}",
                        ok=False,
                        code=Code.CODE_PERMISSION_DENIED,
                        error=f"shard {st.shard_id!r} is not on node {self.node_id!r}",
                    )
                )
            return
        report = ShardReport.from_message(self.node_id, st)
        if st.state == pb.ShardStatus.STATE_FAILED:
            self.log.error(
                "shard {shard} of replica {replica} failed on {node}: {error}; last output:\n{last_output}",
                node=self.node_id,
                shard=st.shard_id,
                replica=st.replica_id,
                error=st.error,
                exit_code=st.exit_code,
                signal=st.signal,
                last_output=st.last_output,
            )
        else:
            self.log.debug(
                "shard {shard} on {node} is {state}",
                node=self.node_id,
                shard=st.shard_id,
                state=report.state,
            )
        self.factory.sink.on_shard_status(report)

    # -- outbound -----------------------------------------------------------

    def send_command(self, msg: pb.ControlMessage, force: bool = False) -> None:
        """
        Write a command, or queue it while the transport is paused.

        @param force: queue even past the bound (adoption's stops, which must
            not be lost to a slow start).
        @raise NotKeepingUp: the queue is full.
        @raise NotConnected: the stream is closing.
        """
        if self._closing or self.transport is None or self.transport.disconnecting:
            raise NotConnected(f"node {self.node_id}: stream is closing")
        if self._paused or self._pending:
            if len(self._pending) >= self.factory.max_pending and not force:
                raise NotKeepingUp(
                    f"node {self.node_id} is not keeping up: {len(self._pending)} "
                    "commands already wait for it to read"
                )
            self._pending.append(msg)
            return
        self.send_message(msg)

    # IPushProducer: the transport tells us when its buffer is over its limit.

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        while self._pending and not self._paused:
            self.send_message(self._pending.popleft())

    def stopProducing(self) -> None:
        self._pending.clear()
