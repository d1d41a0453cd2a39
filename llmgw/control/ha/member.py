"""
One member of a highly available control plane (DESIGN §17): the shell
around L{llmgw.control.ha.election.Election} that makes the leader reconcile
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
- The leader publishes its routing table in etcd
  (L{llmgw.control.ha.published}); every other member, a deposed leader
  among them, follows that table with its own (which its embedded gateway
  routes by and its C{GET /api/v1/routes} answers from), keeping the last
  one while etcd is away. A new leader starts from the table it followed
  and, once its adoption grace is over, publishes the whole table from
  what its agents reported.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, overload

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger, LogLevel
from zope.interface import implementer

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import Catalog, CatalogError, parse_catalog
from llmgw.control.core.commands import ShardCommand
from llmgw.control.ha import catalogedits
from llmgw.control.ha.catalogcheck import CatalogFileCheck
from llmgw.control.ha.election import Election, MemberInfo, Role, leader_key
from llmgw.control.ha.published import RoutesFollower, RoutesPublisher
from llmgw.control.ha.published_fleet import FleetDocument, FleetFollower, FleetPublisher
from llmgw.control.ha.sharedpeople import SharedPeople
from llmgw.control.ha.sharedstate import SharedFleet, SharedKeptState
from llmgw.control.state.interfaces import IDispatcher, NotConnected
from llmgw.etcd import Compare, EtcdError, EtcdTLSError, Put, Range
from llmgw.sourcespec import ModelSource
from llmgw.wire import NO_LEADER_MARKER, redirect_error

Code = pb.Ack.Code


class SlicedNodes(Sequence[dict[str, Any]]):
    """
    The leader's C{GET /api/v1/nodes} view, built for a slice of its
    nodes at a time (by the handler's own L{llmgw.control.admin.fleet.nodes_view},
    over a L{_SomeNodes} of the fleet): the ids and the connected set are
    taken when made, each node's view when its slice is asked for (a node
    gone meanwhile is left out of its slice).
    """

    def __init__(self, fleet: Any, agents: Any):
        self.fleet = fleet
        self.agents = agents
        self.ids: list[str] = fleet.inventory.ids()
        self._connected = fleet.connected()

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        from llmgw.control.admin.fleet import nodes_view

        if isinstance(index, slice):
            return nodes_view(_SomeNodes(self.fleet, self.ids[index], self._connected), self.agents)["nodes"]
        found: list[dict[str, Any]] = nodes_view(_SomeNodes(self.fleet, [self.ids[index]], self._connected),
                                                 self.agents)["nodes"]
        if not found:
            raise IndexError(index)
        return found[0]


class _SomeNodes:
    """The fleet (the reconciler), as if it held only the nodes C{ids}."""

    def __init__(self, fleet: Any, ids: list[str], connected: set[str]):
        self._fleet = fleet
        self._connected = connected
        self.inventory = _SomeInventory(fleet.inventory, ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fleet, name)

    def connected(self) -> set[str]:
        return self._connected

    def nodes(self) -> list[dict[str, Any]]:
        from llmgw.control.shell import views

        return views.nodes(self)  # type: ignore[arg-type]


class _SomeInventory:
    """An inventory, as if it held only the nodes C{ids} (gone ones left out)."""

    def __init__(self, inventory: Any, ids: list[str]):
        self._inventory = inventory
        self._ids = ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inventory, name)

    def list(self) -> list[Any]:
        from llmgw.control.state.inventory import _copy_node

        out = []
        for node_id in self._ids:
            node = self._inventory.peek(node_id)
            if node is not None:
                out.append(_copy_node(node))
        return out


def epoch_base_key(prefix: str) -> bytes:
    return (prefix.rstrip("/") + "/epoch-base").encode()


def catalog_key(prefix: str) -> bytes:
    """Where the catalog's TOML text lives in etcd."""
    return (prefix.rstrip("/") + "/catalog").encode()


