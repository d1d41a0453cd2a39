"""
Fetching a model from peers first: an L{IFetcher} around the source's own
that asks each peer in turn for each file and leaves to the source only the
files no peer served intact.

The plan (files, sizes, checksums) always comes from the source's metadata;
a peer supplies bytes and nothing else. Each file is hashed as it arrives
(the bytes of a C{.part} left by an earlier try first) and must match the
plan's sha256, or the git blob id of a hub file kept outside LFS; a file
the plan gives no checksum for is never taken from a peer. A peer that
fails mid-file leaves its bytes in the C{.part}, and the next peer (or the
https source, which resumes the same C{.part}) goes on from there; a peer
whose bytes do not match is logged with its address and its bytes thrown
away.

Peers are reached over TLS with the node's own certificate. Their
certificates are node certificates (issued for client authentication, with
no names to check an address against), which a TLS library's server check
would refuse; so the handshake is done without it and the certificate is
checked right after, before a request is sent: issued by one of the fleet's
roots, valid now, a node's (L{peer_node_id}), not revoked by a CRL given.
The handshake itself proves the peer holds the certificate's key.

Methods block; the cache runs them in its thread pool.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import ssl
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cryptography import x509
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.addresses import AddressError, parse_address
from llmgw.models.fetching import READ_CHUNK, FileSpec, IFetcher, Plan, Transfer, hash_part, matches
from llmgw.models.peerserve import PEER_PREFIX
from llmgw.models.source import Source, cache_key
from llmgw.tlsconf.certs import issued_by
from llmgw.tlsconf.options import IdentityError, TLSFiles, peer_node_id

__all__ = ["PART", "PeerClientTLS", "PeerFetcher", "PeerRefused", "peering"]

#: Suffix of a file being fetched: the https fetcher's own, so that it
#: resumes what a peer left.
PART = ".part"


class PeerRefused(Exception):
    """
    A peer could not serve a file: unreachable, not a node of the fleet,
    without a complete copy, at its cap, or cut off mid-file. The next peer
    (or the source) is tried.
    """


class _Damaged(PeerRefused):
    """
    A peer served bytes that do not match the source's checksum.
    """


class PeerClientTLS:
    """
    A node's TLS as a peer's client: C{files} (its certificate and key, the
    CA's roots and CRLs, as loaded by L{TLSFiles.load}).
    """

    def __init__(self, files: TLSFiles):
        self.files = files
        self._context: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        """
        A client context presenting the node's certificate. The peer's
        certificate is not checked in the handshake (see the module's
        docstring): call L{check_server} before trusting the connection.
        """
        if self._context is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.load_cert_chain(self.files.cert_path, self.files.key_path)
            self._context = ctx
        return self._context

    def check_server(self, der: bytes | None) -> str:
        """
        The node id a peer's certificate proves.

        @raise PeerRefused: it is missing, not issued by the fleet's CA,
            not valid now, not a node's, or revoked.
        """
        if der is None:
            raise PeerRefused("it presented no certificate")
        cert = x509.load_der_x509_certificate(der)
        roots = self.files.roots or (self.files.ca,)
        if not any(issued_by(cert, root) for root in roots):
            raise PeerRefused(f"its certificate was not issued by the fleet's CA "
                              f"(issuer {cert.issuer.rfc4514_string()})")
        now = datetime.datetime.now(datetime.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise PeerRefused("its certificate is not valid now")
        try:
            node = peer_node_id(cert)
        except IdentityError as e:
            raise PeerRefused(f"its certificate is not a node's: {e}") from None
        crls = self.files.crls or ((self.files.crl,) if self.files.crl is not None else ())
        for crl in crls:
            if crl.issuer == cert.issuer and crl.get_revoked_certificate_by_serial_number(cert.serial_number):
                raise PeerRefused(f"its certificate ({node}) is revoked")
        return node


def _digest(spec: FileSpec) -> Any:
    if spec.sha256 is not None:
        return hashlib.sha256()
    assert spec.git_sha1 is not None and spec.size is not None
    return hashlib.sha1(f"blob {spec.size}\0".encode(), usedforsecurity=False)


def _verifiable(spec: FileSpec) -> bool:
    # A peer is trusted with bytes only where the source's metadata can check them.
    return spec.sha256 is not None or (spec.git_sha1 is not None and spec.size is not None)


@implementer(IFetcher)
class PeerFetcher:
    """
    Fetches a model from C{peers} (HOST:PORT, tried in order for each file)
    and falls back to C{source} for the files none served intact.

    @param timeout: seconds to connect, and between bytes, before a peer is
        given up for the file.
    """

    log = Logger()

    def __init__(self, source: IFetcher, peers: Sequence[str], tls: PeerClientTLS, timeout: float = 10.0):
        self.source = source
        self.peers = tuple(peers)
        self.tls = tls
        self.timeout = timeout

    def plan(self, source: Source) -> Plan:
        """
        The source's plan: its checksums are the ones every byte is held to.
        """
        return self.source.plan(source)

    def fetch(self, source: Source, plan: Plan, directory: Path, transfer: Transfer) -> None:
        key = cache_key(source)
        directory.mkdir(parents=True, exist_ok=True)
        left: list[FileSpec] = []
        for spec in plan.files:
            transfer.check()
            final = directory / spec.path
            if final.exists():
                if matches(final, spec, transfer):
                    transfer.add(final.stat().st_size)
                    continue
                final.unlink()
            if not (_verifiable(spec) and self._from_peers(key, spec, final, transfer)):
                left.append(spec)
        if left:
            self.log.info("{key}: {count} file(s) from the source {source}", key=key, count=len(left),
                          source=str(source))
            self.source.fetch(source, replace(plan, files=tuple(left)), directory, transfer)
            for spec in left:
                # A peer's bytes the source did not resume from (a hub keeps
                # its own partial files) would stay behind for ever.
                (directory / (spec.path + PART)).unlink(missing_ok=True)

    def _from_peers(self, key: str, spec: FileSpec, final: Path, transfer: Transfer) -> bool:
        part = final.with_name(final.name + PART)
        final.parent.mkdir(parents=True, exist_ok=True)
        for peer in self.peers:
            try:
                self._download(peer, key, spec, part, transfer)
            except _Damaged as e:
                part.unlink(missing_ok=True)
                self.log.warn("{key}: peer {peer} served {path} damaged ({why}); its bytes were "
                              "thrown away", key=key, peer=peer, path=spec.path, why=str(e))
                continue
            except PeerRefused as e:
                self.log.info("{key}: peer {peer} did not serve {path}: {why}", key=key, peer=peer,
                              path=spec.path, why=str(e))
                continue
            part.rename(final)
            self.log.info("{key}: {path} fetched from peer {peer}", key=key, path=spec.path, peer=peer)
            return True
        return False

    def _connect(self, peer: str) -> http.client.HTTPSConnection:
        try:
            host, port = parse_address(peer, "")
        except AddressError as e:
            raise PeerRefused(f"not a HOST:PORT: {e}") from None
        if not host or not port:
            raise PeerRefused("not a HOST:PORT")
        conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self.tls.context())
        try:
            conn.connect()
            sock: Any = conn.sock
            self.tls.check_server(sock.getpeercert(binary_form=True))
        except PeerRefused:
            conn.close()
            raise
        except (OSError, ssl.SSLError, http.client.HTTPException) as e:
            conn.close()
            raise PeerRefused(f"cannot connect: {e}") from None
        return conn

    def _download(self, peer: str, key: str, spec: FileSpec, part: Path, transfer: Transfer) -> None:
        """
        Fetch C{spec} from C{peer} into C{part}, from where it ends, and
        check it whole.

        @raise PeerRefused: the peer did not serve it all (its bytes stay).
        @raise _Damaged: what it served does not match.
        """
        digest = _digest(spec)
        have = hash_part(part, digest, spec.size)
        counted = 0
        conn = self._connect(peer)
        try:
            path = "/".join(quote(p, safe="") for p in spec.path.split("/"))
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                conn.request("GET", f"/{PEER_PREFIX}/{quote(key, safe='')}/{path}", headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise PeerRefused(f"no answer: {e}") from None
            if response.status == 416 and spec.size is not None and have == spec.size:
                pass  # the part is whole already
            elif response.status == 200 or (response.status == 206 and have):
                start = (response.getheader("Content-Range") or "").removeprefix("bytes ").split("-")[0]
                if response.status == 206 and start != str(have):
                    raise PeerRefused(f"it answered a range from {have} with {start or 'none'}")
                if response.status == 200 and have:
                    digest, have = _digest(spec), 0
                want = None if spec.size is None else spec.size - have
                transfer.add(have)
                counted = have
                with part.open("ab" if have else "wb") as out:
                    try:
                        while want is None or want > 0:
                            chunk = response.read(READ_CHUNK if want is None else min(READ_CHUNK, want))
                            if not chunk:
                                break
                            out.write(chunk)
                            digest.update(chunk)
                            have += len(chunk)
                            counted += len(chunk)
                            transfer.add(len(chunk))
                            if want is not None:
                                want -= len(chunk)
                    except (OSError, http.client.HTTPException) as e:
                        raise PeerRefused(f"cut off after {have} bytes: {e}") from None
                if spec.size is not None and have < spec.size:
                    raise PeerRefused(f"cut off after {have} of {spec.size} bytes")
            else:
                retry = response.getheader("Retry-After")
                body = response.read(4096).decode("utf-8", "replace").strip()
                raise PeerRefused(f"HTTP {response.status}" + (f" (retry after {retry} s)" if retry else "")
                                  + (f": {body}" if body else ""))
        except PeerRefused:
            # Not counted until another try counts the part again.
            transfer.add(-counted)
            raise
        finally:
            conn.close()
        expected = spec.sha256 if spec.sha256 is not None else spec.git_sha1
        if digest.hexdigest() != expected or (spec.size is not None and have != spec.size):
            transfer.add(-counted)
            raise _Damaged(f"checksum {digest.hexdigest()}, the source's {expected}")


def peering(tls: Callable[[], TLSFiles], timeout: float = 10.0) -> Callable[[IFetcher, tuple[str, ...]], IFetcher]:
    """
    The cache's C{peering}: wraps a source's fetcher in a L{PeerFetcher}
    for the peers of one fetch, with the node's TLS files as C{tls} returns
    them at that moment (so a renewed certificate is used from the next fetch).
    """
    def wrap(fetcher: IFetcher, peers: tuple[str, ...]) -> IFetcher:
        return PeerFetcher(fetcher, peers, PeerClientTLS(tls()), timeout)
    return wrap

