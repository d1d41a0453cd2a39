"""
L{llmgw.control.ha.election} against a real etcd member on loopback:
campaign, step-down when etcd stops answering, and a deposed leader's
compare-and-swap failing. Skipped when etcd is not installed.
"""

from __future__ import annotations

import signal

from twisted.internet import defer, reactor
from twisted.trial import unittest

from llmgw.control.ha.election import Election, MemberInfo, Role, leader_key
from llmgw.etcd import Compare, EtcdClient, Put
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster, until


class RealElectionTests(unittest.TestCase):
    skip = ETCD_MISSING
    timeout = 90

    async def _setUp(self) -> None:
        self.cluster = EtcdCluster(1)
        self.addCleanup(lambda: defer.Deferred.fromCoroutine(self.cluster.stop()))
        await self.cluster.start(reactor)
        self.events: list[tuple[str, str, object]] = []

    def setUp(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._setUp())

    def member(self, name: str) -> Election:
        client = EtcdClient(reactor, self.cluster.urls, timeout=0.5)
        self.addCleanup(client.close)
        e = Election(
            client, reactor, "/llmgw", MemberInfo(name, f"{name}:7443"),
            on_elected=lambda epoch: self.events.append(("elected", name, epoch)),
            on_deposed=lambda reason: self.events.append(("deposed", name, reason)),
            ttl=3, retry_interval=0.2,
        )
        e.start()
        self.addCleanup(e.stop)
        return e

    def test_follower_takes_over_when_etcd_expires_the_lease(self) -> None:
        """
        A leader key under a lease nobody renews (a leader killed with -9):
        a follower whose next attempt is a minute away still leads within a
        second of etcd expiring the lease, woken by its watch on the key.
        """
        async def go() -> None:
            client = EtcdClient(reactor, self.cluster.urls)
            self.addCleanup(client.close)
            lease, _ = await client.grant(2)
            await client.put(leader_key("/llmgw"), MemberInfo("dead", "dead:7443").encode(), lease=lease)
            b = Election(client, reactor, "/llmgw", MemberInfo("b", "b:7443"), ttl=3, retry_interval=60)
            b.start()
            self.addCleanup(b.stop)
            await until(lambda: b.leader is not None, 5, "the follower seeing the dead leader")
            self.assertIs(b.role, Role.FOLLOWER)
            # Its next attempt is a minute away: leading sooner means the
            # watch woke it (counted below), however slow etcd is to expire.
            await until(lambda: b.role is Role.LEADER, 30, "the follower leading")
            self.assertEqual(b.woken, 1)
        return defer.Deferred.fromCoroutine(go())  # type: ignore[return-value]

    def test_campaign_stepdown_and_fenced_write(self) -> None:
        """
        Of two members one leads with the leader key's create revision as
        its epoch; when etcd freezes the leader steps down on its own clock;
        when etcd returns a member wins with a larger epoch; a write guarded
        by the old leader's lease fails.
        """
        async def go() -> None:
            a, b = self.member("a"), self.member("b")
            await until(lambda: Role.LEADER in (a.role, b.role), 10, "a leader")
            first = a if a.role is Role.LEADER else b
            other = b if first is a else a
            client = EtcdClient(reactor, self.cluster.urls)
            self.addCleanup(client.close)
            kv = await client.get(leader_key("/llmgw"))
            assert kv is not None
            self.assertEqual(kv.create_revision, first.epoch)
            self.assertIs(other.role, Role.FOLLOWER)
            self.assertEqual(other.leader, first.member)
            old_lease, old_epoch = first.lease, first.epoch

            self.cluster.members[0].signal(signal.SIGSTOP)
            await until(lambda: first.role is Role.FOLLOWER, 30, "the leader stepping down")
            # It stepped down at its own deadline, before its lease could
            # have run out: not told by etcd that the lease was gone.
            deposed = [r for k, n, r in self.events if k == "deposed" and n == first.member.member_id]
            self.assertEqual(deposed, ["the lease could not be renewed before the step-down deadline"])
            self.assertFalse(first.may_command())
            self.cluster.members[0].signal(signal.SIGCONT)

            await until(lambda: Role.LEADER in (a.role, b.role), 15, "a new leader")
            leader = a if a.role is Role.LEADER else b
            self.assertGreater(leader.epoch, old_epoch)
            fenced = await client.txn(
                [Compare.held_by(leader_key("/llmgw"), old_lease)], [Put(b"/llmgw/state", b"stale")]
            )
            self.assertFalse(fenced.succeeded)
            self.assertIsNone(await client.get(b"/llmgw/state"))
            self.assertEqual([k for k, n, _ in self.events if n == first.member.member_id][:2],
                             ["elected", "deposed"])
        return defer.Deferred.fromCoroutine(go())  # type: ignore[return-value]


class CatalogApplyTests(unittest.TestCase):
    skip = ETCD_MISSING
    timeout = 60

    def setUp(self) -> defer.Deferred[None]:
        self.cluster = EtcdCluster(1)
        self.addCleanup(lambda: defer.Deferred.fromCoroutine(self.cluster.stop()))
        return defer.Deferred.fromCoroutine(self.cluster.start(reactor))

    def test_apply_only_under_a_leader(self) -> None:
        """
        `llmgw ctl catalog apply` refuses an invalid file and, with no
        leader, stores nothing; with a leader it stores the file's text
        under PREFIX/catalog.
        """
        import io
        import tempfile
        from pathlib import Path

        from llmgw.ctl.main import build_parser

        demo = (Path(__file__).parent.parent / "llmgw" / "demo-catalog.toml").read_bytes()
        path = Path(tempfile.mkdtemp(dir=".")) / "c.toml"
        path.write_bytes(b"[[deployments]]\nmodel = 3\n")
        urls = ",".join(self.cluster.urls)

        def run(args: list[str]) -> tuple[int, str]:
            ns = build_parser().parse_args(["ctl", "catalog", "apply", str(path), "--etcd", urls, *args])
            out, err = io.StringIO(), io.StringIO()
            code = ns.func(ns, out, err)
            return code, out.getvalue() + err.getvalue()

        async def go() -> None:
            client = EtcdClient(reactor, self.cluster.urls)
            self.addCleanup(client.close)
            # ctl blocks: run it in a thread so the reactor stays free.
            from twisted.internet.threads import deferToThread

            code, text = await deferToThread(run, [])
            self.assertEqual(code, 1)
            self.assertIn("refused, nothing stored", text)
            path.write_bytes(demo)
            code, text = await deferToThread(run, [])
            self.assertEqual(code, 1)
            self.assertIn("no control-plane member leads", text)
            self.assertIsNone(await client.get(b"/llmgw/catalog"))
            e = Election(client, reactor, "/llmgw", MemberInfo("a", "a:7443"), ttl=3)
            e.start()
            self.addCleanup(e.stop)
            await until(lambda: e.role is Role.LEADER, 10, "a leader")
            code, text = await deferToThread(run, [])
            self.assertEqual(code, 0, text)
            kv = await client.get(b"/llmgw/catalog")
            assert kv is not None
            self.assertEqual(kv.value, demo)
        return defer.Deferred.fromCoroutine(go())  # type: ignore[return-value]
