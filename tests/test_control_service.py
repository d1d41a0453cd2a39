"""
Tests for `twistd llmgw control`'s options and the addresses it parses.
"""

from __future__ import annotations

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.addresses import AddressError, is_loopback, parse_address
from llmgw.control.service import Options
from llmgw.routing import Demand
from llmgw.testing.pki import make_pki


class AddressTests(SynchronousTestCase):
    def test_forms(self) -> None:
        """
        PORT, HOST:PORT and [IPV6]:PORT all parse.
        """
        self.assertEqual(parse_address("7443", "0.0.0.0"), ("0.0.0.0", 7443))
        self.assertEqual(parse_address("10.0.0.1:80", "x"), ("10.0.0.1", 80))
        self.assertEqual(parse_address("[::1]:7443", "x"), ("::1", 7443))
        self.assertEqual(parse_address("host.example:1", "x"), ("host.example", 1))

    def test_errors(self) -> None:
        """
        A bad port or a bare IPv6 address is refused with a reason.
        """
        for bad in ("x:y", "::1:80", "[::1]80", "70000", "[::1"):
            self.assertRaises(AddressError, parse_address, bad, "h")

    def test_loopback(self) -> None:
        """
        127/8, ::1 and localhost are loopback; others are not.
        """
        self.assertTrue(is_loopback("127.0.0.2"))
        self.assertTrue(is_loopback("::1"))
        self.assertTrue(is_loopback("localhost"))
        self.assertFalse(is_loopback("0.0.0.0"))
        self.assertFalse(is_loopback("10.0.0.1"))


class OptionsTests(SynchronousTestCase):
    def test_insecure_only_on_loopback(self) -> None:
        """
        --insecure is refused unless the agent listener is on loopback.
        """
        with self.assertRaises(usage.UsageError) as e:
            Options().parseOptions(["--insecure", "--agent-listen", "0.0.0.0:7443"])
        self.assertIn("loopback", str(e.exception))
        o = Options()
        o.parseOptions(["--insecure", "--agent-listen", "7443"])
        self.assertEqual((o["agents_host"], o["agents_port"]), ("127.0.0.1", 7443))

    def test_missing_certificates(self) -> None:
        """
        Without certificates the control plane does not start, and says how
        to make them.
        """
        with self.assertRaises(usage.UsageError) as e:
            Options().parseOptions(["--certs", self.mktemp()])
        self.assertIn("llmgw ctl cert init", str(e.exception))

    def test_tls_defaults(self) -> None:
        """
        With certificates, the agent stream listens on all addresses, port
        7443, with TLS.
        """
        ca = make_pki(self.mktemp())
        o = Options()
        o.parseOptions(["--certs", str(ca.directory)])
        self.assertEqual((o["agents_host"], o["agents_port"]), ("0.0.0.0", 7443))
        self.assertIsNotNone(o["tls"])
        self.assertEqual(o["backlog"], 4096)

    def test_bad_numbers(self) -> None:
        """
        Non-numeric or non-positive limits are usage errors.
        """
        for args in (["--max-frame", "x"], ["--max-frame", "0"], ["--heartbeat", "-1"]):
            self.assertRaises(usage.UsageError, Options().parseOptions, ["--insecure", *args])


class GatewayOptionTests(SynchronousTestCase):
    def test_gateway_embedded(self) -> None:
        """
        The control plane embeds the gateway on 127.0.0.1:8000 by default,
        routing by the reconciler's published routing table (the one
        standalone gateways follow); the reconciler reads its in-flight
        counts.
        """
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.control.service import makeService

        o = Options()
        o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "off"])
        self.assertEqual(o["gateway_address"], ("127.0.0.1", 8000))
        cp = makeService(o, reactor=MemoryReactorClock())
        assert cp.gateway is not None and cp.reconciler is not None
        self.assertIs(cp.gateway.gateway.table, cp.reconciler.routing_table)
        self.assertIs(cp.reconciler.in_flight, cp.gateway)
        # Autoscaling reads the embedded gateway's demand: requests it is
        # proxying and holding, per model.
        cp.gateway.gateway.admission.started("demo")
        self.assertEqual(cp.reconciler.demand(), {"demo": Demand(1, 0)})

    def test_gateway_off(self) -> None:
        """
        --gateway off runs no gateway; a bad address or keys file is refused.
        """
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.control.service import makeService

        o = Options()
        o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--gateway", "off"])
        self.assertIsNone(makeService(o, reactor=MemoryReactorClock()).gateway)
        self.assertRaises(usage.UsageError, Options().parseOptions,
                          ["--insecure", "--gateway", "x:y"])
        with self.assertRaises(usage.UsageError) as e:
            Options().parseOptions(["--insecure", "--api-keys", self.mktemp()])
        self.assertIn("--api-keys", str(e.exception))
