"""
OpenSSL contexts for llmgw's TLS: the key-exchange groups each end offers,
and contexts made in two steps: L{bare_context} (TLS 1.2 at least, Twisted's
options and ciphers, the groups) and L{present} (an identity, the roots
trusted, the peer's certificate required). L{llmgw.tlsconf.options.TLSFiles}
does both at once; a node that joins makes its context when it starts and
presents its certificate in it once it holds one, since making a context
costs several times what presenting an identity does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryptography import x509
from OpenSSL import SSL, crypto
from OpenSSL._util import lib as _ssl_lib
from twisted.internet import ssl

#: Key exchange (DESIGN §4). The agent sends a key share for the first group
#: it lists, so it chooses; the control plane takes the group the agent sent
#: a share for (preferring the post-quantum hybrid) and never asks for
#: another, which would cost a round trip. By default agents put the hybrid
#: X25519MLKEM768 first: agent streams carry commands with their arguments
#: and environment, and a recording of them must not be readable by a future
#: quantum computer. Classical X25519 (L{AGENT_GROUPS_CLASSICAL}) saves about
#: 0.07 ms of control-plane CPU and 0.15 ms of agent CPU per handshake
#: (OpenSSL 4.0): under a tenth of a handshake, not worth the exposure.
#: Authentication (ECDSA certificates) is the same either way.
AGENT_GROUPS = "X25519MLKEM768:X25519:secp256r1"
AGENT_GROUPS_CLASSICAL = "X25519:X25519MLKEM768:secp256r1"
#: Kept for callers that name the hybrid explicitly.
AGENT_GROUPS_POST_QUANTUM = AGENT_GROUPS
SERVER_GROUPS = "X25519MLKEM768:X25519:secp256r1:secp384r1"
#: What is left when OpenSSL (before 3.5) has no ML-KEM.
_CLASSICAL_GROUPS = "X25519:secp256r1:secp384r1"


def set_groups(context: SSL.Context, groups: str) -> str | None:
    """
    Set C{context}'s key-exchange groups (an OpenSSL group list), falling
    back to the classical ones where OpenSSL lacks a named group, and to
    OpenSSL's defaults where it cannot set them at all. Returns the list in
    force, or C{None} for OpenSSL's defaults.
    """
    setter = getattr(_ssl_lib, "SSL_CTX_set1_curves_list", None)
    if setter is None:
        return None
    for candidate in (groups, _CLASSICAL_GROUPS):
        if setter(context._context, candidate.encode("ascii")) == 1:
            return candidate
    return None


def bare_context(groups: str | None = None) -> SSL.Context:
    """
    A new context with llmgw's TLS settings (Twisted's options and ciphers,
    TLS 1.2 at least, C{groups} if given: L{set_groups}) and no identity or
    trust: it verifies nothing until L{present} is called on it.
    """
    context = ssl.CertificateOptions(raiseMinimumTo=ssl.TLSVersion.TLSv1_2).getContext()
    if groups is not None:
        set_groups(context, groups)
    return context


def present(context: SSL.Context, cert: x509.Certificate, key: Any, roots: Sequence[x509.Certificate],
            crls: Sequence[x509.CertificateRevocationList] = ()) -> SSL.Context:
    """
    Give C{context} (from L{bare_context}, no connection made with it yet)
    C{cert} and its C{key}, trust in C{roots} only, the C{crls} checked
    against a peer's certificate, and require the peer's certificate, as
    Twisted's C{CertificateOptions} with a trust root does. Returns C{context}.

    @raise OpenSSL.SSL.Error: C{key} is not C{cert}'s.
    """
    # Handed to OpenSSL as they are, not through PEM (pyOpenSSL before 24.3
    # takes only its own types).
    context.use_certificate(crypto.X509.from_cryptography(cert))
    context.use_privatekey(crypto.PKey.from_cryptography_key(key))
    context.check_privatekey()
    store = context.get_cert_store()
    assert store is not None
    for root in roots:
        store.add_cert(crypto.X509.from_cryptography(root))
    for crl in crls:
        store.add_crl(crl)
    if crls:
        # CRL_CHECK checks the leaf, which is all our one-level CA has.
        store.set_flags(crypto.X509StoreFlags.CRL_CHECK)
    context.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT | SSL.VERIFY_CLIENT_ONCE)
    return context


__all__ = [
    "AGENT_GROUPS",
    "AGENT_GROUPS_CLASSICAL",
    "AGENT_GROUPS_POST_QUANTUM",
    "SERVER_GROUPS",
    "bare_context",
    "present",
    "set_groups",
]
