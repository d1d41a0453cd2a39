"""
etcd over TLS: a real three-member etcd cluster
serving its clients and its peers over TLS with client certificates
required, every certificate made at run
time by llmgw's own CA code (L{llmgw.tlsconf.ca.CertificateAuthority.issue_etcd}).
The client speaks to it; a real C{twistd llmgw control --etcd https://...
--etcd-ca/--etcd-cert/--etcd-key} member campaigns and leads; a client
certificate etcd does not trust is refused with an error that says so, in
the client's exception, in the member's log and in its status. Bounded;
skipped when etcd is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from llmgw.etcd import EtcdClient, EtcdTLSError
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster, until
from llmgw.testing.pki import make_pki
from llmgw.testing.procs import free_port
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import ClientTLSPolicy, TLSFiles
from llmgw.tlsconf.pem import cert_pem
from tests import test_ha_e2e as base


class EtcdTLSTests(TestCase):
    skip = ETCD_MISSING
    timeout = 120

    def setUp(self) -> defer.Deferred[None]:
        # Three members: their peer traffic is TLS with llmgw-issued certificates too.
        self.cluster = EtcdCluster(3, tls=True)
        self.procs: list[base.Proc] = []
        self.addCleanup(self.cleanup)
        return defer.Deferred.fromCoroutine(self.cluster.start(reactor))

    async def _cleanup(self) -> None:
        for p in self.procs:
            if p.alive:
                p.signal("KILL")
                await p.out.ended
        await self.cluster.stop()

    def cleanup(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._cleanup())

    def wrong_files(self) -> tuple[Path, Path, Path]:
        """
        A client certificate from another CA, with a CA bundle that holds
        etcd's CA too (so etcd's server certificate is trusted and the
        member's files load): etcd, which trusts only its own CA, refuses it.
        """
        other = CertificateAuthority.init(Path(self.mktemp()).resolve() / "other")
        issued = other.issue_etcd("cp-wrong", [])
        bundle = Path(self.mktemp()).resolve()
        bundle.write_bytes(self.cluster.ca.cert_path.read_bytes() + cert_pem(other.certificate))
        return bundle, issued.cert_path, issued.key_path

    def test_client_over_tls_and_wrong_certificate(self) -> None:
        """
        With a certificate from etcd's CA the client writes, reads and
        watches over TLS; with one from another CA every request fails with
        L{EtcdTLSError}, saying that etcd refused the client certificate;
        dialling a name etcd's certificate does not hold fails saying that.
        """
        async def go() -> None:
            good = EtcdClient(reactor, self.cluster.urls, tls=ClientTLSPolicy(self.cluster.client_files("cp1")))
            self.addCleanup(good.close)
            await good.put(b"/t/k", b"v1")
            kv = await good.get(b"/t/k")
            assert kv is not None
            self.assertEqual(kv.value, b"v1")
            # From the write's revision: a watch from now could reach etcd
            # after the write, and never see it.
            seen: list[bytes] = []
            w = good.watch(b"/t/k", lambda events, rev: seen.extend(e.kv.value for e in events),
                           start_revision=kv.mod_revision)
            self.addCleanup(w.cancel)
            await until(lambda: seen == [b"v1"], 5, "the watch over TLS")

            bad = EtcdClient(reactor, self.cluster.urls, tls=ClientTLSPolicy(TLSFiles.load(*self.wrong_files())))
            self.addCleanup(bad.close)
            with self.assertRaises(EtcdTLSError) as caught:
                await bad.get(b"/t/k")
            self.assertIn("etcd refused this member's client certificate", str(caught.exception))
            # Every member was tried (nothing reached etcd); the error names one.
            self.assertTrue(any(u in str(caught.exception) for u in self.cluster.urls), str(caught.exception))

            # etcd's certificate names 127.0.0.1 only: dialled as localhost, refused, saying so.
            misnamed = EtcdClient(reactor, [self.cluster.urls[0].replace("127.0.0.1", "localhost")],
                                  tls=ClientTLSPolicy(self.cluster.client_files("cp3")))
            self.addCleanup(misnamed.close)
            with self.assertRaises(EtcdTLSError) as caught:
                await misnamed.get(b"/t/k")
            self.assertIn("does not name 'localhost'", str(caught.exception))
        return defer.Deferred.fromCoroutine(go())  # type: ignore[return-value]

    def member(self, name: str, ca: Path, cert: Path, key: Path) -> tuple[base.Proc, str]:
        certs = Path(self.mktemp()).resolve()
        make_pki(certs, [], ["127.0.0.1"])
        admin = f"http://127.0.0.1:{free_port()}"
        p = base.Proc(name, base.twistd(
            "control", "--certs", str(certs), "--agent-listen", f"127.0.0.1:{free_port()}",
            "--admin", admin.removeprefix("http://"), "--gateway", "off",
            "--etcd", ",".join(self.cluster.urls), "--etcd-ca", str(ca), "--etcd-cert", str(cert),
            "--etcd-key", str(key), "--etcd-ttl", "4", "--member-id", name, "--advertise-admin", admin,
        ))
        p.start()
        self.procs.append(p)
        return p, admin

    async def status(self, admin: str) -> Any:
        try:
            r = await treq.get(admin + "/api/v1/status", timeout=1.0, persistent=False)
            return await r.json()
        except Exception:  # noqa: BLE001 - starting: no answer yet
            return None

    def test_member_leads_over_tls_and_wrong_certificate_is_logged(self) -> None:
        """
        A member given etcd's CA and a client certificate from it leads; a
        member whose client certificate etcd does not trust stays a follower,
        logs the refusal as an error naming the certificate options, and
        shows it as its status's etcd_error.
        """
        async def go() -> None:
            files = self.cluster.client_files("cp1")
            good, good_admin = self.member("cp1", files.ca_path, files.cert_path, files.key_path)
            bad, bad_admin = self.member("cp2", *self.wrong_files())
            states: dict[str, Any] = {}

            async def poll() -> None:
                states["good"] = await self.status(good_admin)
                states["bad"] = await self.status(bad_admin)

            async def settled() -> bool:
                await poll()
                g, b = states["good"], states["bad"]
                return bool(g and g.get("role") == "leader" and b
                            and "client certificate" in b.get("ha", {}).get("etcd_error", ""))

            deadline = reactor.seconds() + 40
            while not await settled():
                if reactor.seconds() > deadline or not (good.alive and bad.alive):
                    self.fail(f"not settled: {states}\n--- cp1\n{base.HAEndToEndTests.tail(good)}"
                              f"\n--- cp2\n{base.HAEndToEndTests.tail(bad)}")
                await deferLater(reactor, 0.3, lambda: None)
            self.assertEqual(states["good"]["leader_id"], "cp1")
            self.assertEqual(states["bad"]["role"], "follower")
            log = bad.out.text()
            self.assertIn("etcd refused this member's client certificate (--etcd-cert/--etcd-key)", log)
            self.assertIn("cannot read the epoch base yet", log)
        return defer.Deferred.fromCoroutine(go())  # type: ignore[return-value]