def parse_catalog_text(text: bytes, where: str) -> Catalog:
    """
    @raise CatalogError: not UTF-8 TOML, or not a valid catalog.
    """
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"catalog in {where} is not valid TOML: {e}") from e
    try:
        return parse_catalog(data, path=None)
    except CatalogError as e:
        raise CatalogError(f"catalog in {where}: {e}") from None


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

    def _check(self) -> Any:
        """The agent service, while this member may command; raises L{NotConnected} otherwise."""
        if not self.may_command():
            self.fenced += 1
            raise NotConnected("this control-plane member no longer leads: no command is sent")
        return self.inner

    def start_shard(self, command: ShardCommand) -> None:
        self._check().start_shard(command)

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._check().stop_shard(node_id, shard_id)

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._check().drain_shard(node_id, shard_id)

    def sleep_shard(self, node_id: str, shard_id: str) -> None:
        self._check().sleep_shard(node_id, shard_id)

    def prefetch_model(self, node_id: str, source: ModelSource, peers: Sequence[str], pin: str) -> None:
        self._check().prefetch_model(node_id, source, peers, pin)

    def drop_model(self, node_id: str, key: str, pin: str) -> None:
        self._check().drop_model(node_id, key, pin)

    def load_adapter(self, node_id: str, shard_id: str, name: str, source: ModelSource) -> None:
        self._check().load_adapter(node_id, shard_id, name, source)

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
        catalog_file: str | None = None,
        monotonic: Callable[[], float] | None = None,
        admin_url: Callable[[], tuple[str, str]] | None = None,
    ):
        self.reactor = reactor
        self.cp = cp
        self.reconciler = reconciler
        self.store = store
        self.prefix = prefix
        self.member = member
        #: The admin URL to publish while leading and, when there is none,
        #: why: asked once the listeners are bound (a port 0 is known then).
        #: C{None}: the member record's own C{admin_url}.
        self.admin_url = admin_url
        self.now_ms = now_ms
        self.retry_interval = retry_interval
        self.epoch_base: int | None = None
        self.epoch = 0
        #: This member's --catalog: seeds etcd when it holds none.
        self.catalog_file = catalog_file
        #: True once a won term has its catalog from etcd and its reconciler
        #: running; Register waits for it.
        self.taken_over = False
        #: The mod revision of the catalog applied from etcd.
        self.catalog_revision = 0
        self._watch: Any = None
        self._state_watch: Any = None
        self.elections = 0
        self.election = Election(
            store, reactor, prefix, member, on_elected=self._elected, on_deposed=self._deposed, ttl=ttl,
            monotonic=monotonic,
        )
        self.dispatcher = FencedDispatcher(cp.agents, self.election.may_command)
        # The operator's fleet state lives in etcd (sharedstate); the state
        # file the reconciler loaded seeds it once, if etcd holds none.
        self.kept = SharedKeptState(store, prefix)
        self._seed = reconciler.fleet_state
        reconciler.fleet_state = self.kept
        if getattr(cp, "fleet", None) is reconciler:
            cp.fleet = SharedFleet(reconciler, self.kept)
        cp.agents.gate = self.gate
        cp.agents.ack_heartbeats = True
        self._starting: defer.Deferred[None] | None = None
        #: Why etcd could not be asked at start, while it cannot.
        self.start_error = ""
        # The routing table, published by the leader, followed by the rest.
        table = reconciler.routing_table
        self.routes_publisher = RoutesPublisher(reactor, store, prefix, table, self.election.may_command)
        self.routes_follower = RoutesFollower(reactor, store, prefix, table, retry_interval=retry_interval)
        # The admin views (nodes, replicas, events, status), likewise.
        self.fleet_publisher = FleetPublisher(reactor, store, prefix, self.fleet_views, self.election.may_command)
        self.fleet_follower = FleetFollower(reactor, store, prefix, retry_interval=retry_interval)
        # Join tokens, users and sessions: etcd's, the same on every member.
        self.people = SharedPeople(reactor, cp, store, prefix, retry_interval, fleet=self.fleet_follower,
                                   leading=self.election.is_leader)
        self._republish: Any = None
        self._grace_listener: Callable[[], None] | None = None
        # Whether --catalog says what etcd's catalog says, on every member.
        self.catalog_check = (
            CatalogFileCheck(reactor, store, catalog_key(prefix), catalog_file, self._catalog_differs,
                             retry_interval=retry_interval)
            if catalog_file is not None else None
        )

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
        self.routes_follower.start()
        self.fleet_follower.start()
        self.people.start()
        if self.catalog_check is not None:
            self.catalog_check.start()

    def _catalog_differs(self, message: str) -> None:
        # An event in this member's own log: the leader's API shows it while
        # this member leads; its status field shows it always.
        self.reconciler.event_log.add(self.reactor.seconds(), "catalog_file_differs", reason=message)

    async def _start(self) -> None:
        while self.running and self.epoch_base is None:
            try:
                self.epoch_base = await ensure_epoch_base(self.store, self.prefix, self.now_ms())
                self.start_error = ""
            except EtcdError as e:
                if str(e) != self.start_error:
                    # Said once per cause, not once a retry; a TLS refusal is
                    # a configuration error, not an outage.
                    self.log.emit(
                        LogLevel.error if isinstance(e, EtcdTLSError) else LogLevel.warn,
                        "etcd: cannot read the epoch base yet ({error}); retrying every {interval}s",
                        error=str(e), interval=self.retry_interval)
                self.start_error = str(e)
                await deferLater(self.reactor, self.retry_interval, lambda: None)
        if self.running:
            self._name_admin_url()
            self.election.start()

    def _name_admin_url(self) -> None:
        """
        Put the admin URL this member publishes while it leads into its
        record: the operator's (C{--advertise-admin}) when set, else its
        admin listener's own address; or, when neither can be published,
        the reason, which the other members give a client they cannot send
        on.
        """
        if self.admin_url is None or self.member.admin_url:
            return
        url, problem = self.admin_url()
        self.member = replace(self.member, admin_url=url, admin_problem="" if url else problem)
        self.election.member = self.member
        if url:
            self.log.info("HA member {member} publishes its admin API as {url} while it leads "
                          "(--advertise-admin names another)", member=self.member.member_id, url=url)
        else:
            self.log.warn("HA member {member} has no admin URL to publish: {problem}; while it leads, "
                          "the other members cannot send admin clients to it",
                          member=self.member.member_id, problem=problem)

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()
        if self._starting is not None and not self._starting.called:
            self._starting.addErrback(lambda f: f.trap(defer.CancelledError))
            self._starting.cancel()
        self.taken_over = False
        self._stop_watch()
        self._stop_publishing()
        self.routes_follower.stop()
        self.fleet_follower.stop()
        self.people.stop()
        if self.catalog_check is not None:
            self.catalog_check.stop()
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
        self.taken_over = False
        # This member's own reconciler feeds its table from now on.
        self.routes_follower.stop()
        self.fleet_follower.stop()
        # What it followed before would be stale when it steps down again.
        self.fleet_follower.document = None
        lease = self.election.lease
        d = defer.ensureDeferred(self._take_over(epoch, revision, lease))
        d.addErrback(lambda f: self.log.failure("taking over as leader failed", f))

    async def _take_over(self, epoch: int, revision: int, lease: int) -> None:
        """
        Load the catalog from etcd (seeding it from --catalog under this
        leader's lease when etcd holds none), then start reconciling.
        """
        while self.election.lease == lease and self.election.may_command():
            try:
                await self._load_catalog(lease)
                for problem in await self.kept.load_from(lease, self._seed):
                    # (Not "warning": a log event with that key reads as a Python warning.)
                    self.log.error("{problem}", problem=problem)
                break
            except EtcdError as e:
                self.log.warn("etcd: cannot read the catalog or fleet state yet ({error}); retrying",
                              error=str(e))
                await deferLater(self.reactor, self.retry_interval, lambda: None)
        if self.election.lease != lease or not self.election.may_command():
            # This term ended while loading: its lease writes nothing more.
            if self.kept.lease == lease:
                self.kept.step_down()
            return
        self.reconciler.take_up_kept()
        self.reconciler.attach(self.dispatcher, epoch=epoch)
        if not self.reconciler.running:
            self.reconciler.startService()
        self.taken_over = True
        self._start_watch(lease)
        self._follow_state(lease)
        self._start_publishing(lease)
        self.log.info(
            "HA member {member} leads with command epoch {epoch} (etcd revision {revision}); "
            "the reconciler adopts what agents report before it places anything",
            member=self.member.member_id, epoch=epoch, revision=revision,
        )

    async def _load_catalog(self, lease: int) -> None:
        key = catalog_key(self.prefix)
        kv = await defer.ensureDeferred(self.store.get(key))
        own = None
        if self.catalog_file is not None:
            try:
                with open(self.catalog_file, "rb") as f:
                    own = f.read()
            except OSError as e:
                self.log.warn("catalog {path} cannot be read: {error}", path=self.catalog_file, error=str(e))
        if kv is None:
            if own is None:
                self.log.warn("etcd holds no catalog and this member has no --catalog: nothing is "
                              "placed until `llmgw ctl catalog apply FILE`")
                return
            # Seed it, only under this leader's lease and only if still absent.
            result = await defer.ensureDeferred(self.store.txn(
                [Compare.held_by(leader_key(self.prefix), lease), Compare.absent(key)],
                [Put(key, own)],
            ))
            if result.succeeded:
                self.log.info("etcd held no catalog: stored {path} under {key}",
                              path=self.catalog_file, key=key.decode())
                self._apply_catalog(own, result.revision)
                return
            kv = await defer.ensureDeferred(self.store.get(key))
            if kv is None:
                return
        # A file that differs is said by the catalog check, on every member.
        self._apply_catalog(kv.value, kv.mod_revision)

    def _apply_catalog(self, text: bytes, revision: int) -> None:
        where = f"etcd {catalog_key(self.prefix).decode()} (revision {revision})"
        try:
            catalog = parse_catalog_text(text, where)
        except CatalogError as e:
            self.log.error("{error}; the running catalog stays", error=str(e))
            return
        changes = self.reconciler.apply_catalog(catalog)
        self.catalog_revision = revision
        self.log.info("catalog from {where}: {changes}", where=where,
                      changes=", ".join(f"{k}: {','.join(v)}" for k, v in changes.items() if v) or "no changes")

    async def edit_catalog(self, change: Callable[[bytes, str], Any]) -> dict[str, Any]:
        """The leader's change to etcd's catalog, then applied (L{catalogedits.edit})."""
        return await catalogedits.edit(self, catalog_key(self.prefix), change)

    def _start_watch(self, lease: int) -> None:
        key = catalog_key(self.prefix)

        def on_events(events: list[Any], revision: int) -> None:
            if not self.taken_over or self.election.lease != lease:
                return
            for ev in events:
                if ev.kind == "PUT" and ev.kv.mod_revision > self.catalog_revision:
                    self._apply_catalog(ev.kv.value, ev.kv.mod_revision)

        def ended(_: Any) -> None:
            if self.running and self.taken_over and self.election.lease == lease:
                self.reactor.callLater(self.retry_interval, self._start_watch, lease)

        start = self.catalog_revision + 1 if self.catalog_revision else 0
        self._watch = self.store.watch(key, on_events, start_revision=start)
        self._watch.done.addBoth(ended)

    def _follow_state(self, lease: int) -> None:
        """Take up a change of the fleet state made in etcd by hand."""
        def changed() -> None:
            if self.taken_over and self.election.lease == lease:
                self.reconciler.take_up_kept()
                self.log.warn("fleet state in etcd {key} changed (revision {revision}), not by this "
                              "member: taken up", key=self.kept.key.decode(), revision=self.kept.revision)

        def ended(_: Any) -> None:
            if self.running and self.taken_over and self.election.lease == lease:
                self.reactor.callLater(self.retry_interval, self._follow_state, lease)

        self._state_watch = self.kept.follow(changed)
        self._state_watch.done.addBoth(ended)

    def _start_publishing(self, lease: int) -> None:
        """
        Publish the routing table under C{lease}; once the adoption grace
        is over, the whole table from what agents reported (the routes
        followed from the previous leader that nobody reported go).
        """
        self.routes_publisher.start(lease, current=self.routes_follower.value)
        self.fleet_publisher.start(lease)

        def republish() -> None:
            if self._republish is not None and self._republish.active():
                self._republish.cancel()
            self._republish = None
            self._forget_grace_listener()
            if self.taken_over and self.election.lease == lease:
                if self.reconciler.republish_routes():
                    self.log.info("adoption grace over: the routing table is now all this leader's own")

        delay = max(0.0, self.reconciler.grace_end - self.reactor.seconds())
        self._republish = self.reactor.callLater(delay, republish)
        # A grace ended early (every expected agent came) republishes then.
        self._grace_listener = republish
        self.reconciler.grace_ended_listeners.append(republish)

    def _forget_grace_listener(self) -> None:
        listener, self._grace_listener = self._grace_listener, None
        if listener is not None and listener in self.reconciler.grace_ended_listeners:
            self.reconciler.grace_ended_listeners.remove(listener)

    def _stop_publishing(self) -> None:
        self.routes_publisher.stop()
        self.fleet_publisher.stop()
        if self._republish is not None and self._republish.active():
            self._republish.cancel()
        self._republish = None
        self._forget_grace_listener()

    def serves_routes(self) -> bool:
        """
        Whether this member answers C{GET /api/v1/routes} itself: while it
        leads with its reconciler running, or, not leading, once it holds a
        table the leader published (before that it sends the client on: an
        empty table would make a gateway drop every route).
        """
        if self.election.role is Role.LEADER:
            return self.taken_over
        return self.routes_follower.applied

    def fleet_views(self) -> dict[str, Any]:
        """
        What the leader publishes for the members that do not lead: its
        admin API's views (built by the same functions its handlers call,
        so the shapes cannot drift) and who it is. The nodes are a
        L{SlicedNodes}, built a slice at a time as the publisher packs them
        (the whole view at once is some 700 ms at 10,000 nodes).
        """
        from llmgw.control.admin.fleet import fleet_status

        st = self.election.status()
        return {
            "leader": self.member.member_id,
            "leader_admin_url": st["leader_admin_url"],
            "nodes": SlicedNodes(self.reconciler, self.cp.agents),
            "replicas": self.reconciler.replicas(),
            "events": self.reconciler.events(),
            "status": fleet_status(self.reconciler, self.cp.agents),
        }

    def followed_fleet(self) -> FleetDocument | None:
        """
        The fleet views the leader published (a L{FleetDocument}), while
        this member does not lead and holds some;
        else C{None} (a leader answers from its own state; a member without
        a document sends the client to the leader).
        """
        if self.election.role is Role.LEADER:
            return None
        return self.fleet_follower.document

    def _stop_watch(self) -> None:
        if self._watch is not None:
            w, self._watch = self._watch, None
            w.cancel()
        if self._state_watch is not None:
            w, self._state_watch = self._state_watch, None
            w.cancel()

    def _deposed(self, reason: str) -> None:
        self.taken_over = False
        self.kept.step_down()
        self._stop_watch()
        self._stop_publishing()
        if self.running:
            # Its gateway serves the new leader's routes, or its last own.
            self.routes_follower.start()
            self.fleet_follower.start()
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
            if self.taken_over:
                return None
            return (Code.CODE_RESOURCE_EXHAUSTED,
                    f"{NO_LEADER_MARKER}: this member has just won and is loading the catalog")
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
            "leader_admin_problem": st["leader_admin_problem"],
            "epoch": (self.epoch_base or 0) + leader_epoch if leader_epoch else 0,
            "revision": leader_epoch,
            "lease_ttl": st["lease_ttl"],
            "terms": st["terms"],
            "commands_fenced": self.dispatcher.fenced,
            "catalog_revision": self.catalog_revision,
            "catalog_file": self.catalog_check.status() if self.catalog_check is not None else None,
            "fleet_state_revision": self.kept.revision,
            "routes_published": self.routes_publisher.writes,
            "routes_followed_revision": self.routes_follower.revision,
            "fleet_published": self.fleet_publisher.writes,
            "fleet_followed_revision": self.fleet_follower.revision,
            "etcd_error": st["last_error"] or self.start_error,
            "people": self.people.status(),
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
