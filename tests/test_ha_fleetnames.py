"""
The join check "a name another connected node holds is refused" on an HA
member that does not lead (L{llmgw.control.ha.fleetnames}): it answers from
the fleet view the leader publishes in etcd, against the in-memory etcd and
an injected clock.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.ha.fleetnames import FLEET_WAIT, FleetNames
from llmgw.control.ha.published_fleet import FleetDocument, FleetFollower, fleet_key, pack_fleet
from llmgw.control.ha.sharedpeople import SharedPeople
from llmgw.control.ha.sharedtokens import SharedTokens
from llmgw.control.shell.joining import JoinAuthority
from llmgw.testing.fakeetcd import FakeEtcd
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import RequestRefused, new_request

NOW = 1_700_000_000.0
PREFIX = "/llmgw"
FLEET = fleet_key(PREFIX)


def fleet_value(nodes: list[dict[str, Any]], at: float = NOW) -> bytes:
    """A fleet document as the leader publishes it, holding C{nodes}."""
    value = pack_fleet({"leader": "a", "leader_admin_url": "https://a:7480", "nodes": nodes,
                        "replicas": [], "events": [], "status": {}}, at)
    assert value is not None
    return value


class FleetDocumentConnectedTests(SynchronousTestCase):
    def test_connected_ids_only(self) -> None:
        """
        L{FleetDocument.connected} is the ids of the nodes published with
        C{connected} true; disconnected nodes and entries that are not
        nodes are left out.
        """
        doc = FleetDocument(fleet_value([
            {"id": "n1", "connected": True}, {"id": "n2", "connected": False}, {"id": "n3"},
            {"connected": True}, "n4",
        ]))
        self.assertEqual(doc.connected(), frozenset({"n1"}))

    def test_is_connected_exact(self) -> None:
        """
        L{FleetDocument.is_connected} says what L{FleetDocument.connected}
        says, for names absent, listed, listed disconnected, with characters
        JSON escapes, and named only inside another node's fields.
        """
        doc = FleetDocument(fleet_value([
            {"id": "n1", "connected": True, "shards": [{"id": "n9"}]}, {"id": "n2", "connected": False},
            {"id": "gpu-\u00e9", "connected": True}, {"id": "a\\b", "connected": True},
        ]))
        for name in ("n1", "n2", "n3", "n9", "gpu-\u00e9", "gpu-e", "a\\b"):
            self.assertEqual(doc.is_connected(name), name in doc.connected(), name)
        self.assertEqual(doc.connected(), frozenset({"n1", "gpu-\u00e9", "a\\b"}))


class FleetNamesTests(SynchronousTestCase):
    """L{FleetNames.holds}, on a member that follows the leader's view."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(NOW)
        self.etcd = FakeEtcd(self.clock)
        self.follower = FleetFollower(self.clock, self.etcd, PREFIX)
        self.follower.log = Logger(observer=lambda e: None)  # type: ignore[arg-type]
        self.addCleanup(self.follower.stop)
        self.follower.start()
        self.leads = False
        self.names = FleetNames(self.clock, self.follower, lambda: self.leads)

    def test_answers_from_the_published_view(self) -> None:
        """A name the leader published connected is held; one published disconnected, or absent, is not."""
        self.etcd.put(FLEET, fleet_value([{"id": "n1", "connected": True}, {"id": "n2", "connected": False}]))
        self.assertTrue(self.successResultOf(self.names.holds("n1")))
        self.assertFalse(self.successResultOf(self.names.holds("n2")))
        self.assertFalse(self.successResultOf(self.names.holds("n3")))

    def test_each_new_publication_is_used(self) -> None:
        """A node that disconnects is free once the leader publishes that; one that connects, held."""
        self.etcd.put(FLEET, fleet_value([{"id": "n1", "connected": True}]))
        self.assertTrue(self.successResultOf(self.names.holds("n1")))
        self.etcd.put(FLEET, fleet_value([{"id": "n1", "connected": False}, {"id": "n2", "connected": True}],
                                         NOW + 2))
        self.assertFalse(self.successResultOf(self.names.holds("n1")))
        self.assertTrue(self.successResultOf(self.names.holds("n2")))

    def test_leader_does_not_look(self) -> None:
        """While the member leads, the view is not consulted: its own streams are the fleet's."""
        self.leads = True
        self.assertFalse(self.successResultOf(self.names.holds("n1")))

    def test_waits_for_a_first_view(self) -> None:
        """A member holding no view yet waits for the leader's next publication, then answers from it."""
        d = self.names.holds("n1")
        self.clock.advance(1)
        self.assertNoResult(d)
        self.etcd.put(FLEET, fleet_value([{"id": "n1", "connected": True}]))
        self.clock.advance(0.25)
        self.assertTrue(self.successResultOf(d))

    def test_refused_when_no_view_comes(self) -> None:
        """Past the wait with no view, the join is refused with a reason that says why and what to do."""
        d = self.names.holds("n1")
        for _ in range(int(FLEET_WAIT / 0.25) + 1):
            self.clock.advance(0.25)
        f = self.failureResultOf(d, RequestRefused)
        self.assertIn("holds no fleet view from the leader yet", f.getErrorMessage())
        self.assertIn("'n1'", f.getErrorMessage())

    def test_elected_while_waiting(self) -> None:
        """A member that becomes leader while it waits stops waiting: its own streams answer."""
        d = self.names.holds("n1")
        self.clock.advance(1)
        self.leads = True
        self.clock.advance(0.25)
        self.assertFalse(self.successResultOf(d))


