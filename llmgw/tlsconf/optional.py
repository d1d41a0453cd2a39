"""
A server side that asks for a client certificate but lets a client
without one in: for the admin API where people log in with a password
from a browser that holds no certificate, while tools keep proving who
they are with theirs.

A certificate that is offered is checked exactly as by L{ServerTLS}
(chains to the CA, not revoked): a bad one still fails the handshake. Who
may do what without one is the application's to decide, per request.
"""

from __future__ import annotations

from typing import Any

from OpenSSL import SSL, crypto
from twisted.internet.interfaces import IOpenSSLServerConnectionCreator
from zope.interface import implementer

from llmgw.tlsconf.options import SERVER_GROUPS, ServerTLS, TLSFiles


def _verified(conn: SSL.Connection, cert: crypto.X509, errno: int, depth: int, ok: int) -> bool:
    # OpenSSL's own verdict on the chain; a missing certificate never gets here.
    return bool(ok)


@implementer(IOpenSSLServerConnectionCreator)
class OptionalClientTLS:
    """
    The files of C{tls} (shared with the agent port, so that one reload
    renews both) with the client certificate asked for, not required. A
    context is made again when C{tls} has reloaded new files.
    """

    def __init__(self, tls: ServerTLS):
        self.tls = tls
        self._files: TLSFiles | None = None
        self._context: SSL.Context | None = None

    @property
    def files(self) -> TLSFiles:
        return self.tls.files

    def context(self) -> SSL.Context:
        files = self.tls.files
        if self._context is None or self._files is not files:
            context = files.context(SERVER_GROUPS)
            context.set_verify(SSL.VERIFY_PEER, _verified)
            self._files, self._context = files, context
        return self._context

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:  # noqa: N802
        return SSL.Connection(self.context(), None)
