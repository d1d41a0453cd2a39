"""
What a failed etcd request raises: L{EtcdError} for an answer etcd gave,
L{EtcdUnavailable} when no member answered, L{EtcdTLSError} when none could
be reached because the TLS handshake failed; and L{tls_problem}, which reads
a transport failure for the TLS reason an operator can act on.
"""

from __future__ import annotations

from OpenSSL import SSL
from twisted.web.client import RequestTransmissionFailed, ResponseNeverReceived

# gRPC status codes etcd answers with.
GRPC_FAILED_PRECONDITION = 9
GRPC_NOT_FOUND = 5


class EtcdError(Exception):
    """
    etcd answered a request with an error: C{code} is its gRPC status code,
    C{message} its text (C{"etcdserver: requested lease not found"}).
    """

    def __init__(self, code: int, message: str, url: str = ""):
        super().__init__(f"etcd at {url or '?'} refused the request: {message} (code {code})")
        self.code = code
        self.message = message
        self.url = url


class EtcdUnavailable(EtcdError):
    """
    No member answered: each was unreachable, or the one asked did not
    answer in time (it may be cut off from its quorum).
    """

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.code = -1
        self.message = message
        self.url = ""


class EtcdTLSError(EtcdUnavailable):
    """
    No member could be reached because the TLS handshake failed; the
    message says what to check.
    """


def tls_problem(e: BaseException, url: str) -> str | None:
    """
    What a failed request C{e} to C{url} says about TLS, in words for an
    operator, or C{None} when TLS is not why it failed.

    Only a failed handshake counts (nothing reached etcd, so another member
    may be asked): no byte of the answer came (L{ResponseNeverReceived}, or
    the request could not be sent), and OpenSSL said why (a verification
    failure, an alert). A member that went away mid-request without
    close_notify raises C{SSL.Error} too ("unexpected eof", or a
    C{SysCallError}): that is an outage, not TLS, and etcd may have applied
    the request.
    """
    from llmgw.tlsconf.options import ServerIdentityError

    if not isinstance(e, (ResponseNeverReceived, RequestTransmissionFailed)):
        return None
    found: list[BaseException] = []
    names: list[ServerIdentityError] = []

    def walk(x: BaseException, depth: int = 0) -> None:
        if depth > 4:
            return
        if isinstance(x, SSL.SysCallError):
            return
        if isinstance(x, SSL.Error):
            if "unexpected eof" not in str(x).lower():
                found.append(x)
            return
        if isinstance(x, ServerIdentityError):
            names.append(x)
            return
        for reason in getattr(x, "reasons", None) or []:
            value = getattr(reason, "value", reason)
            if isinstance(value, BaseException):
                walk(value, depth + 1)

    walk(e)
    if names:
        held = ", ".join(names[0].sans) or "no subject alternative names"
        return (f"TLS with etcd member {url} failed: etcd's server certificate does not name "
                f"{names[0].host!r}, the host in that URL; it holds {held} (reissue it naming it, "
                f"e.g. `llmgw ctl cert etcd NAME --host {names[0].host}`, or use a name it holds)")
    if not found:
        return None
    detail = "; ".join(str(arg[2]) if isinstance(arg, tuple) and len(arg) > 2 else str(arg)
                       for err in found for arg in (err.args[0] if err.args and isinstance(err.args[0], list)
                                                     else [err]))
    if "certificate verify failed" in detail:
        why = (f"etcd's server certificate is not trusted: it does not chain to --etcd-ca, or does "
               f"not name the host in {url}")
    elif "alert" in detail:
        why = ("etcd refused this member's client certificate (--etcd-cert/--etcd-key): it must be "
               "issued by the CA etcd trusts (etcd's --trusted-ca-file), be valid now and allow "
               "client authentication")
    else:
        why = "the handshake failed"
    return f"TLS with etcd member {url} failed: {why} ({detail})"
