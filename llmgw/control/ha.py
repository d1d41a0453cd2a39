"""
One member of a highly available control plane (DESIGN §17): the shell
around L{llmgw.control.election.Election} that makes the leader reconcile
and the others stand by.

- On winning, the member's command epoch becomes C{base + revision} (the
  revision at which it won, plus a base stored once in etcd when the
  cluster was first used: milliseconds since 1970 then, so that HA epochs
  are above every epoch a standalone control plane handed out before), the
  reconciler is started with it (the adoption grace of §6.5 begins: it
  rebuilds replicas from what agents report) and Register is accepted.
- While it does not lead, a Register is refused with a failed-precondition
  Ack that names the leader's agent address (the agent goes there).
- On stepping down, the reconciler stops, every agent stream is closed
  (agents go to the new leader), and L{FencedDispatcher} refuses any
  command that is still on its way out: it checks the election's own
  deadline on the clock at each command.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.commands import ShardCommand
from llmgw.control.election import Election, MemberInfo, Role
from llmgw.control.interfaces import IDispatcher, NotConnected
from llmgw.etcd import Compare, EtcdError, Put, Range
from llmgw.wire import NO_LEADER_MARKER, redirect_error

Code = pb.Ack.Code


def epoch_base_key(prefix: str) -> bytes:
    return (prefix.rstrip("/") + "/epoch-base").encode()


async def ensure_epoch_base(store: Any, prefix: str, now_ms: int) -> int:
    """
    The cluster's epoch base: read it, or store C{now_ms} if there is none
    yet (compare-and-swap: the first member to store it wins).

    @raise EtcdError: etcd could not be asked.
    """
    key = epoch_base_key(prefix)
    result = await defer.ensureDeferred(store.txn(
        [Compare.absent(key)], [Put(key, str(now_ms).encode())], [Range(key)]
    ))
    if result.succeeded:
        return now_ms
    kvs = result.kvs(0)
    return int(kvs[0].value) if kvs else now_ms


@implementer(IDispatcher)
class FencedDispatcher:
    """
    The agent service as the reconciler's dispatcher, passing a command on
    only while the election says this member may command.
    """

    def __init__(self, inner: Any, may_command: Callable[[], bool]):
        self.inner = inner
        self.may_command = may_command
        #: Commands refused because this member no longer leads.
        self.fenced = 0

    def _check(self) -> None:
        if not self.may_command():
            self.fenced += 1
            raise NotConnected("this control-plane member no longer leads: no command is sent")

    def start_shard(self, command: ShardCommand) -> None:
        self._check()
        self.inner.start_shard(command)

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._check()
        self.inner.stop_shard(node_id, shard_id)

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._check()
        self.inner.drain_shard(node_id, shard_id)

    def connected_nodes(self) -> list[str]:
        return list(self.inner.connected_nodes()) if self.may_command() else []


class HAMember(Service):
    """
    @param cp: the member's L{llmgw.control.service.ControlPlane} (its agent
        service is gated and its epoch set here).
    @param reconciler: the reconciler, not parented to C{cp}: this service
        starts and stops it with leadership.
    @param store: the etcd client.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        cp: Any,
        reconciler: Any,
        store: Any,
        prefix: str,
        member: MemberInfo,
        ttl: int = 10,
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        retry_interval: float = 1.0,
    ):
        self.reactor = reactor
        self.cp = cp
        self.reconciler = reconciler
        self.store = store
        self.prefix = prefix
        self.member = member
        self.now_ms = now_ms
        self.retry_interval = retry_interval
        self.epoch_base: int | None = None
        self.epoch = 0
        self.elections = 0
        self.election = Election(
            store, reactor, prefix, member, on_elected=self._elected, on_deposed=self._deposed, ttl=ttl,
        )
        self.dispatcher = FencedDispatcher(cp.agents, self.election.may_command)
        cp.agents.gate = self.gate
        cp.agents.ack_heartbeats = True
        self._starting: defer.Deferred[None] | None = None

    # -- lifecycle ----------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.log.info(
            "HA member {member} starting: campaigning under {prefix} on etcd (lease TTL {ttl}s); "
            "agents dial it at {agents}",
            member=self.member.member_id, prefix=self.prefix, ttl=self.election.ttl,
            agents=self.member.agent_address,
        )
        self._starting = defer.ensureDeferred(self._start())

    async def _start(self) -> None:
        while self.running and self.epoch_base is None:
            try:
                self.epoch_base = await ensure_epoch_base(self.store, self.prefix, self.now_ms())
            except EtcdError as e:
                self.log.warn("etcd: cannot read the epoch base yet ({error}); retrying", error=str(e))
                await deferLater(self.reactor, self.retry_interval, lambda: None)
        if self.running:
            self.election.start()

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()
        if self._starting is not None and not self._starting.called:
            self._starting.cancel()
        d = self.election.stop()
        if self.reconciler.running:
            self.reconciler.stopService()
        return d

    # -- leadership ------------------------------------------------------------------

    def _elected(self, revision: int) -> None:
        assert self.epoch_base is not None
        epoch = self.epoch_base + revision
        self.epoch = epoch
        self.elections += 1
        self.cp.epoch = epoch
        self.cp.agents.epoch = epoch
        self.reconciler.attach(self.dispatcher, epoch=epoch)
        if not self.reconciler.running:
            self.reconciler.startService()
        self.log.info(
            "HA member {member} leads with command epoch {epoch} (etcd revision {revision}); "
            "the reconciler adopts what agents report before it places anything",
            member=self.member.member_id, epoch=epoch, revision=revision,
        )

    def _deposed(self, reason: str) -> None:
        if self.reconciler.running:
            self.reconciler.stopService()
        closed = self.cp.agents.close_all(f"this control-plane member stepped down: {reason}")
        self.log.error(
            "HA member {member} stepped down ({reason}): the reconciler stopped, {closed} agent "
            "streams closed; shards keep running",
            member=self.member.member_id, reason=reason, closed=closed,
        )
        self.epoch = 0

    def gate(self) -> tuple[int, str] | None:
        """The refusal a Register gets here now (None while leading)."""
        if self.election.may_command():
            return None
        leader = self.election.leader
        if leader is not None and leader.agent_address and leader.member_id != self.member.member_id:
            return Code.CODE_FAILED_PRECONDITION, redirect_error(leader.agent_address, leader.member_id)
        return (
            Code.CODE_RESOURCE_EXHAUSTED,
            f"{NO_LEADER_MARKER} (an election is under way, or etcd is "
            f"unreachable: {self.election.last_error or 'no answer yet'}); try another member",
        )

    # -- views --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        st = self.election.status()
        leader_epoch = st["leader_epoch"]
        return {
            "role": st["role"],
            "member_id": self.member.member_id,
            "leader_id": st["leader_id"],
            "leader_agent_address": st["leader_agent_address"],
            "leader_admin_url": st["leader_admin_url"],
            "epoch": (self.epoch_base or 0) + leader_epoch if leader_epoch else 0,
            "revision": leader_epoch,
            "lease_ttl": st["lease_ttl"],
            "terms": st["terms"],
            "commands_fenced": self.dispatcher.fenced,
            "etcd_error": st["last_error"],
        }


class HACollector:
    """Prometheus metrics of an L{HAMember}."""

    def __init__(self, member: HAMember):
        self.member = member

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        m = self.member
        leading = GaugeMetricFamily(
            "llmgw_control_leader", "1 while this control-plane member leads, else 0",
            labels=["member"],
        )
        leading.add_metric([m.member.member_id], 1.0 if m.election.role is Role.LEADER else 0.0)
        yield leading
        yield GaugeMetricFamily(
            "llmgw_control_epoch", "the command epoch of the leader as this member knows it",
            value=float(m.status()["epoch"]),
        )
        yield GaugeMetricFamily(
            "llmgw_control_terms", "how many times this member won an election", value=float(m.election.terms),
        )
        info = InfoMetricFamily("llmgw_control_leader_member", "the leader as this member knows it")
        info.add_metric([], {"leader": m.election.leader.member_id if m.election.leader else ""})
        yield info
