"""
The agent's side of sharing models between nodes: the peer listener that
serves its cache's complete models (C{--peer-listen}), the peering its
cache fetches through (always on: a node fetches from peers whether or not
it serves them), and the address reported in Register.

Both ends use the node's own certificate and the fleet's CA; a CRL in
C{crl.pem} beside the CA file (as C{llmgw ctl cert revoke} writes it) is
checked by both, and read again with them on a certificate reload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import Logger

from llmgw.addresses import AddressError, format_address, parse_address
from llmgw.models.cache import ModelCache, Peering
from llmgw.models.peerfetch import peering
from llmgw.models.peerserve import (
    DEFAULT_MAX_PER_NODE,
    DEFAULT_MAX_SERVING,
    CompleteFiles,
    PeerListener,
    peer_listener,
)
from llmgw.tlsconf.options import ServerTLS, TLSFiles

__all__ = ["AgentPeers", "crl_beside", "parse_peer_listen", "reported_address"]

#: Hosts that mean "every interface": the reported address then takes the
#: node's advertised host.
WILDCARDS = ("", "0.0.0.0", "::")


def parse_peer_listen(value: str) -> tuple[str, int] | None:
    """
    C{--peer-listen}'s value: C{[HOST:]PORT} (a bare port is every
    interface), or C{None} for an empty value (no listener).

    @raise AddressError: naming what is wrong.
    """
    value = value.strip()
    if not value:
        return None
    host, port = parse_address(value, "0.0.0.0")
    if not port:
        raise AddressError(f"{value!r}: give a port other than 0")
    return host, port


def reported_address(listening: tuple[str, int] | None, advertised: str) -> str:
    """
    The C{HOST:PORT} other nodes reach the peer listener at: its own host,
    or the node's advertised host when it listens on every interface; ""
    when there is no listener or no host is known yet.
    """
    if listening is None:
        return ""
    host, port = listening
    if host in WILDCARDS:
        host = advertised
    return format_address(host, port) if host else ""


def crl_beside(tls: TLSFiles) -> TLSFiles:
    """
    C{tls} with the CRL C{crl.pem} beside its CA file, when there is one.

    @raise llmgw.tlsconf.options.TLSConfigError: the CRL is unreadable, not
        the CA's, or expired.
    """
    return TLSFiles.load(tls.ca_path, tls.cert_path, tls.key_path, Path(tls.ca_path).parent / "crl.pem")


class AgentPeers(MultiService):
    """
    The node's peer listener on C{listen} (none when C{None}) serving the
    complete models of the cache given to L{serve}, and the cache's
    L{peering}. L{reported} is the address for Register.
    """

    log = Logger()

    def __init__(
        self, reactor: Any, tls: TLSFiles, listen: tuple[str, int] | None,
        max_serving: int = DEFAULT_MAX_SERVING, max_per_node: int = DEFAULT_MAX_PER_NODE,
    ):
        super().__init__()
        self.files = crl_beside(tls)
        self._complete: CompleteFiles = lambda key: None
        self.listener: PeerListener | None = None
        self._host = listen[0] if listen is not None else ""
        if listen is not None:
            self.server_tls = ServerTLS(self.files)
            self.listener = peer_listener(reactor, listen[0], listen[1], lambda key: self._complete(key),
                                          self.server_tls, max_serving, max_per_node)
            self.listener.setServiceParent(self)

    @property
    def peering(self) -> Peering:
        """
        The C{peering} for the node's L{ModelCache}: fetches given peers go
        to them first, with the node's current certificate.
        """
        return peering(lambda: self.files)

    def serve(self, cache: ModelCache) -> None:
        """
        Serve C{cache}'s complete models on the listener.
        """
        self._complete = cache.complete_files

    def listening(self) -> tuple[str, int] | None:
        """
        The host the listener was asked for and the port it is bound to;
        C{None} while it is not listening.
        """
        if self.listener is None or self.listener.port is None:
            return None
        return self._host, self.listener.address()[1]

    def reported(self, advertised: str) -> str:
        return reported_address(self.listening(), advertised)

    def startService(self) -> None:
        super().startService()
        if self.listener is not None:
            self.log.info("serving cached models to peers on {address}",
                          address=format_address(*self.listener.address()))

    def reload(self, tls: TLSFiles) -> None:
        """
        Use C{tls} (and the CRL beside it, read again) from the next
        connection on, as a server and as a client.

        @raise llmgw.tlsconf.options.TLSConfigError: the CRL is refused;
            the running files stay.
        """
        files = crl_beside(tls)
        if self.listener is not None:
            self.server_tls.reload(files)
        self.files = files
