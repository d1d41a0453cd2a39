"""
One file over https, streamed in a thread with C{urllib}: resumed with a
C{Range} request from the C{.part} file an earlier fetch left, trusting
the system's CA store (and C{SSL_CERT_FILE}/C{SSL_CERT_DIR}, which
C{ssl.create_default_context} reads), hashed as it is written and checked
against the catalog's sha256 before it takes its final name.
"""

from __future__ import annotations

import hashlib
import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from zope.interface import implementer

from llmgw.models.errors import ChecksumMismatch, ModelError, SourceDenied, SourceNotFound
from llmgw.models.fetching import (
    READ_CHUNK,
    Cut,
    FileSpec,
    IFetcher,
    Plan,
    Transfer,
    check_file,
    hash_part,
    resumed,
)
from llmgw.models.source import HttpsSource, Source

#: Suffix of a file being downloaded, kept across restarts for a resume.
PART = ".part"


def _where(url: str) -> str:
    # What a log or an error may say about a URL: its host and path, never
    # a query string (which may carry a signed token).
    parts = urlsplit(url)
    return f"https://{parts.netloc}{parts.path}"


@implementer(IFetcher)
class HttpsFetcher:
    """
    Fetches L{HttpsSource}s. C{retries}: how many times a download cut
    mid-file is resumed before the fetch fails, C{retry_delay} seconds apart
    (slept in the fetch's own thread).
    """

    def __init__(
        self, context: Callable[[], ssl.SSLContext] = ssl.create_default_context,
        timeout: float = 30.0, retries: int = 3, retry_delay: float = 1.0,
    ) -> None:
        self._context = context
        self._timeout = timeout
        self._retries = retries
        self._retry_delay = retry_delay

    def _open(self, request: urllib.request.Request) -> http.client.HTTPResponse:
        where = _where(request.full_url)
        try:
            response = urllib.request.urlopen(request, timeout=self._timeout, context=self._context())
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 404 or e.code == 410:
                raise SourceNotFound(f"{where}: the server has no such file (HTTP {e.code})") from None
            if e.code in (401, 403):
                raise SourceDenied(f"{where}: the server refused access (HTTP {e.code})") from None
            raise ModelError(f"{where}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ModelError(f"{where}: {reason}") from None
        return response  # type: ignore[no-any-return]

    def plan(self, source: Source) -> Plan:
        """
        The one file: its size from a HEAD request's Content-Length (C{None}
        when the server gives none), its sha256 from the source.
        """
        assert isinstance(source, HttpsSource)
        with self._open(urllib.request.Request(source.url, method="HEAD")) as response:
            length = response.headers.get("Content-Length")
        size = int(length) if length is not None and length.isdigit() else None
        spec = FileSpec(path=source.filename, size=size, sha256=source.sha256)
        return Plan(files=(spec,), target=source.filename)

    def fetch(self, source: Source, plan: Plan, directory: Path, transfer: Transfer) -> None:
        assert isinstance(source, HttpsSource)
        spec = plan.files[0]
        final = directory / spec.path
        directory.mkdir(parents=True, exist_ok=True)
        if final.exists():
            # Present from an earlier fetch that ended before the cache
            # recorded it: kept if it checks, fetched again if not.
            try:
                check_file(final, spec, _where(source.url), transfer)
                transfer.add(final.stat().st_size)
                return
            except ChecksumMismatch:
                pass
        part = directory / (spec.path + PART)
        digest = resumed(lambda: self._download(source, part, transfer), self._retries, self._retry_delay,
                         _where(source.url))
        if digest != spec.sha256:
            part.unlink(missing_ok=True)
            raise ChecksumMismatch(
                f"{_where(source.url)}: the file's sha256 is {digest}, the source says {spec.sha256}; "
                "the file was deleted")
        part.rename(final)

    def _download(self, source: HttpsSource, part: Path, transfer: Transfer) -> str:
        """
        Download into C{part}, from where it ends; its sha256 when whole.

        @raise Cut: the connection ended before the file did.
        """
        digest = hashlib.sha256()
        have = hash_part(part, digest)
        request = urllib.request.Request(source.url)
        if have:
            request.add_header("Range", f"bytes={have}-")
        try:
            response = self._open(request)
        except ModelError as e:
            if have and "HTTP 416" in str(e):
                # The part is already whole: the server has nothing past it.
                transfer.add(have)
                return digest.hexdigest()
            raise
        with response:
            if have and response.status != 206:
                # The server ignored the Range: start over.
                digest, have = hashlib.sha256(), 0
                mode = "wb"
            else:
                mode = "ab"
            length = response.headers.get("Content-Length")
            expected = have + int(length) if length is not None and length.isdigit() else None
            transfer.add(have)
            with part.open(mode) as out:
                try:
                    while chunk := response.read(READ_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
                        transfer.add(len(chunk))
                except (OSError, http.client.HTTPException) as e:
                    out.flush()
                    transfer.add(-have)
                    raise Cut(f"connection lost after {have} bytes ({e})") from None
            if expected is not None and have < expected:
                transfer.add(-have)
                raise Cut(f"connection closed after {have} of {expected} bytes")
        return digest.hexdigest()

