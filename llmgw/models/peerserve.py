"""
Serving a node's cached models to its peers: the files of complete cache
entries, over HTTPS where the client proves it is a node of the fleet.

    GET /models/KEY/PATH    one file of entry KEY (Range honoured: a resume)

Only the files a complete entry lists are served, each only while its size
and modification time are the ones recorded when it was checked; any other
path is a 404, whatever its spelling. Bytes are streamed by twisted.web's
static file producer (64 KiB at a time, paused while the client is slow),
never read whole. The client checks what it receives against the source's
own checksums: a peer is trusted with nothing but bandwidth.

At most C{max_serving} files are served at once, and C{max_per_node} to one
client node; past either the answer is a 503 with C{Retry-After}, and the
client tries another peer or the source. Requests must arrive within
L{llmgw.httpdeadline}'s deadlines and the TLS handshake within
L{HANDSHAKE_TIMEOUT}; a client whose certificate is not a node's of the
fleet's CA (chain, revocation, key usage, a node id as its name) never gets
past the handshake.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web import resource, static
from twisted.web.server import Request

from llmgw.addresses import ListenerService, format_address, server_endpoint
from llmgw.httpdeadline import DeadlineSite, TLSDeadlineChannel
from llmgw.models.index import FileRecord
from llmgw.tlsconf.handshake import HANDSHAKE_TIMEOUT
from llmgw.tlsconf.options import IdentityError, ServerTLS, peer_node_id

__all__ = [
    "DEFAULT_MAX_PER_NODE", "DEFAULT_MAX_SERVING", "PEER_PREFIX", "RETRY_AFTER",
    "CompleteFiles", "PeerListener", "PeerResource", "PeerSite", "ServingLimits", "peer_listener",
]

#: The first path segment of every file URL.
PEER_PREFIX = "models"
#: Files served at once by one node, to all its peers.
DEFAULT_MAX_SERVING = 4
#: Files served at once to one client node.
DEFAULT_MAX_PER_NODE = 2
#: Seconds a client turned away at the cap is told to wait before asking again.
RETRY_AFTER = 5
#: Idle connections are closed after this many seconds.
IDLE_TIMEOUT = 60

#: The directory of a key's files and their records while its entry is
#: complete, else C{None} (L{llmgw.models.cache.ModelCache.complete_files}).
CompleteFiles = Callable[[str], "tuple[Path, tuple[FileRecord, ...]] | None"]


class ServingLimits:
    """
    How many files are being served, in all and to each client node.
    """

    def __init__(self, max_serving: int = DEFAULT_MAX_SERVING, max_per_node: int = DEFAULT_MAX_PER_NODE):
        self.max_serving = max_serving
        self.max_per_node = max_per_node
        self.serving = 0
        self.by_node: dict[str, int] = {}

    def take(self, node: str) -> str | None:
        """
        Count one more file served to C{node}; or, at a cap, why not.
        """
        if self.serving >= self.max_serving:
            return f"this node serves {self.max_serving} files at once already"
        if self.by_node.get(node, 0) >= self.max_per_node:
            return f"this node serves {self.max_per_node} files at once to {node} already"
        self.serving += 1
        self.by_node[node] = self.by_node.get(node, 0) + 1
        return None

    def give_back(self, node: str) -> None:
        self.serving -= 1
        left = self.by_node[node] - 1
        if left:
            self.by_node[node] = left
        else:
            del self.by_node[node]


def _error(request: Request, code: int, message: str) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps({"error": message, "status": code}).encode() + b"\n"


def _client(request: Request) -> str:
    peer = request.getClientAddress()
    host, port = getattr(peer, "host", "?"), getattr(peer, "port", "?")
    return format_address(host, port) if isinstance(port, int) else f"{host}:{port}"


def _relative(segments: list[bytes]) -> str | None:
    """
    The relative path the (already unquoted) segments name, or C{None}
    when one is empty, C{.} or C{..}, or holds a separator or a NUL.
    """
    parts = []
    for raw in segments:
        try:
            part = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if part in ("", ".", "..") or any(c in part for c in "/\\\0"):
            return None
        parts.append(part)
    return "/".join(parts) if parts else None


class PeerResource(resource.Resource):
    """
    The files of complete cache entries, by key and path (see the module's
    docstring), to clients whose connection proved a node id.
    """

    isLeaf = True
    log = Logger()

    def __init__(self, files: CompleteFiles, limits: ServingLimits | None = None):
        super().__init__()
        self._files = files
        self.limits = limits or ServingLimits()

    def render_HEAD(self, request: Request) -> Any:  # noqa: N802
        return self.render_GET(request)

    def render_GET(self, request: Request) -> Any:  # noqa: N802
        node = getattr(request.channel, "node_id", None)
        if node is None:
            # The listener only hands over connections whose handshake proved
            # a node; this guards a site built some other way.
            return _error(request, 403, "a peer must present a node certificate of the fleet's CA")
        segments = list(request.postpath or [])
        if len(segments) < 3 or segments[0] != PEER_PREFIX.encode():
            return _error(request, 404, f"no such resource; files are at /{PEER_PREFIX}/KEY/PATH")
        key = _relative(segments[1:2])
        path = _relative(segments[2:])
        if key is None or path is None:
            self.log.warn("peers: refused a malformed path from {node} at {client}: {path!r}",
                          node=node, client=_client(request), path=request.path)
            return _error(request, 404, "a malformed path (empty, '.' or '..' segments, or separators)")
        found = self._files(key)
        if found is None:
            return _error(request, 404, f"no complete copy of {key} here")
        directory, records = found
        record = next((r for r in records if r.path == path), None)
        if record is None:
            self.log.warn("peers: {node} at {client} asked for {path}, which {key} does not list",
                          node=node, client=_client(request), path=path, key=key)
            return _error(request, 404, f"{key} has no file {path}")
        full = directory / path
        try:
            st = os.stat(full)
        except OSError:
            st = None
        if st is None or st.st_size != record.size or st.st_mtime_ns != record.mtime_ns:
            self.log.warn("peers: {key}/{path} changed on disk since it was checked; not served",
                          key=key, path=path)
            return _error(request, 404, f"{key}/{path} is not as it was checked here")
        refused = self.limits.take(node)
        if refused is not None:
            request.setHeader(b"retry-after", str(RETRY_AFTER).encode())
            return _error(request, 503, refused)
        request.notifyFinish().addBoth(self._served, node)
        self.log.debug("peers: serving {key}/{path} to {node}", key=key, path=path, node=node)
        producer = static.File(str(full), defaultType="application/octet-stream")
        # The bytes as they are on disk, whatever the name's extension says.
        producer.contentEncodings = {}
        return producer.render(request)

    def _served(self, result: Any, node: str) -> None:
        self.limits.give_back(node)
        # A client gone mid-file is routine: it resumes elsewhere.
        return None


class PeerChannel(TLSDeadlineChannel):
    """
    A peer's connection: its handshake must be done within the site's
    C{handshake_timeout} (L{TLSDeadlineChannel}), and its certificate
    (already chained to the CA by OpenSSL) must be a node's; C{node_id} is
    then the node it proves. Refusals are logged with the client's address.
    """

    log = Logger()
    what = "peers"
    node_id: str | None = None

    def handshakeCompleted(self) -> None:
        super().handshakeCompleted()
        transport: Any = self.transport
        try:
            cert = transport.getPeerCertificate()
            if cert is None:
                raise IdentityError("no client certificate")
            self.node_id = peer_node_id(cert.to_cryptography())
        except IdentityError as e:
            self.log.warn("peers: refused {client}: {why}", client=self.client(), why=str(e))
            transport.abortConnection()


class PeerSite(DeadlineSite):
    """
    The peer listener's C{Site}: L{PeerChannel} connections and no tracebacks.
    """

    protocol = PeerChannel
    handshake_timeout: float = HANDSHAKE_TIMEOUT


class PeerListener(ListenerService):
    """
    The peer listener while running; L{reload} takes new TLS files for new
    connections (after a certificate renewal or a new CRL).
    """

    def __init__(self, endpoint: Any, factory: Any, tls: ServerTLS, site: PeerSite):
        super().__init__(endpoint, factory, "the peer listener", "--peer-listen")
        self.tls = tls
        self.site = site


def peer_listener(
    reactor: Any, host: str, port: int, files: CompleteFiles, tls: ServerTLS,
    max_serving: int = DEFAULT_MAX_SERVING, max_per_node: int = DEFAULT_MAX_PER_NODE,
) -> PeerListener:
    """
    A service serving C{files} to peers on C{host}:C{port} over C{tls} (a
    client certificate of the CA is mandatory; CRLs in its files are
    checked), with the caps given. Its C{port} is the listening port once
    started.
    """
    site = PeerSite(PeerResource(files, ServingLimits(max_serving, max_per_node)),
                    timeout=IDLE_TIMEOUT, reactor=reactor)
    factory = TLSMemoryBIOFactory(tls, False, site, clock=reactor)
    return PeerListener(server_endpoint(reactor, host, port), factory, tls, site)