class FollowerJoinTests(SynchronousTestCase):
    """A join taken by a member that does not lead, wired as an HA member wires it."""

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        CertificateAuthority.init(self.dir)
        self.clock = Clock()
        self.clock.advance(NOW)
        self.etcd = FakeEtcd(self.clock)
        self.tokens = SharedTokens(self.etcd, PREFIX)
        self.follower = FleetFollower(self.clock, self.etcd, PREFIX)
        self.follower.log = Logger(observer=lambda e: None)  # type: ignore[arg-type]
        self.addCleanup(self.follower.stop)
        self.follower.start()
        self.authority = JoinAuthority(
            self.clock, TokenFile(None), lambda: list(CertificateAuthority.load(self.dir).roots),
            lambda n: False, signer_dir=self.dir, lifetime=datetime.timedelta(minutes=5))
        self.logged: list[dict[str, Any]] = []
        self.authority.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]

        class Member:
            joining = self.authority

        SharedPeople(self.clock, Member(), self.etcd, PREFIX, fleet=self.follower, leading=lambda: False)

    def join(self, tid: str, secret: str, name: str) -> pb.JoinResponse:
        req = pb.JoinRequest(token_id=tid, token_secret=secret, node_id=name, csr_pem=new_request(name)[1])
        return self.successResultOf(self.authority.answer(req, "10.0.0.9:5000"))

    def test_name_the_leader_has_connected_refused(self) -> None:
        """
        A name the leader's published view lists connected is refused on a
        follower with the same error as on the leader, logged with the
        node's address, and the token's use is not spent; another name
        joins.
        """
        self.etcd.put(FLEET, fleet_value([{"id": "gpu-1", "connected": True}]))
        token, secret = self.successResultOf(self.tokens.create(NOW, 3600, 2))
        r = self.join(token.id, secret, "gpu-1")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertEqual(r.error, "node 'gpu-1' is connected now: another node holds that name")
        [event] = [e for e in self.logged if "refused" in e["log_format"]]
        self.assertEqual((event["node"], event["address"]), ("gpu-1", "10.0.0.9:5000"))
        self.assertEqual(self.successResultOf(self.tokens.listing(NOW))[0]["used"], 0)
        self.assertEqual(self.join(token.id, secret, "gpu-2").status, pb.JoinResponse.STATUS_ISSUED)
        listed = self.successResultOf(self.tokens.listing(NOW))[0]
        self.assertEqual((listed["used"], listed["nodes"]), (1, ["gpu-2"]))

    def test_bad_token_learns_nothing_of_names(self) -> None:
        """A wrong secret is refused for the token, before anything is said about the name."""
        self.etcd.put(FLEET, fleet_value([{"id": "gpu-1", "connected": True}]))
        token, _ = self.successResultOf(self.tokens.create(NOW, 3600, 1))
        r = self.join(token.id, "wrong-secret", "gpu-1")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertNotIn("connected", r.error)
        self.assertEqual(json.loads(self.etcd.kvs[b"/llmgw/join-tokens/" + token.id.encode()].value)["used"], 0)
