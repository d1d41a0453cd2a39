"""
Two admin APIs on loopback, a leader and a member that does not lead (its
leader information injected, no etcd), with the real ctl and the real
gateway follower against them.
"""

from __future__ import annotations

import io
from typing import Any

from twisted.internet import reactor as global_reactor
from twisted.internet import threads
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from llmgw.control.admin.site import admin_site
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl import fleet as ctl
from llmgw.ctl.main import build_parser
from llmgw.gateway.follower import FollowerTable
from llmgw.routing import Route, RoutingTable
from llmgw.testing.fleet import sample_fleet
from tests.test_admin_ha import FakeControl, FakeHA
from tests.test_ctl import closed_port


class TwoMembersTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        reactor: Any = global_reactor
        self.leader_fleet: Any = sample_fleet()
        self.published = RoutingTable(reactor)
        self.published.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        self.leader_fleet.routing_table = self.published
        leader_port = reactor.listenTCP(0, admin_site(self.leader_fleet, make_registry()), interface="127.0.0.1")
        self.addCleanup(leader_port.stopListening)
        self.leader_url = f"http://127.0.0.1:{leader_port.getHost().port}"
        self.follower_fleet: Any = sample_fleet()
        ha = FakeHA(leader_admin_url=self.leader_url)
        follower_port = reactor.listenTCP(
            0, admin_site(self.follower_fleet, make_registry(), control=FakeControl(ha)), interface="127.0.0.1"
        )
        self.addCleanup(follower_port.stopListening)
        self.follower_url = f"http://127.0.0.1:{follower_port.getHost().port}"

    def ctl(self, *argv: str) -> Any:
        def run() -> tuple[int, str, str]:
            args = build_parser().parse_args(["ctl", *argv, "--admin-url", self.follower_url, "--timeout", "5"])
            out, err = io.StringIO(), io.StringIO()
            return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()

        return threads.deferToThread(run)

    @inlineCallbacks
    def test_ctl_through_a_follower(self) -> Any:
        """
        A cordon sent to the member that does not lead is done by the leader
        (the ctl follows the redirect over the socket, and says on stderr
        which leader, as the 307's body names it); the follower's own fleet
        is untouched; status is the follower's own.
        """
        code, out, err = yield self.ctl("cordon", "gpu-2")
        self.assertEqual((code, out), (0, "node gpu-2 cordoned\n"))
        leader = self.leader_url.split("://", 1)[1]
        self.assertEqual(err, f"llmgw ctl cordon: {self.follower_url} does not lead; POST sent to the leader "
                              f"cp-2 at http://{leader}\n")
        self.assertTrue(self.leader_fleet.node_views["gpu-2"]["cordoned"])
        self.assertFalse(self.follower_fleet.node_views["gpu-2"].get("cordoned"))
        code, out, err = yield self.ctl("status", "--json")
        self.assertEqual(code, ctl.EXIT_OK, err)
        self.assertIn('"role": "follower"', out)

    @inlineCallbacks
    def test_gateway_first_member_dead(self) -> Any:
        """
        A gateway given a dead admin URL first and the follower second reads
        the leader's routes through the follower's redirect.
        """
        reactor: Any = global_reactor
        table = FollowerTable(reactor, [f"http://127.0.0.1:{closed_port()}", self.follower_url], timeout=5)
        self.addCleanup(table.close)
        ok = yield table.poll()
        self.assertFalse(ok)
        self.assertFalse(table.loaded)
        ok = yield table.poll()
        self.assertTrue(ok)
        self.assertEqual([r.replica_id for r in table.routes("alpha")], ["r1"])
        self.assertEqual(table.answered_by, self.leader_url)
