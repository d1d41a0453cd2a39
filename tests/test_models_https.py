"""
Tests for L{llmgw.models.https} against a real https server on loopback
(Python's C{http.server} in a thread, its certificate from a CA made at test
time, trusted through C{SSL_CERT_FILE}): Range resume after a cut
connection, a wrong checksum refused, and a fetch through the cache on the
real reactor and a thread pool.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import ssl
import threading
from pathlib import Path

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.models.cache import ModelCache, thread_runner
from llmgw.models.errors import ChecksumMismatch, SourceNotFound
from llmgw.models.fetching import Transfer
from llmgw.models.https import HttpsFetcher
from llmgw.models.source import HttpsSource, parse_source
from llmgw.testing.ports import free_port
from llmgw.tlsconf.ca import CertificateAuthority

BODY = os.urandom(300_000)
SHA = hashlib.sha256(BODY).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _head(self, start: int) -> bool:
        if self.path != "/m/tiny.gguf":
            self.send_error(404)
            return False
        if start:
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(BODY) - 1}/{len(BODY)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(BODY) - start))
        self.end_headers()
        return True

    def do_HEAD(self) -> None:
        self._head(0)

    def do_GET(self) -> None:
        ranged = self.headers.get("Range")
        self.server.ranges.append(ranged)
        start = int(ranged.removeprefix("bytes=").rstrip("-")) if ranged else 0
        if not self._head(start):
            return
        body = BODY[start:]
        if self.server.cuts:
            # Cut the connection halfway through what was promised.
            self.server.cuts -= 1
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    cuts = 0
    ranges: list[str | None]


class HttpsServerMixin:
    """
    An https server on loopback for the test, and SSL_CERT_FILE set to its CA.
    """

    def start_server(self, case: SynchronousTestCase) -> str:
        ca = CertificateAuthority.init(case.mktemp())
        issued = ca.issue_server(["127.0.0.1"])
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(issued.cert_path), str(issued.key_path))
        server = _Server(("127.0.0.1", free_port()), _Handler)
        server.ranges = []
        server.socket = context.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        case.addCleanup(thread.join, 10)
        case.addCleanup(server.server_close)
        case.addCleanup(server.shutdown)
        old = os.environ.get("SSL_CERT_FILE")
        os.environ["SSL_CERT_FILE"] = str(ca.cert_path)
        case.addCleanup(lambda: os.environ.pop("SSL_CERT_FILE") if old is None
                        else os.environ.__setitem__("SSL_CERT_FILE", old))
        self.server = server
        return f"https://127.0.0.1:{server.server_address[1]}"


class FetcherTests(SynchronousTestCase, HttpsServerMixin):
    def setUp(self) -> None:
        self.base = self.start_server(self)
        self.dir = Path(self.mktemp())
        self.fetcher = HttpsFetcher(retry_delay=0)

    def source(self, sha: str = SHA, path: str = "/m/tiny.gguf") -> HttpsSource:
        source = parse_source(self.base + path, sha256=sha)
        assert isinstance(source, HttpsSource)
        return source

    def test_fetch(self) -> None:
        """
        The plan has the file's size from the server and the source's
        sha256; the fetch writes the file under its name, every byte counted.
        """
        source = self.source()
        plan = self.fetcher.plan(source)
        self.assertEqual((plan.total, plan.files[0].sha256, plan.target), (len(BODY), SHA, "tiny.gguf"))
        transfer = Transfer()
        self.fetcher.fetch(source, plan, self.dir, transfer)
        self.assertEqual((self.dir / "tiny.gguf").read_bytes(), BODY)
        self.assertEqual(transfer.done, len(BODY))

    def test_resume_after_cut(self) -> None:
        """
        A connection cut mid-file is resumed with a Range request from
        where the bytes stopped, and the file is whole and checked.
        """
        self.server.cuts = 1
        source = self.source()
        self.fetcher.fetch(source, self.fetcher.plan(source), self.dir, Transfer())
        self.assertEqual((self.dir / "tiny.gguf").read_bytes(), BODY)
        self.assertEqual(self.server.ranges, [None, f"bytes={len(BODY) // 2}-"])

    def test_resume_after_restart(self) -> None:
        """
        A .part file left by an earlier fetch is resumed, not fetched again.
        """
        self.dir.mkdir()
        (self.dir / "tiny.gguf.part").write_bytes(BODY[:1000])
        source = self.source()
        self.fetcher.fetch(source, self.fetcher.plan(source), self.dir, Transfer())
        self.assertEqual((self.dir / "tiny.gguf").read_bytes(), BODY)
        self.assertEqual(self.server.ranges, ["bytes=1000-"])

    def test_wrong_checksum(self) -> None:
        """
        Bytes that do not match the catalog's sha256 are refused and deleted.
        """
        source = self.source(sha="0" * 64)
        with self.assertRaises(ChecksumMismatch):
            self.fetcher.fetch(source, self.fetcher.plan(source), self.dir, Transfer())
        self.assertEqual(list(self.dir.iterdir()), [])

    def test_not_found(self) -> None:
        """
        A 404 is L{SourceNotFound}, found at planning, before any download.
        """
        with self.assertRaises(SourceNotFound):
            self.fetcher.plan(self.source(path="/nothing.gguf"))

    def test_untrusted(self) -> None:
        """
        A server whose certificate the trust store does not hold is refused.
        """
        os.environ["SSL_CERT_FILE"] = os.devnull
        with self.assertRaises(Exception) as caught:
            self.fetcher.plan(self.source())
        self.assertIn("CERTIFICATE_VERIFY_FAILED", str(caught.exception))


class CacheOverHttpsTests(TestCase, HttpsServerMixin):
    def test_cache_fetch(self) -> None:
        """
        Through the cache, on the real reactor and a thread pool, an https
        source is fetched, checked and handed over as a path.
        """
        base = self.start_server(self)
        pool = ThreadPool(minthreads=0, maxthreads=2, name="models-test")
        pool.start()
        self.addCleanup(pool.stop)
        cache = ModelCache(self.mktemp(), 10 * len(BODY), {"https": HttpsFetcher()}, reactor,
                           thread_runner(reactor, pool))

        async def run() -> None:
            await cache.load()
            path = await cache.ensure(parse_source(base + "/m/tiny.gguf", sha256=SHA))
            self.assertEqual(path.name, "tiny.gguf")
            self.assertEqual(hashlib.sha256(path.read_bytes()).hexdigest(), SHA)
        return Deferred.fromCoroutine(run())
