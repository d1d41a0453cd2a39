"""
Renewal on the control plane's side: nodes close to their certificate's end
noticed once a day, the per-node expiry gauge, the expiry a renewal leaves
in the inventory, the column in `ctl nodes`, and a signer whose new root the
control plane does not trust yet.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.certexpiry import ExpiryNotices
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority
from llmgw.control.shell.joinlisten import note_expiry
from llmgw.control.shell.metrics import ControlCollector, make_registry
from llmgw.control.state.inventory import Inventory, Node
from llmgw.ctl.render import cert_left, render_nodes
from llmgw.testing.fleet import FakeAgents
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import check_request, new_request, sign_request
from llmgw.tlsconf.pem import CAError, cert_pem
from tests.test_metrics import by_label, scrape
from tests.test_tls_reload import ReloadBase

DAY = 86400.0


class NoticeTests(SynchronousTestCase):
    def test_once_a_day_per_node(self) -> None:
        """A node within 7 days of its end is noticed once a day, not at every look; far or unknown ones never."""
        n = ExpiryNotices()
        nodes = [("a", 5 * DAY), ("b", 30 * DAY), ("c", 0.0)]
        self.assertEqual(n.due(nodes, 0.0), [("a", 5 * DAY)])
        for hour in range(1, 24):
            self.assertEqual(n.due(nodes, hour * 3600.0), [])
        self.assertEqual(n.due(nodes, DAY), [("a", 5 * DAY)])

    def test_renewed_forgotten(self) -> None:
        """A node that renewed and later nears its end again is noticed at once."""
        n = ExpiryNotices()
        self.assertEqual(len(n.due([("a", 5 * DAY)], 0.0)), 1)
        self.assertEqual(n.due([("a", 40 * DAY)], 3600.0), [])
        self.assertEqual(len(n.due([("a", 3 * DAY)], 7200.0)), 1)


class TrustNoticeTests(ReloadBase):
    def test_event_for_connected_node(self) -> None:
        """The periodic check records a certificate_expiring event for a connected node within 7 days, once a day."""
        cp = self.control_plane()
        self.connect(cp, "node-a", certificate_not_after=int(time.time()) + 3 * 86400)
        self.connect(cp, "node-b", certificate_not_after=int(time.time()) + 300 * 86400)
        events: list[tuple[str, dict[str, Any]]] = []
        assert cp.trust is not None
        cp.trust.notify = lambda kind, level="info", **f: events.append((kind, f))
        self.clock.advance(3600)
        self.clock.advance(3600)
        self.assertEqual([(k, f["node"]) for k, f in events], [("certificate_expiring", "node-a")])
        self.assertIn("ends in", events[0][1]["reason"])
        self.clock.advance(DAY)
        self.assertEqual(len(events), 2)


class MetricTests(SynchronousTestCase):
    def test_per_node_seconds_left(self) -> None:
        """llmgw_certificate_expiry_seconds{node} is each node's time left, negative once ended."""
        now = 1_800_000_000.0
        snap = {"agents_not_after": {"a": now + DAY, "b": now - 10}}
        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, lambda: snap, clock=lambda: now))
        left = by_label(scrape(registry)["llmgw_certificate_expiry_seconds"], "node")
        self.assertEqual(left, {"a": DAY, "b": -10.0})


    def test_certificate_requests(self) -> None:
        """Answers to certificate requests by kind and outcome (every series there from the start), and the requests waiting."""
        auth = JoinAuthority(Clock(), TokenFile(None), list, lambda n: False)
        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, joining=lambda: auth))
        for outcome in ("issued", "issued", "refused"):
            auth.count("join", outcome)
        auth.count("renewal", "pending")
        auth.renew("n1", 7, new_request("n1")[1], "10.0.0.1:5")  # no signer: it waits
        families = scrape(registry)
        samples = {(s.labels["kind"], s.labels["outcome"]): s.value
                   for s in families["llmgw_certificate_requests"].samples
                   if s.name == "llmgw_certificate_requests_total"}
        self.assertEqual(samples, {
            ("join", "issued"): 2, ("join", "pending"): 0, ("join", "refused"): 1,
            ("renewal", "issued"): 0, ("renewal", "pending"): 1, ("renewal", "refused"): 0})
        [waiting] = families["llmgw_certificate_requests_waiting"].samples
        self.assertEqual(waiting.value, 1)

    def test_no_join_authority_no_series(self) -> None:
        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, joining=lambda: None))
        self.assertNotIn("llmgw_certificate_requests", scrape(registry))


class InventoryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.clock = Clock()
        self.clock.advance(time.time())

    def authority(self, **kw: Any) -> JoinAuthority:
        return JoinAuthority(self.clock, TokenFile(self.dir / "t.json"),
                             lambda: list(CertificateAuthority.load(self.dir).roots), lambda n: True,
                             lifetime=datetime.timedelta(days=30), **kw)

    def test_renewal_noted(self) -> None:
        """A renewal, signed or approved, sets the node's expiry in the inventory at once."""
        inv = Inventory()
        inv.upsert(Node(id="n1", certificate_not_after=1.0))
        auth = self.authority(signer_dir=self.dir, on_renewed=lambda n, c: note_expiry(inv, n, c))
        issued = auth.renew("n1", 5, new_request("n1")[1], "a")
        assert issued is not None
        end = x509.load_pem_x509_certificate(issued.certificate_pem).not_valid_after_utc.timestamp()
        self.assertEqual(inv.peek("n1").certificate_not_after, end)  # type: ignore[union-attr]
        manual = self.authority(on_renewed=lambda n, c: note_expiry(inv, n, c))
        _, csr_pem = new_request("n1")
        self.assertIsNone(manual.renew("n1", 5, csr_pem, "a"))
        self.assertEqual([p["kind"] for p in manual.listing()], ["renewal"])
        cert = sign_request(check_request(csr_pem, "n1"), "n1", self.ca.key, self.ca.certificate,
                            datetime.timedelta(days=2))
        manual.approve("n1", cert_pem(cert), "op")
        self.assertEqual(inv.peek("n1").certificate_not_after,  # type: ignore[union-attr]
                         cert.not_valid_after_utc.timestamp())

    def test_untrusted_signer_root_refused(self) -> None:
        """A signer whose CA was rolled over after the control plane loaded its bundle refuses, saying to reload."""
        old_roots = list(self.ca.roots)
        auth = JoinAuthority(self.clock, TokenFile(self.dir / "t.json"), lambda: old_roots, lambda n: True,
                             signer_dir=self.dir)
        self.ca.rotate()
        with self.assertRaises(CAError) as e:
            auth.renew("n1", 5, new_request("n1")[1], "a")
        self.assertIn("reload", str(e.exception))


class RenderTests(SynchronousTestCase):
    def test_cert_column(self) -> None:
        """`ctl nodes` shows each node's certificate time left, marked within 7 days."""
        now = 1_000_000.0
        self.assertEqual(cert_left(now + 20 * DAY, now), "20d")
        self.assertEqual(cert_left(now + 3 * DAY, now), "3d (soon)")
        self.assertEqual(cert_left(now + 2 * 3600, now), "2h (soon)")
        self.assertEqual(cert_left(now - 1, now), "ended")
        self.assertEqual(cert_left(None, now), "-")
        text = render_nodes([{"id": "n1", "state": "ready", "certificate_not_after": now + 3 * DAY}], now)
        self.assertIn("CERT ENDS", text)
        self.assertIn("3d (soon)", text)
