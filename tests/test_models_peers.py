"""
Tests for L{llmgw.models.peerserve} and L{llmgw.models.peerfetch}: nodes
fetching models from each other over real mutual TLS on loopback, with
certificates from a CA made at test time by llmgw's own CA code, each
cache on the real reactor and a thread pool.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import ssl
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import capturedLogs
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import resource
from twisted.web.server import Request

from llmgw.addresses import server_endpoint
from llmgw.models.cache import ModelCache, thread_runner
from llmgw.models.errors import ChecksumMismatch
from llmgw.models.fetching import Plan
from llmgw.models.https import HttpsFetcher
from llmgw.models.peerfetch import PeerClientTLS, PeerFetcher, peering
from llmgw.models.peerserve import PeerListener, PeerSite, ServingLimits, peer_listener
from llmgw.models.source import HttpsSource, HubSource, Source, cache_key, parse_source
from llmgw.testing.fakefetch import FakeFetcher, StepRunner
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.crl import revoke
from llmgw.tlsconf.options import ServerTLS, TLSFiles, agent_files
from tests.test_models_https import BODY, SHA, HttpsServerMixin

WEIGHTS = os.urandom(3 * 1024 * 1024 + 17)
CONFIG = b'{"model_type": "fake"}\n'
SOURCE = HubSource(repo="org/model", revision="main")
MODELS = {str(SOURCE): {"config.json": CONFIG, "sub/weights.bin": WEIGHTS}}


def files(ca: CertificateAuthority, node: str, crl: bool = False) -> TLSFiles:
    base = agent_files(ca.directory, node)
    return TLSFiles.load(base.ca_path, base.cert_path, base.key_path,
                         ca.directory / "crl.pem" if crl else None)


class PeerTestBase(TestCase):
    """
    A CA, a thread pool, and helpers that make caches and their listeners.
    """

    timeout = 60

    def setUp(self) -> None:
        self.ca = make_pki(self.mktemp(), nodes=("node-a", "node-b", "node-c"))
        self.ca.issue_admin("alice", "viewer")
        self.pool = ThreadPool(minthreads=0, maxthreads=4, name="peers-test")
        self.pool.start()
        self.addCleanup(self.pool.stop)
        self.run_ = thread_runner(reactor, self.pool)

    def cache(self, node: str, fetchers: dict[str, Any], capacity: int = 1 << 30) -> ModelCache:
        cache = ModelCache(self.mktemp(), capacity, fetchers, reactor, self.run_,
                           peering=peering(lambda: files(self.ca, node)))
        self.addCleanup(cache.stop)
        return cache

    def listen(self, cache: ModelCache, node: str, **caps: int) -> str:
        listener = peer_listener(reactor, "127.0.0.1", 0, cache.complete_files,
                                 ServerTLS(files(self.ca, node, crl=True)), **caps)
        return self.start(listener)

    def start(self, listener: PeerListener) -> str:
        listener.startService()
        self.addCleanup(listener.stopService)
        host, port = listener.address()
        return f"{host}:{port}"

    def in_thread(self, f: Any, *args: Any) -> Deferred[Any]:
        return deferToThreadPool(reactor, self.pool, f, *args)

    async def holder(self, node: str = "node-a") -> tuple[ModelCache, str]:
        """
        A cache of C{node} holding L{SOURCE} complete, and its listener's address.
        """
        cache = self.cache(node, {"hf": FakeFetcher(MODELS)})
        await cache.load()
        await cache.ensure(SOURCE)
        return cache, self.listen(cache, node)


def raw_get(address: str, path: str, context: ssl.SSLContext) -> tuple[int, dict[str, str], bytes]:
    """
    One GET over TLS with C{context}, in the calling thread.
    """
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=10, context=context)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def client_context(cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


class PeerFetchTests(PeerTestBase):
    def test_fetch_from_peer(self) -> None:
        """
        A second node's cache, given the first as a peer, fetches every file
        from it: the source is asked for the plan only, and the files are
        the source's bytes.
        """
        async def run() -> None:
            _, address = await self.holder()
            source_fetcher = FakeFetcher(MODELS)
            cache = self.cache("node-b", {"hf": source_fetcher})
            await cache.load()
            path = await cache.ensure(SOURCE, peers=[address])
            self.assertEqual(((path / "sub" / "weights.bin").read_bytes(), (path / "config.json").read_bytes()),
                             (WEIGHTS, CONFIG))
            self.assertEqual((source_fetcher.plans, source_fetcher.written), ([str(SOURCE)], []))
        return Deferred.fromCoroutine(run())

    def test_git_blob_checked(self) -> None:
        """
        A file the source checks by its git blob id (a hub file kept
        outside LFS) is taken from a peer when its blob id matches, and
        left to the source when the plan's blob id differs.
        """
        class GitPlans(FakeFetcher):
            blob = ""

            def plan(self, source: Source) -> Plan:
                plan = super().plan(source)
                return replace(plan, files=tuple(
                    replace(f, sha256=None, git_sha1=self.blob or git_blob(CONFIG)) if f.path == "config.json"
                    else f for f in plan.files))

        def git_blob(data: bytes) -> str:
            return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()

        async def run() -> None:
            _, address = await self.holder()
            good = GitPlans(MODELS)
            cache = self.cache("node-b", {"hf": good})
            await cache.load()
            path = await cache.ensure(SOURCE, peers=[address])
            self.assertEqual(((path / "config.json").read_bytes(), good.written), (CONFIG, []))
            other = GitPlans(MODELS)
            other.blob = "0" * 40
            cache = self.cache("node-c", {"hf": other})
            await cache.load()
            with self.assertRaises(ChecksumMismatch):
                # The source's own bytes fail the (wrong) blob id too.
                await cache.ensure(SOURCE, peers=[address])
            self.assertEqual(other.written, ["config.json"])
            self.flushLoggedErrors()
        return Deferred.fromCoroutine(run())

    def test_damaged_peer(self) -> None:
        """
        A peer whose copy was damaged on disk (size and time kept) serves
        wrong bytes: they fail the source's checksum, are thrown away with
        the peer's address logged, and the file comes from the source.
        """
        async def run() -> None:
            holder, address = await self.holder()
            found = holder.complete_files(cache_key(SOURCE))
            assert found is not None
            weights = found[0] / "sub" / "weights.bin"
            st = weights.stat()
            weights.write_bytes(b"y" + WEIGHTS[1:])
            os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
            source_fetcher = FakeFetcher(MODELS)
            cache = self.cache("node-b", {"hf": source_fetcher})
            await cache.load()
            with capturedLogs() as events:
                path = await cache.ensure(SOURCE, peers=[address])
            self.assertEqual((path / "sub" / "weights.bin").read_bytes(), WEIGHTS)
            self.assertEqual(source_fetcher.written, ["sub/weights.bin"])
            warned = [e for e in events if "damaged" in e.get("log_format", "")]
            self.assertEqual([e["peer"] for e in warned], [address])
        return Deferred.fromCoroutine(run())

    def test_peer_at_cap(self) -> None:
        """
        A peer at its serving cap answers 503 with Retry-After, and the
        fetcher goes on to the next peer; the source serves nothing.
        """
        async def run() -> None:
            holder, _ = await self.holder()
            full = self.listen(holder, "node-a", max_serving=0)
            status, headers, _ = await self.in_thread(
                raw_get, full, f"/models/{cache_key(SOURCE)}/config.json",
                client_context(self.ca.directory / "agent-node-b.pem", self.ca.directory / "agent-node-b.key"))
            self.assertEqual((status, headers.get("retry-after")), (503, "5"))
            _, other = await self.holder("node-c")
            source_fetcher = FakeFetcher(MODELS)
            cache = self.cache("node-b", {"hf": source_fetcher})
            await cache.load()
            path = await cache.ensure(SOURCE, peers=[full, other])
            self.assertEqual((path / "sub" / "weights.bin").read_bytes(), WEIGHTS)
            self.assertEqual(source_fetcher.written, [])
        return Deferred.fromCoroutine(run())

    def test_no_peer_has_it(self) -> None:
        """
        Peers without the model (a 404) or not listening leave every file to
        the source.
        """
        async def run() -> None:
            empty = self.cache("node-a", {"hf": FakeFetcher({})})
            await empty.load()
            address = self.listen(empty, "node-a")
            source_fetcher = FakeFetcher(MODELS)
            cache = self.cache("node-b", {"hf": source_fetcher})
            await cache.load()
            await cache.ensure(SOURCE, peers=[address, "127.0.0.1:1"])
            self.assertEqual(sorted(source_fetcher.written), ["config.json", "sub/weights.bin"])
        return Deferred.fromCoroutine(run())

    def test_peer_outside_the_fleet(self) -> None:
        """
        A peer whose certificate is not from the fleet's CA is not trusted:
        the fetcher refuses it after the handshake and the source serves.
        """
        async def run() -> None:
            other = make_pki(self.mktemp(), nodes=("node-a",))
            cache_a = self.cache("node-a", {"hf": FakeFetcher(MODELS)})
            await cache_a.load()
            await cache_a.ensure(SOURCE)
            stranger = self.start(peer_listener(reactor, "127.0.0.1", 0, cache_a.complete_files,
                                                ServerTLS(agent_files(other.directory, "node-a"))))
            source_fetcher = FakeFetcher(MODELS)
            cache = self.cache("node-b", {"hf": source_fetcher})
            await cache.load()
            with capturedLogs() as events:
                await cache.ensure(SOURCE, peers=[stranger])
            self.assertEqual(sorted(source_fetcher.written), ["config.json", "sub/weights.bin"])
            self.assertTrue(any("not issued by the fleet's CA" in str(e.get("why")) for e in events))
        return Deferred.fromCoroutine(run())


class _Cutting(resource.Resource):
    """
    A peer that promises the whole file and closes after half of it.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.gone: list[Deferred[None]] = []

    def render_GET(self, request: Request) -> bytes:  # noqa: N802
        self.gone.append(request.notifyFinish().addErrback(lambda _: None))
        request.setHeader(b"content-length", str(len(BODY)).encode())
        request.write(BODY[: len(BODY) // 2])
        request.channel.loseConnection()  # type: ignore[union-attr]
        return b""


class PeerResumeTests(PeerTestBase, HttpsServerMixin):
    def cutting_peer(self) -> tuple[str, _Cutting]:
        """
        A peer of the fleet that cuts every file halfway, and its resource.
        """
        cutter = _Cutting()
        # No idle timer: this connection is cut before its request ends.
        site = PeerSite(cutter, reactor=reactor, timeout=None)
        tls = ServerTLS(files(self.ca, "node-a"))
        address = self.start(PeerListener(server_endpoint(reactor, "127.0.0.1", 0),
                                          TLSMemoryBIOFactory(tls, False, site, clock=reactor), tls, site))
        return address, cutter

    def test_peer_dies_mid_file(self) -> None:
        """
        A peer that stops halfway leaves its bytes; the https source resumes
        the file from there with a Range request, and the file checks.
        """
        async def run() -> None:
            base = self.start_server(self)
            cutting, cutter = self.cutting_peer()
            cache = self.cache("node-b", {"https": HttpsFetcher(retries=0)})
            await cache.load()
            source = parse_source(base + "/m/tiny.gguf", sha256=SHA)
            path = await cache.ensure(source, peers=[cutting])
            self.assertEqual(hashlib.sha256(path.read_bytes()).hexdigest(), SHA)
            self.assertEqual(self.server.ranges, [f"bytes={len(BODY) // 2}-"])
            for gone in cutter.gone:
                await gone
        return Deferred.fromCoroutine(run())


    def test_resumed_from_next_peer(self) -> None:
        """
        A peer that stops halfway leaves its bytes, and the next peer is
        asked for the rest only (a Range request); the source serves no
        byte of the file.
        """
        async def run() -> None:
            base = self.start_server(self)
            source = parse_source(base + "/m/tiny.gguf", sha256=SHA)
            cutting, cutter = self.cutting_peer()
            holder = self.cache("node-c", {"https": FakeFetcher({str(source): {"tiny.gguf": BODY}})})
            await holder.load()
            await holder.ensure(source)
            good = self.listen(holder, "node-c")
            cache = self.cache("node-b", {"https": HttpsFetcher(retries=0)})
            await cache.load()
            with capturedLogs() as events:
                path = await cache.ensure(source, peers=[cutting, good])
            self.assertEqual(hashlib.sha256(path.read_bytes()).hexdigest(), SHA)
            self.assertEqual(self.server.ranges, [])
            self.assertTrue(any(e.get("peer") == good and "fetched from peer" in e.get("log_format", "")
                                for e in events))
            for gone in cutter.gone:
                await gone
        return Deferred.fromCoroutine(run())


class PeerServerTests(PeerTestBase):
    def get(self, address: str, path: str, node: str | None = "node-b") -> Deferred[Any]:
        ctx = client_context(*((self.ca.directory / f"agent-{node}.pem", self.ca.directory / f"agent-{node}.key")
                               if node else ()))
        return self.in_thread(raw_get, address, path, ctx)

    def test_serves_listed_files_with_range(self) -> None:
        """
        A listed file is served whole, and from an offset with a Range
        request (a resume).
        """
        async def run() -> None:
            _, address = await self.holder()
            key = cache_key(SOURCE)
            status, _, body = await self.get(address, f"/models/{key}/sub/weights.bin")
            self.assertEqual((status, body), (200, WEIGHTS))
            ctx = client_context(self.ca.directory / "agent-node-b.pem", self.ca.directory / "agent-node-b.key")

            def ranged() -> tuple[int, bytes]:
                host, port = address.rsplit(":", 1)
                conn = http.client.HTTPSConnection(host, int(port), timeout=10, context=ctx)
                conn.request("GET", f"/models/{key}/sub/weights.bin", headers={"Range": "bytes=1000-"})
                response = conn.getresponse()
                result = response.status, response.read()
                conn.close()
                return result
            self.assertEqual(await self.in_thread(ranged), (206, WEIGHTS[1000:]))
        return Deferred.fromCoroutine(run())

    def test_path_traversal_refused(self) -> None:
        """
        Paths with '..' (plain or escaped), an empty segment, files the
        entry does not list (its index among them) and unknown keys are
        404s, and nothing outside the entry's files is served.
        """
        async def run() -> None:
            _, address = await self.holder()
            key = cache_key(SOURCE)
            for path in (f"/models/{key}/../entry.json", f"/models/{key}/%2e%2e/entry.json",
                         f"/models/{key}/sub/%2e%2e/config.json", f"/models/{key}//config.json",
                         f"/models/{key}/sub%2fweights.bin", f"/models/{key}/entry.json",
                         f"/models/..%2f{key}/files/config.json", "/models/nothing/config.json",
                         f"/{key}/config.json"):
                status, _, body = await self.get(address, path)
                self.assertEqual(status, 404, path)
                self.assertNotIn(b"model_type", body)
        return Deferred.fromCoroutine(run())

    def test_partial_entry_not_served(self) -> None:
        """
        An entry being fetched (partial) is not served.
        """
        runner = StepRunner()
        cache = ModelCache(self.mktemp(), 1 << 30, {"hf": FakeFetcher(MODELS)}, reactor, runner)
        cache.load()
        runner.drain()
        cache.ensure(SOURCE)
        runner.step()  # plan
        runner.step()  # room
        self.assertIsNone(cache.complete_files(cache_key(SOURCE)))

    def test_clients_outside_the_fleet_refused(self) -> None:
        """
        A client with no certificate, one from another CA, an admin
        certificate of the fleet's CA, or a revoked node certificate gets no
        answer: its connection ends at the handshake.
        """
        async def run() -> None:
            revoke(self.ca, node_id="node-c")
            _, address = await self.holder()
            other = make_pki(self.mktemp(), nodes=("node-b",))
            path = f"/models/{cache_key(SOURCE)}/config.json"
            contexts = {
                "none": client_context(),
                "other CA": client_context(other.directory / "agent-node-b.pem",
                                           other.directory / "agent-node-b.key"),
                "admin": client_context(self.ca.directory / "admin-alice.pem", self.ca.directory / "admin-alice.key"),
                "revoked": client_context(self.ca.directory / "agent-node-c.pem",
                                          self.ca.directory / "agent-node-c.key"),
            }
            with capturedLogs() as events:
                for name, ctx in contexts.items():
                    try:
                        result = await self.in_thread(raw_get, address, path, ctx)
                    except (OSError, http.client.HTTPException):
                        continue
                    self.fail(f"{name}: answered {result[0]}")
            self.assertTrue(any(e.get("log_namespace", "").endswith("PeerChannel") for e in events))
            status, _, body = await self.get(address, path)
            self.assertEqual((status, body), (200, CONFIG))
        return Deferred.fromCoroutine(run())


class UnitTests(SynchronousTestCase):
    def test_limits(self) -> None:
        """
        The serving caps count in all and per client node, and free as
        files end.
        """
        limits = ServingLimits(max_serving=3, max_per_node=2)
        self.assertIsNone(limits.take("a"))
        self.assertIsNone(limits.take("a"))
        self.assertIn("to a", limits.take("a") or "")
        self.assertIsNone(limits.take("b"))
        self.assertIn("3 files", limits.take("c") or "")
        limits.give_back("a")
        self.assertIsNone(limits.take("c"))
        self.assertEqual(limits.by_node, {"a": 1, "b": 1, "c": 1})

    def test_cache_passes_peers(self) -> None:
        """
        Peers given to L{ModelCache.ensure} reach the cache's peering, which
        wraps the source's fetcher for that fetch only; without peers the
        source's fetcher is used as it is.
        """
        wrapped: list[tuple[str, ...]] = []
        source_fetcher = FakeFetcher(MODELS)

        def peering_(fetcher: Any, peers: tuple[str, ...]) -> Any:
            self.assertIs(fetcher, source_fetcher)
            wrapped.append(peers)
            return fetcher
        runner = StepRunner()
        from twisted.internet.task import Clock
        cache = ModelCache(self.mktemp(), 1 << 30, {"hf": source_fetcher}, Clock(), runner, peering=peering_)
        cache.load()
        runner.drain()
        cache.ensure(SOURCE, peers=["10.0.0.1:7444"])
        runner.drain()
        other = HubSource(repo="org/other")
        source_fetcher.models[str(other)] = {"a": b"a"}
        cache.ensure(other)
        runner.drain()
        self.assertEqual(wrapped, [("10.0.0.1:7444",)])
        self.assertIsNotNone(cache.complete_files(cache_key(SOURCE)))

    def test_unverifiable_file_left_to_source(self) -> None:
        """
        A file the plan gives no checksum for is never asked of a peer.
        """
        class Source_:
            def plan(self, source: Source) -> Plan:
                raise AssertionError("not called")

            def fetch(self, source: Source, plan: Plan, directory: Path, transfer: Any) -> None:
                self.got = [f.path for f in plan.files]
        from llmgw.models.fetching import FileSpec, Transfer

        inner = Source_()
        fetcher = PeerFetcher(inner, ["127.0.0.1:1"], cast(PeerClientTLS, None))
        source = HttpsSource(url="https://example.invalid/m.bin", sha256="0" * 64)
        fetcher.fetch(source, Plan(files=(FileSpec("m.bin", 3),)), Path(self.mktemp()), Transfer())
        self.assertEqual(inner.got, ["m.bin"])

    def test_part_removed_after_source(self) -> None:
        """
        What a peer left in a C{.part} is removed once the source (which
        does not resume it) has fetched the file.
        """
        ca = make_pki(self.mktemp(), nodes=("node-b",))
        directory = Path(self.mktemp())
        (directory / "sub").mkdir(parents=True)
        (directory / "sub" / "weights.bin.part").write_bytes(WEIGHTS[:100])
        source_fetcher = FakeFetcher(MODELS)
        fetcher = PeerFetcher(source_fetcher, ["127.0.0.1:1"], PeerClientTLS(files(ca, "node-b")))
        from llmgw.models.fetching import Transfer
        transfer = Transfer()
        fetcher.fetch(SOURCE, source_fetcher.plan(SOURCE), directory, transfer)
        self.assertEqual(sorted(p.name for p in (directory / "sub").iterdir()), ["weights.bin"])
        self.assertEqual(transfer.done, len(WEIGHTS) + len(CONFIG))
