"""
L{llmgw.control.ha.sharedstate} against a real etcd member on loopback: the
leader's scale and cordon are stored in etcd, a member that takes over
starts from them, and the deposed leader's write is refused by etcd.
Skipped when etcd is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

from twisted.internet import defer, reactor
from twisted.trial import unittest

import llmgw
from llmgw.control.ha.sharedstate import fleet_state_key
from llmgw.control.state.interfaces import AdminError
from llmgw.etcd import EtcdClient
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster, until
from tests.test_sharedstate import Member

DEMO = (Path(llmgw.__file__).parent / "demo-catalog.toml").read_bytes()


class RealSharedStateTests(unittest.TestCase):
    skip = ETCD_MISSING
    timeout = 90

    async def _setUp(self) -> None:
        self.cluster = EtcdCluster(1)
        self.addCleanup(lambda: defer.Deferred.fromCoroutine(self.cluster.stop()))
        await self.cluster.start(reactor)
        path = Path(self.mktemp())
        path.write_bytes(DEMO)
        self.catalog = str(path)

    def setUp(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._setUp())

    def client(self) -> EtcdClient:
        client = EtcdClient(reactor, self.cluster.urls, timeout=0.5)
        self.addCleanup(client.close)
        return client

    def member(self, name: str) -> Member:
        m = Member(reactor, self.client(), name, self.catalog)  # type: ignore[arg-type]
        m.ha.election.ttl = 3
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        return m

    def test_kept_in_etcd_taken_over_and_fenced(self) -> None:
        """
        The leader's scale and cordon are in etcd when the admin call
        answers; after it stops, the other member leads with them; the old
        leader's write under its old lease is refused with a 409 and etcd
        keeps the new leader's state.
        """
        async def go() -> None:
            a, b = self.member("a"), self.member("b")
            await until(lambda: a.ha.taken_over or b.ha.taken_over, 15, "a leader taking over")
            first, other = (a, b) if a.ha.taken_over else (b, a)
            await first.fleet.scale("demo", 3)
            await first.fleet.cordon("n1")
            kv = await self.client().get(fleet_state_key("/llmgw"))
            assert kv is not None
            data = json.loads(kv.value)
            self.assertEqual((data["replicas"]["demo"]["replicas"], data["cordoned"]), (3, ["n1"]))
            old_lease = first.ha.kept.lease
            await first.ha.stopService()
            await until(lambda: other.ha.taken_over, 15, "the other member taking over")
            self.assertEqual(other.reconciler.desired["demo"], 3)
            self.assertEqual(other.reconciler.state.cordoned, {"n1"})
            first.ha.kept.lease = old_lease
            with self.assertRaises(AdminError) as refused:
                await first.fleet.scale("demo", 5)
            self.assertEqual(refused.exception.status, 409)
            after = await self.client().get(fleet_state_key("/llmgw"))
            assert after is not None
            self.assertEqual(after.mod_revision, kv.mod_revision)
            await other.fleet.uncordon("n1")
            final = await self.client().get(fleet_state_key("/llmgw"))
            assert final is not None
            self.assertEqual(json.loads(final.value)["cordoned"], [])

        return defer.Deferred.fromCoroutine(go())
