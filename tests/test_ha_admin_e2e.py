"""
End to end, on loopback: a real 3-member etcd cluster and three real
control-plane members (C{twistd llmgw control --etcd ... --advertise-admin
URL}); the admin API of a member that does not lead redirects to the
leader, and the ctl and a gateway follower given several URLs reach it. Bounded; skipped when etcd is not installed.
"""

from __future__ import annotations

import io
from typing import Any

import treq
from twisted.internet import defer, reactor, threads

from llmgw.ctl.main import build_parser
from llmgw.gateway.follower import FollowerTable
from llmgw.testing.procs import free_port
from tests import test_ha_e2e as base


class HAAdminEndToEndTests(base.HAProcessCase):
    timeout = 120

    # The failover tests' helpers: catalog, members, waits.
    catalog = base.HAEndToEndTests.catalog
    start_members = base.HAEndToEndTests.start_members
    get = base.HAEndToEndTests.get
    statuses = base.HAEndToEndTests.statuses
    wait = base.HAEndToEndTests.wait
    tail = base.HAEndToEndTests.tail

    async def agreed_leader(self) -> str | None:
        """The leader, once every member names it."""
        sts = await self.statuses()
        leaders = [m for m, st in sts.items() if st.get("role") == "leader"]
        if len(sts) != 3 or len(leaders) != 1:
            return None
        return leaders[0] if all(st.get("leader_id") == leaders[0] for st in sts.values()) else None

    def test_followers_send_clients_to_the_leader(self) -> Any:
        """
        A follower answers a read with 307 to the leader's advertised admin
        URL (the nodes, once it holds the leader's published views, itself);
        the ctl given the follower's URL gets the leader's answer; a
        gateway follower whose first URL is dead reads the routes through
        the follower from the leader.
        """
        async def go() -> None:
            self.start_members()
            leader = await self.wait("a leader every member names", self.agreed_leader)
            follower = next(m for m in self.members if m != leader)
            r = await treq.get(self.admin[follower] + "/api/v1/deployments", allow_redirects=False,
                               timeout=5.0, persistent=False)
            body = await r.json()
            self.assertEqual(r.code, 307, body)
            self.assertEqual(r.headers.getRawHeaders(b"location"),
                             [f"{self.admin[leader]}/api/v1/deployments".encode()])

            async def nodes_here() -> Any:
                # Nodes are answered there, from the leader's published views.
                r = await treq.get(self.admin[follower] + "/api/v1/nodes", allow_redirects=False,
                                   timeout=5.0, persistent=False)
                body = await r.json()
                return body if r.code == 200 else None

            nodes = await self.wait("the follower answering the nodes itself", nodes_here)
            self.assertEqual(nodes["published_by"], leader)
            status = await self.get(follower, "/api/v1/status")
            self.assertEqual((status["role"], status["leader_id"]), ("follower", leader))

            def run() -> tuple[int, str, str]:
                args = build_parser().parse_args(
                    ["ctl", "deployments", "--json", "--admin-url", self.admin[follower], "--timeout", "5"])
                out, err = io.StringIO(), io.StringIO()
                return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()

            code, out, err = await threads.deferToThread(run)
            # Deployments are not published: the follower redirects, and ctl
            # says where the request went.
            self.assertEqual(code, 0, out)
            self.assertEqual(err, f"llmgw ctl deployments: {self.admin[follower]} does not lead; "
                                  f"GET sent to the leader {leader} at {self.admin[leader]}\n")
            self.assertIn("deployments", out)

            table = FollowerTable(reactor, [f"http://127.0.0.1:{free_port()}", self.admin[follower]], timeout=5)
            self.addCleanup(table.close)
            self.assertFalse(await table.poll())
            self.assertTrue(await table.poll())
            self.assertEqual(table.answered_by, self.admin[leader])

        return defer.Deferred.fromCoroutine(go())
