"""
Leader election and fencing on etcd (DESIGN §17), as one clock-driven
object.

L{Election} campaigns for one key, C{PREFIX/leader}, with a lease:

- B{campaign}: grant a lease (TTL default 10 s), then a transaction "if the
  key does not exist, put our member record under the lease, else read
  it". The transaction that creates the key wins; the B{epoch} is the
  revision it ran at (the key's create revision), so epochs increase
  strictly from leader to leader whatever the clocks say. A member that
  loses learns who leads from the failure branch and tries again every
  C{retry_interval}; it also watches the leader key and campaigns at once
  when the key is deleted (the leader's lease expired or was revoked), so
  a take-over does not wait for the next attempt. The poll stays: it
  covers a watch that broke or has not been set up yet.
- B{lead}: renew the lease every C{ttl / 3} and check that the key is
  still ours. The lease was granted after we sent the grant, so etcd
  cannot expire it before C{sent + ttl}; each renewal moves our own
  deadline to C{sent + ttl - margin}. If renewals fail until that
  deadline, the leader B{steps down on its own clock}, before etcd can
  have let anyone else win. L{may_command} is false from that instant on,
  even if the timer that steps down has not run yet (a process frozen by
  SIGSTOP wakes with its timers late).
- B{never resume}: a member that stepped down drops its lease and must win
  a new transaction, with a new epoch, to lead again.

The store is anything with L{llmgw.etcd.EtcdClient}'s C{grant},
C{keepalive}, C{revoke}, C{get} and C{txn} (coroutines or Deferreds):
the real client, or L{llmgw.testing.fakeetcd.FakeEtcd} in unit tests. Every
request gets C{request_timeout} on the injected clock.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.etcd import Compare, EtcdError, Put, Range

DEFAULT_TTL = 10
DEFAULT_PREFIX = "/llmgw"
#: Seconds between campaign attempts of a member that is not the leader.
DEFAULT_RETRY_INTERVAL = 0.5


class Role(enum.Enum):
    FOLLOWER = "follower"
    LEADER = "leader"


@dataclass(frozen=True)
class MemberInfo:
    """
    What a member publishes under the leader key when it leads: its id, the
    address agents dial (C{HOST:PORT}) and its admin API URL; when it has
    no admin URL to publish, C{admin_problem} says why (the other members
    name it when they cannot send a client on).
    """

    member_id: str
    agent_address: str = ""
    admin_url: str = ""
    admin_problem: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> MemberInfo | None:
        try:
            d = json.loads(data)
            return cls(str(d["member_id"]), str(d.get("agent_address", "")), str(d.get("admin_url", "")),
                       str(d.get("admin_problem", "")))
        except (ValueError, KeyError, TypeError):
            return None


def leader_key(prefix: str) -> bytes:
    return (prefix.rstrip("/") + "/leader").encode()


class Election:
    """
    @param store: the etcd operations (see the module docstring).
    @param clock: all timing comes from here.
    @param prefix: the key prefix (C{--etcd-prefix}).
    @param member: this member's record.
    @param on_elected: called with the epoch when this member wins.
    @param on_deposed: called with the reason when it stops leading.
    @param ttl: the lease's TTL in seconds.
    @param margin: seconds before the lease could expire at which a leader
        that could not renew steps down (default: a fifth of the TTL, at
        least 1 s).
    @param monotonic: the time the lease deadline is reckoned on (the
        control plane passes C{time.monotonic}, so that a wall-clock step
        cannot keep a leader commanding past its lease); default C{clock}'s.
    """

    log = Logger()

    def __init__(
        self,
        store: Any,
        clock: IReactorTime,
        prefix: str,
        member: MemberInfo,
        on_elected: Callable[[int], None] = lambda epoch: None,
        on_deposed: Callable[[str], None] = lambda reason: None,
        ttl: int = DEFAULT_TTL,
        margin: float | None = None,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
        request_timeout: float | None = None,
        monotonic: Callable[[], float] | None = None,
    ):
        if ttl < 2:
            raise ValueError(f"the lease TTL must be at least 2 s, not {ttl}")
        self.store = store
        self.clock = clock
        #: What the lease deadline is reckoned on: a clock that a step of
        #: the wall clock (NTP) cannot move back; by default C{clock}'s
        #: own time (a test's L{Clock}).
        self.now = monotonic if monotonic is not None else clock.seconds
        self.key = leader_key(prefix)
        self.member = member
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.ttl = ttl
        self.margin = margin if margin is not None else max(1.0, ttl / 5)
        if self.margin >= ttl:
            raise ValueError(f"the step-down margin ({self.margin}s) must be below the TTL ({ttl}s)")
        self.renew_interval = ttl / 3
        self.retry_interval = retry_interval
        self.request_timeout = request_timeout if request_timeout is not None else min(2.0, ttl / 4)
        self.role = Role.FOLLOWER
        #: The revision at which this member won (0 when it does not lead).
        self.epoch = 0
        #: The leader as last seen (this member's own record while it leads).
        self.leader: MemberInfo | None = None
        self.leader_epoch = 0
        self.lease = 0
        #: When this member must have stopped commanding (leading only).
        self.deadline = 0.0
        self.terms = 0
        self.last_error = ""
        self._running = False
        self._call: IDelayedCall | None = None
        self._step_down_call: IDelayedCall | None = None
        self._busy = False
        self._pending: set[defer.Deferred[None]] = set()
        # -- the watch on the leader key (campaign at once on its delete) --
        self._watch: Any = None
        self._watch_retry: IDelayedCall | None = None
        #: A delete arrived while a step was under way: campaign right after it.
        self._campaign_now = False
        #: Campaigns started by a delete of the leader key (status, tests).
        self.woken = 0

    # -- public -----------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        self._schedule(0)
        self._start_watch()

    def stop(self) -> defer.Deferred[None]:
        """
        Stop campaigning; a leader resigns (stops commanding now, then
        revokes its lease so another member can win at once).
        """
        self._running = False
        self._cancel(self._call)
        self._call = None
        self._stop_watch()
        lease = self.lease
        if self.role is Role.LEADER:
            self._step_down("this member is stopping")
        self.lease = 0
        if lease:
            d = self._request(self.store.revoke(lease))
            d.addErrback(lambda f: self.log.warn(
                "could not revoke lease {lease} while stopping: {error}", lease=lease, error=f.getErrorMessage()
            ))
        # Every request still on its way ends within its timeout.
        waits = list(self._pending)
        done = defer.gatherResults(waits, consumeErrors=True) if waits else defer.succeed(None)
        return done.addCallback(lambda _: None)

    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    def may_command(self) -> bool:
        """
        Whether this member may send commands now: it leads and its own
        deadline has not passed (checked against the clock, not a timer).
        """
        if self.role is not Role.LEADER:
            return False
        if self.now() >= self.deadline:
            self._step_down("the lease could not be renewed before the step-down deadline")
            return False
        return True

    def status(self) -> dict[str, Any]:
        leader = self.leader
        return {
            "role": self.role.value,
            "member_id": self.member.member_id,
            "epoch": self.epoch,
            "leader_id": leader.member_id if leader else None,
            "leader_agent_address": leader.agent_address if leader else None,
            "leader_admin_url": leader.admin_url if leader else None,
            "leader_admin_problem": leader.admin_problem if leader else None,
            "leader_epoch": self.leader_epoch,
            "lease_ttl": self.ttl,
            "terms": self.terms,
            "last_error": self.last_error,
        }

    # -- machinery --------------------------------------------------------------

    def _cancel(self, call: IDelayedCall | None) -> None:
        if call is not None and call.active():
            call.cancel()

    def _schedule(self, delay: float) -> None:
        self._cancel(self._call)
        self._call = self.clock.callLater(delay, self._tick) if self._running else None

    def _request(self, result: Any) -> defer.Deferred[Any]:
        d = defer.ensureDeferred(result) if not isinstance(result, defer.Deferred) else result
        d.addTimeout(self.request_timeout, self.clock)
        # Tracked so that stop() can wait for what is still on its way.
        tracker: defer.Deferred[None] = defer.Deferred()
        self._pending.add(tracker)

        def settled(result: Any) -> Any:
            self._pending.discard(tracker)
            tracker.callback(None)
            return result

        d.addBoth(settled)
        return d

    def _start_watch(self) -> None:
        self._watch_retry = None
        watch = getattr(self.store, "watch", None)
        if not self._running or watch is None:
            return
        try:
            w = watch(self.key, self._leader_key_events)
        except Exception as e:  # noqa: BLE001 - the poll covers a watch that cannot start
            self.log.debug("etcd: cannot watch the leader key ({error}); polling only", error=str(e))
            self._watch_retry = self.clock.callLater(self.retry_interval, self._start_watch)
            return
        self._watch = w

        def ended(_: Any) -> None:
            # Broken or ended (etcd unreachable, member changed): the poll
            # goes on meanwhile; watch again after a pause.
            if self._watch is w:
                self._watch = None
                if self._running:
                    self._watch_retry = self.clock.callLater(self.retry_interval, self._start_watch)

        w.done.addBoth(ended)

    def _stop_watch(self) -> None:
        self._cancel(self._watch_retry)
        self._watch_retry = None
        w, self._watch = self._watch, None
        if w is not None:
            w.cancel()

    def _leader_key_events(self, events: list[Any], revision: int) -> None:
        if not self._running or self.role is not Role.FOLLOWER:
            return
        if not any(ev.kind == "DELETE" for ev in events):
            return
        # The leader's key is gone: nobody leads, so campaign now rather
        # than at the next attempt.
        self.woken += 1
        if self._busy:
            self._campaign_now = True
        else:
            self._schedule(0)

    def _tick(self) -> None:
        self._call = None
        if self._busy or not self._running:
            return
        self._busy = True
        d = defer.ensureDeferred(self._lead_once() if self.role is Role.LEADER else self._campaign_once())

        def done(result: Any) -> None:
            self._busy = False
            ok = result is True
            if hasattr(result, "getErrorMessage"):
                self.log.failure("election step failed", result)
            leading = self.role is Role.LEADER
            if self._campaign_now and not leading and self._running:
                self._campaign_now = False
                self._schedule(0)
            elif self._running and self._call is None:
                # A leader whose renewal failed tries again soon: its
                # deadline is running.
                self._schedule(self.renew_interval if leading and ok else self.retry_interval)
            self._campaign_now = False

        d.addBoth(done)

    def _failed(self, what: str, e: BaseException) -> None:
        text = str(e) or e.__class__.__name__
        if isinstance(e, defer.TimeoutError | defer.CancelledError):
            text = f"no answer within {self.request_timeout}s"
        if text != self.last_error:
            self.log.warn("etcd: {what} failed: {error}", what=what, error=text)
        self.last_error = text

    async def _campaign_once(self) -> None:
        if self.lease and self.now() >= self.deadline:
            self.lease = 0  # too close to its expiry to lead on: take a new one
        if not self.lease:
            sent = self.now()
            try:
                lease, ttl = await self._request(self.store.grant(self.ttl))
            except (EtcdError, defer.TimeoutError, defer.CancelledError) as e:
                self._failed("granting a lease", e)
                return
            self.lease, self.deadline = lease, sent + ttl - self.margin
        sent = self.now()
        try:
            result = await self._request(self.store.txn(
                [Compare.absent(self.key)],
                [Put(self.key, self.member.encode(), lease=self.lease)],
                [Range(self.key)],
            ))
        except (EtcdError, defer.TimeoutError, defer.CancelledError) as e:
            self._failed("campaigning", e)
            if isinstance(e, EtcdError) and "lease not found" in e.message:
                self.lease = 0
            return
        if not self._running:
            return
        if result.succeeded:
            self._won(result.revision, sent)
            return
        kvs = result.kvs(0)
        if not kvs:
            return  # the leader key went between compare and read: try again
        holder = kvs[0]
        if holder.lease == self.lease:
            # Our own earlier transaction won, and its answer was lost.
            self._won(holder.create_revision, sent)
            return
        info = MemberInfo.decode(holder.value)
        if info != self.leader or holder.create_revision != self.leader_epoch:
            self.log.info(
                "etcd: member {leader} leads (epoch {epoch}); this member ({me}) stands by",
                leader=info.member_id if info else "?", epoch=holder.create_revision,
                me=self.member.member_id,
            )
        self.leader, self.leader_epoch = info, holder.create_revision
        self.last_error = ""
        # Keep our lease alive while we wait, so a win needs one step only.
        sent = self.now()
        try:
            ttl = await self._request(self.store.keepalive(self.lease))
        except (EtcdError, defer.TimeoutError, defer.CancelledError) as e:
            self._failed("renewing a follower's lease", e)
            return
        if ttl <= 0:
            self.lease = 0
        else:
            self.deadline = sent + ttl - self.margin

    def _won(self, epoch: int, sent: float) -> None:
        # The lease was renewed no earlier than the grant; the deadline from
        # the grant (or the last keepalive) stays conservative.
        self.role = Role.LEADER
        self.epoch = epoch
        self.leader, self.leader_epoch = self.member, epoch
        self.terms += 1
        self.last_error = ""
        self._arm_step_down()
        self.log.info(
            "etcd: this member ({me}) leads from epoch {epoch}; lease TTL {ttl}s, "
            "stepping down {margin}s before it could expire",
            me=self.member.member_id, epoch=epoch, ttl=self.ttl, margin=self.margin,
        )
        self.on_elected(epoch)

    def _arm_step_down(self) -> None:
        self._cancel(self._step_down_call)
        delay = max(0.0, self.deadline - self.now())
        self._step_down_call = self.clock.callLater(
            delay, self._step_down, "the lease could not be renewed before the step-down deadline"
        )

    async def _lead_once(self) -> bool:
        sent = self.now()
        lease = self.lease
        try:
            ttl = await self._request(self.store.keepalive(lease))
        except (EtcdError, defer.TimeoutError, defer.CancelledError) as e:
            self._failed("renewing the leader's lease", e)
            return False
        if self.role is not Role.LEADER or self.lease != lease:
            return False
        if ttl <= 0:
            self._step_down("etcd no longer holds this leader's lease")
            return False
        try:
            holder = await self._request(self.store.get(self.key))
        except (EtcdError, defer.TimeoutError, defer.CancelledError) as e:
            self._failed("checking the leader key", e)
            return False
        if self.role is not Role.LEADER or self.lease != lease:
            return False
        if holder is None or holder.lease != lease:
            self._step_down("the leader key no longer holds this member's lease")
            return False
        self.deadline = max(self.deadline, sent + ttl - self.margin)
        self.last_error = ""
        self._arm_step_down()
        return True

    def _step_down(self, reason: str) -> None:
        if self.role is not Role.LEADER:
            return
        self.role = Role.FOLLOWER
        epoch = self.epoch
        self.epoch = 0
        self.leader = None
        self._cancel(self._step_down_call)
        self._step_down_call = None
        # Never resume on this lease: winning again needs a new one.
        old, self.lease = self.lease, 0
        self.log.error(
            "etcd: this member ({me}) steps down from epoch {epoch}: {reason}",
            me=self.member.member_id, epoch=epoch, reason=reason,
        )
        # Stop commanding first; then hand the lease back, so another
        # member need not wait for it to expire.
        self.on_deposed(reason)
        if old and self._running:
            self._request(self.store.revoke(old)).addErrback(lambda f: None)
        if self._running:
            self._schedule(self.retry_interval)
