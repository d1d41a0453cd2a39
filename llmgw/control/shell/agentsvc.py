"""
The control plane's side of the agent stream (DESIGN §5): the service that
accepts agents' connections, holds the map of registered streams by node,
and is the reconciler's dispatcher (the only thing that can deliver a
command to a node).

Each connection is an L{AgentStreamProtocol} (L{llmgw.control.shell.agentstream}).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from OpenSSL import SSL
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentstream import AgentStreamProtocol
from llmgw.control.state.interfaces import (
    IDispatcher,
    IStatusSink,
    NotConnected,
    NotKeepingUp,
    ShardCommand,
)
from llmgw.control.state.inventory import Inventory
from llmgw.shards import source_message
from llmgw.sourcespec import ModelSource
from llmgw.tlsconf.handshake import HANDSHAKE_TIMEOUT
from llmgw.wire import DEFAULT_MAX_FRAME

__all__ = ["HANDSHAKE_TIMEOUT", "AgentService", "AgentStreamProtocol", "start_message"]

#: Commands that may wait behind a paused transport before the dispatcher
#: says the node is not keeping up (DESIGN §5).
MAX_PENDING_COMMANDS = 64
REGISTER_TIMEOUT = 10.0


def start_message(cmd: ShardCommand, epoch: int) -> pb.ControlMessage:
    """
    The C{StartShard} of C{cmd}, sent by the control plane of C{epoch}.
    """
    start = cmd.to_message()
    # The sender's epoch, stamped as it goes: a command's own is 0 until then.
    start.epoch = epoch
    return pb.ControlMessage(start=start)


def prefetch_message(source: ModelSource, peers: Sequence[str], pin: str, epoch: int) -> pb.ControlMessage:
    """
    The C{PrefetchModel} of C{source} kept under C{pin}, from C{epoch}.
    """
    return pb.ControlMessage(prefetch=pb.PrefetchModel(
        message_id=f"prefetch:{pin}", source=source_message(source), model_peers=list(peers),
        pin=pin, epoch=epoch))


@implementer(IDispatcher)
class AgentService(ServerFactory):
    """
    Builds a protocol per connection, holds the registered streams by node,
    and delivers the reconciler's commands.
    """

    log = Logger()
    protocol = AgentStreamProtocol  # type: ignore[assignment]
    noisy = False
    #: Decides on renewals asked over streams (L{llmgw.control.shell.joining.JoinAuthority}).
    joining: Any = None

    def __init__(
        self,
        inventory: Inventory,
        sink: IStatusSink,
        clock: IReactorTime,
        epoch: int,
        tls: bool = True,
        require_identity: bool = True,
        max_frame: int = DEFAULT_MAX_FRAME,
        heartbeat_interval: float = 5.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        register_timeout: float = REGISTER_TIMEOUT,
        max_pending: int = MAX_PENDING_COMMANDS,
        max_nodes: int = 0,
        message_rate: float = 0.0,
        message_burst: int = 1,
    ):
        self.inventory = inventory
        self.sink = sink
        self.clock = clock
        self.epoch = epoch
        self.tls = tls
        self.require_identity = require_identity
        self.max_frame = max_frame
        self.silence_timeout = 3 * heartbeat_interval
        self.handshake_timeout = handshake_timeout
        self.register_timeout = register_timeout
        self.max_pending = max_pending
        #: 0 means no limit on registered nodes.
        self.max_nodes = max_nodes
        #: Messages per second one agent may send (0: no limit), and the
        #: burst above it (see L{llmgw.control.shell.limits.MessageRate}).
        self.message_rate = message_rate
        self.message_burst = message_burst
        self._conns: dict[str, AgentStreamProtocol] = {}
        self._open: set[AgentStreamProtocol] = set()
        #: Asked at each Register; a (code, error) refuses it (a member of an
        #: HA control plane that does not lead redirects to the leader).
        self.gate: Callable[[], tuple[int, str] | None] | None = None
        #: Acknowledge each heartbeat (an HA member does, so that agents
        #: notice its silence).
        self.ack_heartbeats = False
        self.registrations: collections.Counter[str] = collections.Counter()
        self.dispatch_refusals: collections.Counter[str] = collections.Counter()
        #: Agent frames refused, by cause (C{oversized}); for metrics.
        self.frames_refused: collections.Counter[str] = collections.Counter()

    def buildProtocol(self, addr: Any) -> AgentStreamProtocol:
        return AgentStreamProtocol(self)

    # -- connection map -----------------------------------------------------

    def opened(self, proto: AgentStreamProtocol) -> None:
        self._open.add(proto)

    def closed(self, proto: AgentStreamProtocol) -> None:
        self._open.discard(proto)

    def open_connections(self) -> int:
        """
        Connections accepted and not yet closed, registered or not.
        """
        return len(self._open)

    def admit(self, node_id: str) -> bool:
        return not self.max_nodes or node_id in self._conns or len(self._conns) < self.max_nodes

    def attach(self, node_id: str, proto: AgentStreamProtocol) -> None:
        """
        Make C{proto} the stream for C{node_id}. A stream already there is
        the dead one by definition: it is aborted, not closed gracefully,
        which would wait on a peer that may be gone.
        """
        old = self._conns.get(node_id)
        self._conns[node_id] = proto
        if old is not None and old is not proto:
            self.log.warn(
                "node {node} connected again from {peer} while its old stream was "
                "open; the new stream wins",
                node=node_id,
                peer=proto.peer_name(),
            )
            old.abort()

    def detach(self, node_id: str, proto: AgentStreamProtocol) -> None:
        # The old stream's connectionLost can arrive after the new one
        # registered: remove only what is still ours. Losing a stream is not
        # losing the node; expiry judges silence (DESIGN §6.3).
        if self._conns.get(node_id) is proto:
            del self._conns[node_id]

    def stream(self, node_id: str) -> AgentStreamProtocol | None:
        return self._conns.get(node_id)

    def count_registration(self, outcome: str) -> None:
        self.registrations[outcome] += 1

    def close_streams(self, node_ids: Iterable[str], reason: str) -> int:
        """
        Abort the streams of C{node_ids}; returns how many were open.
        """
        n = 0
        for node_id in list(node_ids):
            proto = self._conns.get(node_id)
            if proto is not None:
                self.log.warn("closing the stream of {node}: {reason}", node=node_id, reason=reason)
                proto.abort()
                n += 1
        return n

    def close_revoked(self, serials: frozenset[int], reason: str) -> list[str]:
        """
        Abort every open connection whose client certificate has one of
        C{serials}, registered or not; returns who they were. TLS checks a
        certificate only at the handshake, so a CRL must do this itself.
        """
        closed = []
        for proto in [p for p in self._open if p.certificate_serial in serials]:
            who = proto.node_id or proto.identity or proto.peer_name()
            self.log.warn(
                "closing the stream of {node} ({peer}): {reason}",
                node=who, peer=proto.peer_name(), reason=reason,
            )
            proto.abort()
            closed.append(who)
        return sorted(closed)

    def close_all(self, reason: str) -> int:
        """
        Abort every open connection, registered or not (the control plane is
        stopping); returns how many there were.
        """
        streams = list(self._open)
        if streams:
            self.log.info("closing {count} agent connections: {reason}", count=len(streams),
                          reason=reason)
        for proto in streams:
            proto.abort()
        return len(streams)

    # -- IDispatcher --------------------------------------------------------

    def connected_nodes(self) -> list[str]:
        return sorted(self._conns)

    def is_connected(self, node_id: str) -> bool:
        return node_id in self._conns

    def _send(self, node_id: str, msg: pb.ControlMessage) -> None:
        proto = self._conns.get(node_id)
        if proto is None:
            self.dispatch_refusals["not_connected"] += 1
            raise NotConnected(f"no agent stream is open for node {node_id}")
        try:
            proto.send_command(msg)
        except NotKeepingUp:
            self.dispatch_refusals["not_keeping_up"] += 1
            raise
        except NotConnected:
            self.dispatch_refusals["not_connected"] += 1
            raise
        except SSL.Error as e:
            self.dispatch_refusals["not_connected"] += 1
            raise NotConnected(f"node {node_id}: {e}") from e

    def start_shard(self, command: ShardCommand) -> None:
        self._send(command.node_id, start_message(command, self.epoch))

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._send(node_id, pb.ControlMessage(stop=pb.StopShard(shard_id=shard_id, epoch=self.epoch)))

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._send(
            node_id, pb.ControlMessage(drain=pb.DrainShard(shard_id=shard_id, epoch=self.epoch))
        )

    def sleep_shard(self, node_id: str, shard_id: str) -> None:
        self._send(node_id, pb.ControlMessage(sleep=pb.SleepShard(shard_id=shard_id, epoch=self.epoch)))

    def prefetch_model(self, node_id: str, source: ModelSource, peers: Sequence[str], pin: str) -> None:
        self._send(node_id, prefetch_message(source, peers, pin, self.epoch))

    def drop_model(self, node_id: str, key: str, pin: str) -> None:
        self._send(node_id, pb.ControlMessage(drop=pb.DropModel(
            message_id=f"drop:{pin}", key=key, pin=pin, epoch=self.epoch)))

    def load_adapter(self, node_id: str, shard_id: str, name: str, source: ModelSource) -> None:
        self._send(node_id, pb.ControlMessage(load_adapter=pb.LoadAdapter(
            message_id=f"adapter:{shard_id}:{name}", shard_id=shard_id, name=name,
            source=source_message(source), epoch=self.epoch)))
