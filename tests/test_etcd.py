"""
L{llmgw.etcd} against a real etcd member on loopback (skipped when etcd is
not installed).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.trial import unittest

from llmgw.etcd import (
    Compare,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Put,
    Range,
    WatchEvent,
    prefix_end,
)
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster
from llmgw.testing.procs import free_port


class PrefixEndTests(unittest.SynchronousTestCase):
    def test_prefix_end(self) -> None:
        """
        The range end of a prefix is the prefix with its last byte below
        0xff incremented; an all-0xff prefix means the whole keyspace.
        """
        self.assertEqual(prefix_end(b"/llmgw/"), b"/llmgw0")
        self.assertEqual(prefix_end(b"a\xff"), b"b")
        self.assertEqual(prefix_end(b"\xff\xff"), b"\0")


class RealEtcdTests(unittest.TestCase):
    skip = ETCD_MISSING
    timeout = 60

    async def _setUp(self) -> None:
        self.cluster = EtcdCluster(1)
        self.addCleanup(lambda: defer.Deferred.fromCoroutine(self.cluster.stop()))
        await self.cluster.start(reactor)
        self.client = EtcdClient(reactor, self.cluster.urls)
        self.addCleanup(self.client.close)

    def setUp(self) -> defer.Deferred[None]:
        return defer.Deferred.fromCoroutine(self._setUp())

    def _go(self, coro: Any) -> defer.Deferred[Any]:
        return defer.Deferred.fromCoroutine(coro)

    def test_put_get_range_delete(self) -> None:
        """
        Keys and values are bytes (any bytes) on both sides; a prefix range
        returns its keys in order with the revision they were read at; a
        delete removes them.
        """
        async def go() -> None:
            rev = await self.client.put(b"/t/a", b"\x00\xffone")
            await self.client.put(b"/t/b", b"two")
            await self.client.put(b"/u", b"other")
            kv = await self.client.get(b"/t/a")
            assert kv is not None
            self.assertEqual(kv.value, b"\x00\xffone")
            self.assertEqual(kv.create_revision, rev)
            kvs, read_at = await self.client.get_prefix(b"/t/")
            self.assertEqual([k.key for k in kvs], [b"/t/a", b"/t/b"])
            self.assertGreaterEqual(read_at, rev + 1)
            self.assertEqual(await self.client.delete(b"/t/", prefix_end(b"/t/")), 2)
            self.assertIsNone(await self.client.get(b"/t/a"))
            self.assertIsNotNone(await self.client.get(b"/u"))
        return self._go(go())  # type: ignore[return-value]

    def test_lease_lifecycle(self) -> None:
        """
        A key attached to a lease lives while the lease does; keepalive
        reports the TTL, revoke deletes the key, and keepalive of a revoked
        lease says 0; a put under a revoked lease is refused by etcd.
        """
        async def go() -> None:
            lease, ttl = await self.client.grant(10)
            self.assertEqual(ttl, 10)
            await self.client.put(b"/l", b"x", lease=lease)
            kv = await self.client.get(b"/l")
            assert kv is not None
            self.assertEqual(kv.lease, lease)
            self.assertEqual(await self.client.keepalive(lease), 10)
            await self.client.revoke(lease)
            self.assertIsNone(await self.client.get(b"/l"))
            self.assertEqual(await self.client.keepalive(lease), 0)
            try:
                await self.client.put(b"/l", b"y", lease=lease)
            except EtcdError as e:
                self.assertIn("lease not found", e.message)
            else:
                self.fail("a put under a revoked lease was accepted")
        return self._go(go())  # type: ignore[return-value]

    def test_txn_compare(self) -> None:
        """
        A create-if-absent transaction succeeds once; the second fails and
        runs the failure branch, which reads the holder.
        """
        async def go() -> None:
            first = await self.client.txn(
                [Compare.absent(b"/k")], [Put(b"/k", b"one")], [Range(b"/k")]
            )
            self.assertTrue(first.succeeded)
            second = await self.client.txn(
                [Compare.absent(b"/k")], [Put(b"/k", b"two")], [Range(b"/k")]
            )
            self.assertFalse(second.succeeded)
            self.assertEqual([kv.value for kv in second.kvs(0)], [b"one"])
            self.assertEqual(second.kvs(0)[0].create_revision, first.revision)
        return self._go(go())  # type: ignore[return-value]

    def test_watch_streams_events(self) -> None:
        """
        A prefix watch delivers each put and delete under the prefix (not
        others) as they happen, with the revision; cancel ends it.
        """
        async def go() -> None:
            seen: list[WatchEvent] = []
            got = defer.Deferred[None]()

            def on_events(events: list[WatchEvent], revision: int) -> None:
                seen.extend(events)
                if len(seen) >= 2 and not got.called:
                    got.callback(None)

            w = self.client.watch(b"/w/", on_events, range_end=prefix_end(b"/w/"))
            # The watch is created asynchronously: put after it is in place.
            from twisted.internet.task import deferLater
            await deferLater(reactor, 0.3, lambda: None)
            await self.client.put(b"/other", b"no")
            await self.client.put(b"/w/1", b"a")
            await self.client.delete(b"/w/1")
            await got
            self.assertEqual([(e.kind, e.kv.key) for e in seen], [("PUT", b"/w/1"), ("DELETE", b"/w/1")])
            self.assertEqual(w.revision, seen[-1].kv.mod_revision)
            w.cancel()
            await w.done
        return self._go(go())  # type: ignore[return-value]

    def test_unreachable_member_skipped(self) -> None:
        """
        A client whose first member refuses connections asks the next one
        and stays with it.
        """
        async def go() -> None:
            dead = f"http://127.0.0.1:{free_port()}"
            client = EtcdClient(reactor, [dead, *self.cluster.urls])
            self.addCleanup(client.close)
            await client.put(b"/x", b"1")
            self.assertEqual(client.url, self.cluster.urls[0])
        return self._go(go())  # type: ignore[return-value]


class UnreachableTests(unittest.TestCase):
    timeout = 20

    def test_no_member_answers(self) -> None:
        """
        When no member can be reached the request fails with
        EtcdUnavailable naming what was tried.
        """
        client = EtcdClient(reactor, [f"http://127.0.0.1:{free_port()}"])
        self.addCleanup(client.close)
        d = defer.Deferred.fromCoroutine(client.get(b"/x"))
        return self.assertFailure(d, EtcdUnavailable)  # type: ignore[no-any-return]


class TLSProblemTests(unittest.SynchronousTestCase):
    def test_says_which_side_refused(self) -> None:
        """
        A handshake failure inside a failed request is told apart: a
        refused client certificate points at --etcd-cert/--etcd-key, an
        untrusted server certificate at --etcd-ca; other failures are not
        taken for TLS.
        """
        from OpenSSL import SSL
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseNeverReceived

        from llmgw.etcd import tls_problem

        def failed(text: str) -> Exception:
            return ResponseNeverReceived([Failure(SSL.Error([("SSL routines", "", text)]))])

        refused = tls_problem(failed("tls alert bad certificate"), "https://e:2379")
        self.assertIn("etcd refused this member's client certificate (--etcd-cert/--etcd-key)", refused or "")
        untrusted = tls_problem(failed("certificate verify failed"), "https://e:2379")
        self.assertIn("does not chain to --etcd-ca", untrusted or "")
        self.assertIn("https://e:2379", untrusted or "")
        self.assertIsNone(tls_problem(ResponseNeverReceived([Failure(ConnectionError("reset"))]), "https://e:2379"))
        from llmgw.tlsconf.options import ServerIdentityError

        # A member gone mid-request without close_notify is an outage, not
        # TLS; nor is anything once the answer's head came.
        self.assertIsNone(tls_problem(failed("unexpected eof while reading"), "https://e:2379"))
        self.assertIsNone(tls_problem(ResponseNeverReceived([Failure(SSL.SysCallError(-1, "Unexpected EOF"))]),
                                      "https://e:2379"))
        from twisted.web.client import ResponseFailed

        self.assertIsNone(tls_problem(ResponseFailed([Failure(SSL.Error([("SSL routines", "", "tls alert")]))]),
                                      "https://e:2379"))
        misnamed = tls_problem(ResponseNeverReceived([Failure(ServerIdentityError("e", ["IP:10.0.0.1"]))]),
                               "https://e:2379")
        self.assertIn("does not name 'e'", misnamed or "")
        self.assertIn("IP:10.0.0.1", misnamed or "")


class _CutOff:
    """An HTTP client whose answers come with a head, then lose the body to
    an C{SSL.Error}, as a member that resets mid-answer without close_notify."""

    def __init__(self) -> None:
        self.posted: list[str] = []

    def post(self, url: str, **kw: Any) -> defer.Deferred[Any]:
        from OpenSSL import SSL
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseFailed

        self.posted.append(url)

        class Response:
            code = 200

            def deliverBody(self, protocol: Any) -> None:  # noqa: N802
                protocol.connectionLost(Failure(ResponseFailed(
                    [Failure(SSL.Error([("SSL routines", "", "unexpected eof while reading")]))])))

        return defer.succeed(Response())


class CutOffAnswerTests(unittest.SynchronousTestCase):
    def test_not_sent_again_once_the_head_came(self) -> None:
        """
        An answer whose body is cut off (its head came, so etcd took the
        request) fails with EtcdUnavailable, not a TLS error, and the
        request is not sent to the next member: it may have been applied.
        """
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.etcd import EtcdTLSError

        client = EtcdClient(MemoryReactorClock(), ["https://a:2379", "https://b:2379"])
        fake = client.http = _CutOff()  # type: ignore[assignment]
        f = self.failureResultOf(defer.Deferred.fromCoroutine(client.grant(10)), EtcdUnavailable)
        self.assertNotIsInstance(f.value, EtcdTLSError)
        self.assertIn("may have been applied", str(f.value))
        self.assertEqual(fake.posted, ["https://a:2379/v3/lease/grant"])
