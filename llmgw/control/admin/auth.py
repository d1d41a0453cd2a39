"""
Who may ask the admin API what: the C{Host} a request names, the admin
certificate it comes with over mutual TLS and that certificate's role
(L{role_allows}), and how the requester is named in log lines.

The admin a connection's certificate proves is read once and kept on the
HTTP channel (C{llmgw_admin}, with its serial as C{llmgw_admin_serial}); a
certificate that proves none keeps its L{Refused} there instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.control.admin.base import Refused, client_address, printable
from llmgw.hostcheck import HostCheck
from llmgw.tlsconf.options import AdminIdentity, IdentityError, peer_admin
from llmgw.untrusted import clip

#: What the C{gateway} role may read: the routing data a standalone gateway
#: follows, and nothing about nodes or events.
GATEWAY_READS = (("api", "v1", "routes"), ("api", "v1", "watch"))
#: What the C{gateway} role may post: its demand, for the autoscaler.
GATEWAY_POSTS = (("api", "v1", "demand"),)
#: What the C{viewer} role may post: a playground chat, which spends only
#: the API keys its role was given (L{llmgw.control.admin.playground}).
VIEWER_POSTS = (("api", "v1", "playground", "chat"),)


def role_allows(role: str, method: str, path: list[str]) -> bool:
    """
    Whether an admin with C{role} may C{method} (C{GET} for C{HEAD}) the
    path C{path} (its segments): C{viewer} any C{GET} and a C{POST} of
    L{VIEWER_POSTS}; C{operator} any method (cordon, uncordon, drain,
    scale, retry, catalog and TLS reload, a deployment's C{PUT} and
    C{DELETE}); C{gateway} a C{GET} of L{GATEWAY_READS} and a C{POST} of
    L{GATEWAY_POSTS} only.
    """
    if role == "operator":
        return True
    if role == "gateway" and method == "POST":
        return tuple(path) in GATEWAY_POSTS
    if role == "viewer" and method == "POST":
        return tuple(path) in VIEWER_POSTS
    if method != "GET":
        return False
    if role == "viewer":
        return True
    if role == "gateway":
        return tuple(path) in GATEWAY_READS
    return False


def check_host(request: Any, hosts: HostCheck) -> None:
    """
    Refuse a request whose C{Host} is not a name the API serves, so that a
    page whose name rebinds to this address reads and changes nothing.

    @raise Refused: 400, no C{Host} (HTTP/1.1) or more than one; 421, a
        name not in C{hosts}.
    """
    names = request.requestHeaders.getRawHeaders(b"host") or []
    if len(names) > 1:
        raise Refused(400, "the request has more than one Host header")
    if not names:
        if request.clientproto != b"HTTP/1.0":
            raise Refused(400, "the request has no Host header")
        return
    if not hosts.allows(names[0]):
        raise Refused(
            421,
            f"this admin API does not serve the host {clip(names[0])}; its operator lists "
            f"the names it serves with {hosts.option}",
        )


def known_admin(request: Any) -> AdminIdentity | None:
    """
    The admin this request's connection has proved, if it has yet.
    """
    cached = getattr(request.channel, "llmgw_admin", None)
    return cached if isinstance(cached, AdminIdentity) else None


def _certificate_name(cert: Any) -> str | None:
    """
    A peer certificate's common name, printable, for log lines.
    """
    if cert is None:
        return None
    try:
        cn = cert.get_subject().CN
    except Exception:
        return None
    return printable(cn.encode("utf-8", "replace")) if cn else None


def has_certificate(request: Any) -> bool:
    """
    Whether C{request}'s connection brought a client certificate (an
    admin's or not): where certificates are only asked for, one without
    is judged by its session instead.
    """
    if getattr(request.channel, "llmgw_admin", None) is not None:
        return True
    get_peer = getattr(request.transport, "getPeerCertificate", None)
    return get_peer is not None and get_peer() is not None


def admin_of(request: Any) -> AdminIdentity:
    """
    The admin the request's client certificate proves, read once per
    connection.

    @raise Refused: 403, the certificate is no admin certificate.
    """
    channel = request.channel
    cached = getattr(channel, "llmgw_admin", None)
    if isinstance(cached, AdminIdentity):
        return cached
    if isinstance(cached, Refused):
        raise cached
    cert = None
    get_peer = getattr(request.transport, "getPeerCertificate", None)
    if get_peer is not None:
        cert = get_peer()
    try:
        if cert is None:
            raise IdentityError("no client certificate; the admin API needs an admin certificate")
        identity = peer_admin(cert.to_cryptography())
    except IdentityError as e:
        name = _certificate_name(cert)
        refused = Refused(403, str(e))
        refused.who = f"{client_address(request)}" + (f" (certificate {name})" if name else "")  # type: ignore[attr-defined]
        channel.llmgw_admin = refused
        raise refused from None
    channel.llmgw_admin = identity
    channel.llmgw_admin_serial = cert.get_serial_number()
    return identity


def authorize(request: Any, method: str, path: list[str],
              revoked: Callable[[], frozenset[int]] | None) -> None:
    """
    Over mutual TLS: refuse a request without an admin certificate, with
    one a CRL in force lists (C{revoked}: TLS checks the CRL only at the
    handshake, and a kept-alive connection must not go on), or one whose
    role may not do this.

    @raise Refused: 403, saying which.
    """
    admin = admin_of(request)
    if revoked is not None and getattr(request.channel, "llmgw_admin_serial", None) in revoked():
        raise Refused(403, f"the certificate of admin {admin.name!r} has been revoked")
    if not role_allows(admin.role, method, path):
        what = "changes state" if method != "GET" else "reads this"
        raise Refused(
            403,
            f"admin {admin.name!r} has role {admin.role}, which may not {method} "
            f"{'/' + '/'.join(path)} (this {what}; "
            + ("operator" if method != "GET" else "viewer or operator") + " may)",
        )


def who(request: Any, require_certificate: bool) -> str:
    """
    Who sent C{request}, for log lines: the admin's name and role and the
    address, or the address alone without mutual TLS.
    """
    addr = client_address(request)
    if not require_certificate:
        return addr
    session = getattr(request, "llmgw_session", None)
    if session is not None:
        return f"user {session.user} ({session.role}) at {addr}"
    cached = getattr(request.channel, "llmgw_admin", None)
    if isinstance(cached, AdminIdentity):
        return f"admin {cached} at {addr}"
    return getattr(cached, "who", addr)


def same_origin(origin: bytes, host: bytes) -> bool:
    """
    Whether a browser's C{Origin} names the host and port the request was
    sent to (its C{Host}).
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(origin.decode("ascii"))
        netloc = parts.netloc.lower()
    except (UnicodeDecodeError, ValueError):
        return False
    if parts.scheme not in ("http", "https") or not netloc:
        return False
    default = ":443" if parts.scheme == "https" else ":80"
    want = host.decode("latin-1").lower()
    return netloc == want or netloc + default == want or netloc == want + default
