"""
Tests for L{llmgw.hostcheck}: which C{Host} values a server answers to.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.hostcheck import HostCheck, HostListError, parse_hosts, unlisted_names_warning


class DefaultTests(SynchronousTestCase):
    def test_loopback_names_with_or_without_port(self) -> None:
        """
        With nothing configured, the loopback names are served, with any
        port or none, in any case, with a trailing dot.
        """
        check = HostCheck()
        for value in (
            b"localhost", b"localhost:7480", b"LocalHost:1", b"localhost.", b"localhost.:80",
            b"127.0.0.1", b"127.0.0.1:8000", b"[::1]", b"[::1]:8000", b"localhost:",
        ):
            self.assertTrue(check.allows(value), value)

    def test_other_names_refused(self) -> None:
        """
        Any other name (a rebinding page's own name, another address, a
        name with a loopback prefix or suffix) or a malformed value is
        refused.
        """
        check = HostCheck()
        for value in (
            b"evil.example", b"evil.example:7480", b"localhost.evil.example", b"127.0.0.1.nip.io",
            b"10.0.0.1:7480", b"::1", b"[::1", b"[::1]x", b"localhost:http", b"localhost:123456",
            b"", b" ", b"local\xffhost", b"*", b"localhost:80:80",
        ):
            self.assertFalse(check.allows(value), value)

    def test_no_host_is_allowed(self) -> None:
        """
        A request without C{Host} names no other server and is allowed
        (HTTP/1.1's requirement of the header is the HTTP layer's).
        """
        self.assertTrue(HostCheck().allows(None))


class ConfiguredTests(SynchronousTestCase):
    def test_bound_address(self) -> None:
        """
        The address the listener is bound to is served (IPv6 in brackets);
        a wildcard bind names no address.
        """
        self.assertTrue(HostCheck(bound="10.0.0.5").allows(b"10.0.0.5:7480"))
        self.assertTrue(HostCheck(bound="fd00::5").allows(b"[fd00::5]:7480"))
        for wildcard in ("0.0.0.0", "::", ""):
            check = HostCheck(bound=wildcard)
            self.assertFalse(check.allows(b"10.0.0.5"), wildcard)
            self.assertFalse(check.allows(b"0.0.0.0"), wildcard)
            self.assertTrue(check.allows(b"localhost"), wildcard)

    def test_listed_names(self) -> None:
        """
        A listed name is served with any port; NAME:PORT only on that port;
        .DOMAIN for the domain and every name under it; * for every name.
        """
        check = HostCheck(parse_hosts("gw.example.com, api.example.com:443, .fleet.example, [fd00::1]"))
        for value in (
            b"gw.example.com", b"gw.example.com:8000", b"api.example.com:443", b"fleet.example",
            b"a.fleet.example", b"b.a.fleet.example:7480", b"[fd00::1]:8000",
        ):
            self.assertTrue(check.allows(value), value)
        for value in (b"api.example.com", b"api.example.com:80", b"xfleet.example", b"example.com"):
            self.assertFalse(check.allows(value), value)
        self.assertTrue(HostCheck(["*"]).allows(b"anything.example:1"))

    def test_parse_refuses_malformed_entries(self) -> None:
        """
        A malformed entry is refused with its text; empty entries are
        skipped.
        """
        self.assertEqual(parse_hosts(" A.example ,, b.example:80,"), ["a.example", "b.example:80"])
        self.assertEqual(parse_hosts("fd00::1"), ["[fd00::1]"])
        for bad in ("http://gw.example", "gw example", "gw.example:port", "[nope]", "a/b", ".[fd00::1]"):
            e = self.assertRaises(HostListError, parse_hosts, bad)
            self.assertIn(repr(bad), str(e))

    def test_served(self) -> None:
        """
        L{HostCheck.served} lists what is served, for logs and docs.
        """
        check = HostCheck(["gw.example", "api.example:443", ".fleet.example"], bound="10.0.0.5")
        self.assertEqual(
            check.served(),
            ["10.0.0.5", "127.0.0.1", "[::1]", "gw.example", "localhost", "api.example:443", ".fleet.example"],
        )


class UnlistedNamesWarningTests(SynchronousTestCase):
    def test_wildcard_without_names(self) -> None:
        """
        A listener on every address with no names listed is warned about
        in one line: every request from another machine gets 421, and the
        option to add is named.
        """
        for bound in ("0.0.0.0", "::", ""):
            warning = unlisted_names_warning("the gateway", bound, [], "--gateway-hosts")
            assert warning is not None
            self.assertIn("every request from another machine is answered 421", warning)
            self.assertIn("Add --gateway-hosts NAME,...", warning)
            self.assertNotIn("\n", warning)

    def test_one_address_without_names(self) -> None:
        """
        A listener on one non-loopback address without names serves that
        address only; the warning says requests by another name get 421.
        """
        warning = unlisted_names_warning("the gateway", "10.0.0.5", [], "--gateway-hosts")
        assert warning is not None
        self.assertIn("listens on 10.0.0.5 but answers only to that address", warning)
        self.assertIn("421", warning)

    def test_loopback_or_names_listed(self) -> None:
        """
        Nothing to say on loopback (only this machine reaches it) or once
        names are listed.
        """
        for bound in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
            self.assertIsNone(unlisted_names_warning("the gateway", bound, [], "--gateway-hosts"), bound)
        self.assertIsNone(unlisted_names_warning("the gateway", "0.0.0.0", ["gw.example"], "--gateway-hosts"))
        self.assertIsNone(unlisted_names_warning("the gateway", "0.0.0.0", ["*"], "--gateway-hosts"))
