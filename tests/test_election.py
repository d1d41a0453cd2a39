"""
L{llmgw.control.ha.election}: campaign, renewal and fencing against the
in-memory etcd, on a Clock.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial import unittest

from llmgw.control.ha.election import Election, MemberInfo, Role, leader_key
from llmgw.testing.fakeetcd import FakeEtcd


class Member:
    """One election with a log of what it was told."""

    def __init__(self, fake: FakeEtcd, clock: Clock, name: str, ttl: int = 10):
        self.events: list[tuple[str, object]] = []
        self.election = Election(
            fake, clock, "/llmgw", MemberInfo(name, f"{name}.example:7443", f"https://{name}:7444"),
            on_elected=lambda epoch: self.events.append(("elected", epoch)),
            on_deposed=lambda reason: self.events.append(("deposed", reason)),
            ttl=ttl,
        )


class ElectionTests(unittest.SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.fake = FakeEtcd(self.clock)
        # A store that is written before the election: epochs are revisions.
        self.fake.put(b"/other", b"x")

    def member(self, name: str, ttl: int = 10) -> Member:
        m = Member(self.fake, self.clock, name, ttl)
        m.election.start()
        self.addCleanup(m.election.stop)
        return m

    def advance(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    def test_first_member_wins_with_revision_epoch(self) -> None:
        """
        The first member to campaign leads; its epoch is the revision of
        the transaction that created the leader key, and the key holds its
        record under its lease.
        """
        a = self.member("a")
        self.clock.advance(0)
        e = a.election
        self.assertIs(e.role, Role.LEADER)
        kv = self.fake.kvs[leader_key("/llmgw")]
        self.assertEqual(e.epoch, kv.create_revision)
        self.assertEqual(kv.lease, e.lease)
        self.assertEqual(a.events, [("elected", e.epoch)])
        self.assertEqual(MemberInfo.decode(kv.value), e.member)
        self.assertTrue(e.may_command())
        self.assertEqual(e.status()["role"], "leader")

    def test_deadline_is_on_the_monotonic_clock(self) -> None:
        """
        With a monotonic clock given, the lease deadline is reckoned on it:
        once it has run past the deadline the leader may not command, even
        though the reactor's (wall) clock has not moved.
        """
        mono = Clock()
        e = Election(self.fake, self.clock, "/llmgw", MemberInfo("a", "a.example:7443"), ttl=10,
                     monotonic=mono.seconds)
        e.start()
        self.addCleanup(e.stop)
        self.clock.advance(0)
        self.assertTrue(e.may_command())
        mono.advance(10)
        self.assertFalse(e.may_command())

    def test_second_member_follows_and_knows_leader(self) -> None:
        """
        A second member stands by, knowing the leader's id, agent address
        and epoch, and does not lead while the leader renews.
        """
        a = self.member("a")
        self.clock.advance(0)
        b = self.member("b")
        self.advance(60)
        self.assertIs(a.election.role, Role.LEADER)
        self.assertIs(b.election.role, Role.FOLLOWER)
        self.assertFalse(b.election.may_command())
        st = b.election.status()
        self.assertEqual(
            (st["role"], st["leader_id"], st["leader_agent_address"], st["leader_epoch"]),
            ("follower", "a", "a.example:7443", a.election.epoch),
        )
        self.assertEqual(b.events, [])
        self.assertEqual(a.events, [("elected", a.election.epoch)])

    def test_leader_renews_at_a_third_of_ttl(self) -> None:
        """
        A leader renews its lease about every TTL/3 and keeps leading for as
        long as renewals succeed.
        """
        a = self.member("a")
        self.clock.advance(0)
        before = self.fake.calls.count("keepalive")
        self.advance(100)
        renewals = self.fake.calls.count("keepalive") - before
        self.assertTrue(29 <= renewals <= 31, renewals)
        self.assertTrue(a.election.may_command())

    def test_renewals_lost_step_down_before_expiry(self) -> None:
        """
        When renewals fail, the leader stops commanding on its own clock
        before etcd can expire its lease: at the moment it steps down the
        lease is still held, so nobody else can have won yet. The other
        member wins only after the lease expired, with a larger epoch.
        """
        a = self.member("a")
        self.clock.advance(0)
        b = self.member("b")
        self.advance(5)
        first = a.election.epoch
        lease = a.election.lease
        # a is cut off from etcd; b still reaches it (a different fake view
        # is not needed: b's requests are the ones that keep succeeding).
        real_keepalive = self.fake.keepalive
        real_get = self.fake.get

        def cut(name: str, real: object) -> object:
            def call(*args: object, **kw: object) -> object:
                from twisted.internet import defer

                from llmgw.etcd import EtcdUnavailable
                if args and args[0] in (lease, leader_key("/llmgw")) and a.election.lease == lease:
                    return defer.fail(EtcdUnavailable("cut off"))
                return real(*args, **kw)  # type: ignore[operator]
            return call

        self.fake.keepalive = cut("keepalive", real_keepalive)  # type: ignore[method-assign]
        self.fake.get = cut("get", real_get)  # type: ignore[method-assign]
        expires_at = self.fake.leases[lease]
        at_step_down: list[tuple[float, bool, Role]] = []
        a.election.on_deposed = lambda reason: at_step_down.append(
            (self.clock.seconds(), lease in self.fake.leases, b.election.role)
        )
        while a.election.role is Role.LEADER:
            self.clock.advance(0.05)
        [(stepped_at, still_held, b_role)] = at_step_down
        self.assertTrue(still_held, "the lease expired before the leader stepped down")
        self.assertIs(b_role, Role.FOLLOWER)
        self.assertLessEqual(stepped_at, expires_at - a.election.margin + 0.05)
        self.advance(12)
        self.assertIs(b.election.role, Role.LEADER)
        self.assertGreater(b.election.epoch, first)

    def test_may_command_checks_clock_not_timer(self) -> None:
        """
        A leader whose timers ran late (a frozen process waking up) may not
        command once its deadline has passed, even before the step-down
        timer has run.
        """
        a = self.member("a")
        self.clock.advance(0)
        self.fake.hang = True
        # Jump the clock without running timers in between.
        self.clock.rightNow += 30
        self.assertFalse(a.election.may_command())
        self.assertIs(a.election.role, Role.FOLLOWER)

    def test_late_renewals_within_margin_keep_leading(self) -> None:
        """
        Renewals that time out for a while, then succeed before the
        deadline, keep the leader leading with the same epoch.
        """
        a = self.member("a")
        self.clock.advance(0)
        epoch = a.election.epoch
        self.fake.hang = True
        self.advance(5)
        self.assertIs(a.election.role, Role.LEADER)
        self.fake.hang = False
        self.advance(30)
        self.assertIs(a.election.role, Role.LEADER)
        self.assertEqual(a.election.epoch, epoch)
        self.assertEqual(a.events, [("elected", epoch)])

    def test_never_resumes_without_winning_again(self) -> None:
        """
        A leader that stepped down when etcd was unreachable does not lead
        again when etcd returns on the strength of its old term: it wins a
        new transaction with a new, larger epoch (and a new lease).
        """
        a = self.member("a")
        self.clock.advance(0)
        first, first_lease = a.election.epoch, a.election.lease
        self.fake.available = False
        self.advance(12)
        self.assertIs(a.election.role, Role.FOLLOWER)
        self.assertFalse(a.election.may_command())
        self.fake.available = True
        self.advance(12)
        self.assertIs(a.election.role, Role.LEADER)
        self.assertGreater(a.election.epoch, first)
        self.assertNotEqual(a.election.lease, first_lease)
        self.assertEqual([k for k, _ in a.events], ["elected", "deposed", "elected"])

    def test_lease_gone_steps_down_at_once(self) -> None:
        """
        A renewal that etcd answers with "no such lease" ends leadership at
        once, without waiting for the deadline.
        """
        a = self.member("a")
        self.clock.advance(0)
        first = a.election.epoch
        self.fake.expire(a.election.lease)
        self.advance(a.election.renew_interval + 0.05, step=0.05)
        self.assertEqual([k for k, _ in a.events][:2], ["elected", "deposed"])
        # Alone, it wins again, in a new term.
        self.advance(1)
        self.assertEqual([k for k, _ in a.events], ["elected", "deposed", "elected"])
        self.assertGreater(a.election.epoch, first)

    def test_key_taken_away_steps_down(self) -> None:
        """
        If the leader key no longer carries the leader's lease (deleted by
        an operator, say), the leader steps down at its next renewal.
        """
        a = self.member("a")
        self.clock.advance(0)
        self.fake.delete(leader_key("/llmgw"))
        self.advance(a.election.renew_interval + 0.05, step=0.05)
        self.assertEqual([k for k, _ in a.events][:2], ["elected", "deposed"])

    def test_stop_resigns_for_a_fast_handover(self) -> None:
        """
        A leader that stops revokes its lease, so another member wins
        within one retry interval rather than a TTL.
        """
        a = self.member("a")
        self.clock.advance(0)
        b = self.member("b")
        self.advance(1)
        a.election.stop()
        self.advance(1)
        self.assertIs(b.election.role, Role.LEADER)
        self.assertIs(a.election.role, Role.FOLLOWER)

    def test_epochs_increase_over_many_terms(self) -> None:
        """
        Across repeated failovers between three members, each new term's
        epoch is larger than every earlier one and no two members lead at
        once.
        """
        ms = [self.member(n) for n in "abc"]
        epochs: list[int] = []
        for _ in range(6):
            self.advance(1)
            leaders = [m for m in ms if m.election.role is Role.LEADER]
            self.assertEqual(len(leaders), 1)
            epochs.append(leaders[0].election.epoch)
            self.fake.expire(leaders[0].election.lease)
            self.advance(leaders[0].election.renew_interval + 1)
        self.assertEqual(epochs, sorted(set(epochs)))

    def dead_leader(self, ttl: int = 10) -> int:
        """
        A leader key held under a lease that nobody renews (a leader killed
        with -9): returns the lease, which expires C{ttl} seconds from now.
        """
        lease, _ = self.successResultOf(self.fake.grant(ttl))
        self.fake.put(leader_key("/llmgw"), MemberInfo("dead", "dead:7443").encode(), lease=lease)
        return lease

    def slow_poll_member(self, name: str, retry: float = 4.0) -> Member:
        m = Member(self.fake, self.clock, name)
        m.election.retry_interval = retry
        m.election.start()
        self.addCleanup(m.election.stop)
        return m

    def test_follower_campaigns_on_the_leader_keys_delete(self) -> None:
        """
        When the leader's lease expires, a follower wins at that instant,
        not at its next campaign attempt: it watches the leader key and
        campaigns on the key's delete.
        """
        lease = self.dead_leader()
        b = self.slow_poll_member("b", retry=4.0)
        self.advance(6)
        self.assertIs(b.election.role, Role.FOLLOWER)
        self.assertEqual(b.election.leader, MemberInfo("dead", "dead:7443"))
        self.fake.expire(lease)
        self.clock.advance(0)
        self.assertIs(b.election.role, Role.LEADER)
        self.assertEqual(b.election.woken, 1)
        self.assertEqual([k for k, _ in b.events], ["elected"])

    def test_one_follower_wins_when_all_wake_at_once(self) -> None:
        """
        Several followers woken by the same delete campaign at once, and
        exactly one of them leads; the others follow it.
        """
        lease = self.dead_leader()
        ms = [self.slow_poll_member(n) for n in "bcd"]
        self.advance(1)
        self.fake.expire(lease)
        self.clock.advance(0)
        leaders = [m for m in ms if m.election.role is Role.LEADER]
        self.assertEqual(len(leaders), 1)
        winner = leaders[0].election.member
        self.assertEqual({m.election.leader for m in ms}, {winner})

    def test_delete_during_a_campaign_step_campaigns_again_at_once(self) -> None:
        """
        A delete that arrives while a campaign step is still waiting for
        etcd is not lost: the follower campaigns again as soon as that
        step ends, not at the attempt after it.
        """
        lease = self.dead_leader()
        b = self.slow_poll_member("b", retry=4.0)
        self.advance(1)
        # The next step (at 4 s) hangs in its transaction; the key goes
        # meanwhile.
        self.fake.hang = True
        self.advance(4)
        self.assertTrue(b.election._busy)
        self.fake.hang = False
        self.fake.expire(lease)
        self.assertIs(b.election.role, Role.FOLLOWER)
        # The hung request times out; the follower campaigns at once then.
        self.advance(b.election.request_timeout + 0.1)
        self.assertIs(b.election.role, Role.LEADER)

    def test_broken_watch_polls_and_watches_again(self) -> None:
        """
        If the watch on the leader key ends (etcd member gone), the
        follower still takes over at its next poll, and watches again.
        """
        lease = self.dead_leader()
        b = self.slow_poll_member("b", retry=2.0)
        self.advance(1)
        [w] = self.fake.watches
        w.cancel()
        self.assertEqual(self.fake.watches, set())
        self.advance(2.1)
        self.assertEqual(len(self.fake.watches), 1)
        w2 = next(iter(self.fake.watches))
        w2.cancel()
        self.fake.expire(lease)
        self.clock.advance(0)
        self.assertIs(b.election.role, Role.FOLLOWER)
        self.advance(2.1)
        self.assertIs(b.election.role, Role.LEADER)
        self.assertEqual(b.election.woken, 0)

    def test_stop_ends_the_watch(self) -> None:
        """A stopped election leaves no watch open on etcd."""
        b = self.slow_poll_member("b")
        self.advance(1)
        self.assertEqual(len(self.fake.watches), 1)
        b.election.stop()
        self.advance(10)
        self.assertEqual(self.fake.watches, set())

    def test_bad_parameters_refused(self) -> None:
        """A TTL under 2 s, or a margin not below the TTL, is refused."""
        with self.assertRaises(ValueError):
            Election(self.fake, self.clock, "/p", MemberInfo("a"), ttl=1)
        with self.assertRaises(ValueError):
            Election(self.fake, self.clock, "/p", MemberInfo("a"), ttl=5, margin=5)
