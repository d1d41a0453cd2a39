"""
End to end, on loopback: deploying into an HA control plane (a real
3-member etcd cluster and three real control-plane members). A deployment
added through a member that does not lead reaches the leader, which stores
it in etcd's catalog and runs it; removing it likewise. Bounded; skipped
when etcd is not installed.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from twisted.internet import defer, threads

from llmgw.control.ha.member import catalog_key
from llmgw.ctl.catalog import SyncEtcd
from llmgw.ctl.main import build_parser
from tests import test_ha_admin_e2e as admin_e2e
from tests import test_ha_e2e as base


class HADeployEndToEndTests(base.HAProcessCase):
    timeout = 120

    catalog = base.HAEndToEndTests.catalog
    start_members = base.HAEndToEndTests.start_members
    get = base.HAEndToEndTests.get
    statuses = base.HAEndToEndTests.statuses
    wait = base.HAEndToEndTests.wait
    tail = base.HAEndToEndTests.tail
    agreed_leader = admin_e2e.HAAdminEndToEndTests.agreed_leader

    def ctl(self, *argv: str) -> tuple[int, str, str]:
        args = build_parser().parse_args(["ctl", *argv, "--timeout", "5"])
        out, err = io.StringIO(), io.StringIO()
        return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()

    def etcd_catalog(self) -> str:
        answer = SyncEtcd(self.cluster.urls).call(
            "/kv/range", {"key": base64.b64encode(catalog_key("/llmgw")).decode()})
        return base64.b64decode(answer["kvs"][0]["value"]).decode()

    def test_deploy_through_a_follower(self) -> Any:
        """
        C{ctl deploy} given a follower's URL is sent on to the leader, which
        stores the new table in etcd's catalog (the rest of the text kept)
        and runs the deployment; a refused one leaves etcd as it was;
        C{ctl undeploy} removes it from both.
        """
        async def go() -> None:
            self.start_members()
            leader = await self.wait("a leader every member names", self.agreed_leader)
            follower = next(m for m in self.members if m != leader)
            before = await threads.deferToThread(self.etcd_catalog)

            code, out, err = await threads.deferToThread(
                self.ctl, "deploy", "extra", "--profile", "fake-1gpu", "--replicas", "0",
                "--admin-url", self.admin[follower])
            self.assertEqual(code, 0, err)
            self.assertIn(f"does not lead; PUT sent to the leader {leader}", err)
            self.assertRegex(out, r"^extra: added in etcd /llmgw/catalog \(revision \d+\)\n$")
            stored = await threads.deferToThread(self.etcd_catalog)
            self.assertTrue(stored.startswith(before), stored)
            self.assertIn('model = "extra"', stored)

            async def deployed() -> Any:
                views = await self.get(leader, "/api/v1/deployments")
                return views and [d for d in views["deployments"] if d["model"] == "extra"]

            await self.wait("the leader running the new deployment", deployed)

            code, _, err = await threads.deferToThread(
                self.ctl, "deploy", "extra", "--profile", "nope", "--admin-url", self.admin[leader])
            self.assertEqual(code, 1)
            self.assertIn("deployment 'extra': field 'profile'", err)
            self.assertEqual(await threads.deferToThread(self.etcd_catalog), stored)

            code, out, err = await threads.deferToThread(
                self.ctl, "undeploy", "extra", "--admin-url", self.admin[leader])
            self.assertEqual(code, 0, err)
            self.assertEqual(await threads.deferToThread(self.etcd_catalog), before)
            views = await self.get(leader, "/api/v1/deployments")
            self.assertNotIn("extra", json.dumps(views))

        return defer.Deferred.fromCoroutine(go())
