"""
TLS options for both ends of the agent stream.

The control plane requires a client certificate that chains to llmgw's CA
(TLS 1.2 at least) and reads the node's identity from it; the agent trusts
only that CA and checks that the control plane's certificate names the
address it dialled in its subject alternative names.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL, crypto
from OpenSSL._util import lib as _ssl_lib
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import (
    verify_certificate_hostname,
    verify_certificate_ip_address,
)
from twisted.internet import ssl
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
)
from twisted.python.failure import Failure
from zope.interface import implementer

from llmgw.tlsconf.ca import CAError, subject_alt_names
from llmgw.tlsconf.crl import CRLError, load_crl
from llmgw.wire import InvalidNodeId, validate_node_id

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


class TLSConfigError(Exception):
    """
    TLS files are missing, unreadable, expired or do not belong together. The
    message names the file and says why.
    """


class IdentityError(Exception):
    """
    A peer certificate is not an llmgw node identity.
    """


class ServerIdentityError(Exception):
    """
    The control plane's certificate does not name the address the agent
    dialled.
    """

    def __init__(self, host: str, sans: list[str]):
        self.host = host
        self.sans = sans
        held = ", ".join(sans) if sans else "no subject alternative names at all"
        super().__init__(
            f"the control plane's certificate does not name {host!r}, the address "
            f"this agent dialled; it holds {held} (the common name is never used). "
            f"Reissue it with `llmgw ctl cert server --host {host}`"
        )


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"cannot read {what} {path}: {e.strerror}") from e


def load_cert_file(path: Path | str, what: str = "certificate") -> x509.Certificate:
    """
    Read a PEM certificate, refusing one that is expired or not yet valid.

    @raise TLSConfigError: naming the file and the reason.
    """
    path = Path(path)
    try:
        cert = x509.load_pem_x509_certificate(_read(path, what))
    except ValueError as e:
        raise TLSConfigError(f"{what} {path} is not a PEM certificate: {e}") from e
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise TLSConfigError(
            f"{what} {path} expired on {cert.not_valid_after_utc.isoformat()}"
        )
    if cert.not_valid_before_utc > now:
        raise TLSConfigError(
            f"{what} {path} is not valid before {cert.not_valid_before_utc.isoformat()}"
        )
    return cert


def load_key_file(path: Path | str) -> Any:
    path = Path(path)
    try:
        return serialization.load_pem_private_key(_read(path, "key"), password=None)
    except (ValueError, TypeError) as e:
        raise TLSConfigError(f"key {path} is not an unencrypted PEM private key: {e}") from e


@dataclass(frozen=True)
class TLSFiles:
    """
    A certificate, its key and the CA root, loaded and checked together;
    and the CA's CRL where C{crl_path} is given and the file exists.
    """

    ca: x509.Certificate
    cert: x509.Certificate
    key: Any
    ca_path: Path
    cert_path: Path
    key_path: Path
    crl_path: Path | None = None
    crl: x509.CertificateRevocationList | None = None

    @classmethod
    def load(
        cls, ca_path: Path | str, cert_path: Path | str, key_path: Path | str,
        crl_path: Path | str | None = None,
    ) -> TLSFiles:
        """
        @raise TLSConfigError: a file is unreadable, expired, the key does not
            match the certificate, the certificate is not from the CA, or the
            CRL (when C{crl_path} exists) does not parse, is not the CA's, or
            has expired.
        """
        ca_path, cert_path, key_path = Path(ca_path), Path(cert_path), Path(key_path)
        ca = load_cert_file(ca_path, "CA certificate")
        cert = load_cert_file(cert_path)
        key = load_key_file(key_path)
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        enc = serialization.Encoding.DER
        if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
            raise TLSConfigError(f"key {key_path} does not belong to certificate {cert_path}")
        try:
            cert.verify_directly_issued_by(ca)
            issued = cert.issuer == ca.subject
        except Exception:
            issued = False
        if not issued:
            raise TLSConfigError(f"certificate {cert_path} was not issued by the CA in {ca_path}")
        crl = None
        if crl_path is not None:
            crl_path = Path(crl_path)
            if crl_path.exists():
                try:
                    crl = load_crl(crl_path, ca)
                except CRLError as e:
                    raise TLSConfigError(str(e)) from e
        return cls(ca, cert, key, ca_path, cert_path, key_path, crl_path, crl)

    def reread(self) -> TLSFiles:
        """
        Load the same files again (after a rotation).

        A CRL that was loaded and has since disappeared is refused rather
        than taken as "nothing is revoked": a half-done copy must not
        re-admit a revoked node.

        @raise TLSConfigError: as L{load}.
        """
        if self.crl is not None and self.crl_path is not None and not self.crl_path.exists():
            raise TLSConfigError(
                f"CRL {self.crl_path} was loaded before and is gone now; restore it "
                "(revocation stays in force until the control plane restarts without it)"
            )
        return TLSFiles.load(self.ca_path, self.cert_path, self.key_path, self.crl_path)

    def twisted_ca(self) -> ssl.Certificate:
        return ssl.Certificate.loadPEM(self.ca.public_bytes(serialization.Encoding.PEM))

    def twisted_private(self) -> ssl.PrivateCertificate:
        key = self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        return ssl.PrivateCertificate.loadPEM(
            self.cert.public_bytes(serialization.Encoding.PEM) + key
        )

    def context(self, groups: str | None = None) -> SSL.Context:
        """
        A new OpenSSL context presenting this certificate and trusting only
        the CA, TLS 1.2 at least. Peers must present a certificate; with a
        CRL, a peer certificate it lists fails the handshake. C{groups}: the
        key-exchange groups (L{set_groups}), or OpenSSL's defaults.
        """
        priv = self.twisted_private()
        opts = ssl.CertificateOptions(
            privateKey=priv.privateKey.original,
            certificate=priv.original,
            trustRoot=self.twisted_ca(),
            raiseMinimumTo=ssl.TLSVersion.TLSv1_2,
        )
        ctx = opts.getContext()
        if self.crl is not None:
            store = ctx.get_cert_store()
            assert store is not None
            store.add_crl(self.crl)
            # CRL_CHECK checks the leaf, which is all our one-level CA has.
            store.set_flags(crypto.X509StoreFlags.CRL_CHECK)
        if groups is not None:
            set_groups(ctx, groups)
        return ctx


def server_files(certs_dir: Path | str) -> TLSFiles:
    """
    The control plane's files in C{certs_dir}: C{ca.pem}, C{server.pem},
    C{server.key}, and C{crl.pem} when it exists.
    """
    d = Path(certs_dir)
    return TLSFiles.load(d / "ca.pem", d / "server.pem", d / "server.key", d / "crl.pem")


@implementer(IOpenSSLServerConnectionCreator)
class ServerTLS:
    """
    The control plane's side: a client certificate from the CA is mandatory.

    L{reload} swaps the context used for new handshakes; open connections
    keep the one they started with.
    """

    def __init__(self, files: TLSFiles):
        self.files = files
        self._context = files.context(SERVER_GROUPS)

    def reload(self, files: TLSFiles) -> None:
        context = files.context(SERVER_GROUPS)
        self.files, self._context = files, context

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        return SSL.Connection(self._context, None)


def peer_node_id(cert: x509.Certificate) -> str:
    """
    The node id a verified client certificate proves.

    The chain has already been checked against the CA by OpenSSL; this checks
    what makes the certificate a node identity: a leaf, issued for client
    authentication, with exactly one common name that is a valid node id.

    @raise IdentityError: saying which of those it fails.
    """
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise IdentityError("the client certificate is a CA certificate, not a node's")
    except x509.ExtensionNotFound:
        pass
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise IdentityError("the client certificate has no extended key usage") from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise IdentityError("the client certificate is not issued for client authentication")
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        raise IdentityError(f"the client certificate has {len(cns)} common names, not one")
    cn = cns[0].value
    if isinstance(cn, bytes):
        cn = cn.decode("utf-8", "replace")
    try:
        return validate_node_id(cn)
    except InvalidNodeId as e:
        raise IdentityError(f"the client certificate's common name is not a node id: {e}") from e


def verify_server_identity(cert: x509.Certificate, host: str) -> None:
    """
    Check that C{cert} names C{host} (an IP address or a DNS name) in its
    subject alternative names.

    @raise ServerIdentityError: it does not, with the SANs it does hold.
    """
    sans = subject_alt_names(cert)
    if not sans:
        raise ServerIdentityError(host, [])
    try:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            verify_certificate_hostname(cert, host)
        else:
            verify_certificate_ip_address(cert, str(ip))
    except (VerificationError, CertificateError):
        raise ServerIdentityError(host, sans) from None


def _common_name(cert: x509.Certificate) -> str | None:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if len(cns) == 1 else None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@implementer(IOpenSSLClientConnectionCreator)
class AgentClientTLS:
    """
    The agent's side: trust only llmgw's CA, present the node certificate,
    and refuse a control plane whose certificate does not name C{host}.

    The name check is done here rather than left to the TLS library so the
    failure can say which address was dialled and which names the
    certificate holds.
    """

    def __init__(self, host: str, files: TLSFiles, groups: str = AGENT_GROUPS):
        self.host = host.strip("[]")
        self.files = files
        #: Key-exchange groups, the first one sent a key share for.
        self.groups = groups
        self._context = self._make_context(files)
        #: The last verification failure, for callers that want it without a
        #: connection.
        self.last_error: ServerIdentityError | None = None

    def _make_context(self, files: TLSFiles) -> SSL.Context:
        context = files.context(self.groups)
        context.set_info_callback(self._info)
        return context

    def reload(self, files: TLSFiles | None = None) -> TLSFiles:
        """
        Use C{files} (by default: the same paths read again, after a renewal)
        for every new connection; a connection already open keeps its own.

        A certificate for another node is refused: the node id is the
        agent's identity, and changing it takes a restart.

        @raise TLSConfigError: the files are refused; the running ones stay.
        """
        if files is None:
            files = self.files.reread()
        old, new = _common_name(self.files.cert), _common_name(files.cert)
        if old != new:
            raise TLSConfigError(
                f"the new certificate {files.cert_path} is for {new!r}, but this agent "
                f"runs as {old!r}; restart the agent to change its identity"
            )
        context = self._make_context(files)
        self.files, self._context = files, context
        return files

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        conn = SSL.Connection(self._context, None)
        conn.set_app_data(tlsProtocol)
        if not _is_ip(self.host):
            conn.set_tlsext_host_name(self.host.encode("idna"))
        return conn

    def _info(self, connection: SSL.Connection, where: int, ret: int) -> None:
        if not where & SSL.SSL_CB_HANDSHAKE_DONE:
            return
        peer = connection.get_peer_certificate()
        try:
            if peer is None:
                raise ServerIdentityError(self.host, [])
            verify_server_identity(peer.to_cryptography(), self.host)
        except ServerIdentityError as e:
            self.last_error = e
            transport = connection.get_app_data()
            transport.failVerification(Failure(e))


def agent_files(
    certs_dir: Path | str | None = None,
    node_id: str | None = None,
    ca: Path | str | None = None,
    cert: Path | str | None = None,
    key: Path | str | None = None,
) -> TLSFiles:
    """
    An agent's files: C{--ca/--cert/--key}, or C{DIR/ca.pem} and
    C{DIR/agent-ID.pem/.key} for C{--certs DIR --node ID}.

    @raise TLSConfigError: naming the file and the reason.
    """
    if ca and cert and key:
        return TLSFiles.load(ca, cert, key)
    if certs_dir and node_id:
        d = Path(certs_dir)
        return TLSFiles.load(d / "ca.pem", d / f"agent-{node_id}.pem", d / f"agent-{node_id}.key")
    raise TLSConfigError("give --ca, --cert and --key, or --certs DIR and --node ID")


__all__ = [
    "AGENT_GROUPS",
    "AGENT_GROUPS_CLASSICAL",
    "AGENT_GROUPS_POST_QUANTUM",
    "SERVER_GROUPS",
    "AgentClientTLS",
    "CAError",
    "IdentityError",
    "ServerIdentityError",
    "ServerTLS",
    "TLSConfigError",
    "TLSFiles",
    "agent_files",
    "peer_node_id",
    "server_files",
    "set_groups",
    "verify_server_identity",
]
