"""
TLS options for both ends of the agent stream.

The control plane requires a client certificate that chains to llmgw's CA
(TLS 1.2 at least) and reads the node's identity from it; the agent trusts
only that CA and checks that the control plane's certificate names the
address it dialled in its subject alternative names.

"The CA" is every root in C{ca.pem}: during a rollover it holds the new
root and the old one, and both ends trust both, so that agents with a
certificate from either connect.

The same options serve the admin API over mutual TLS (L{peer_admin} reads
an admin certificate's name and role) and its clients
(L{ClientTLSPolicy} for Twisted's HTTP agent).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL
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
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from llmgw.tlsconf.certs import issued_by
from llmgw.tlsconf.contexts import (
    AGENT_GROUPS,
    AGENT_GROUPS_CLASSICAL,
    AGENT_GROUPS_POST_QUANTUM,
    SERVER_GROUPS,
    bare_context,
    present,
    set_groups,
)
from llmgw.tlsconf.crl import CRLError, load_crls
from llmgw.tlsconf.describe import subject_alt_names
from llmgw.tlsconf.pem import CAError
from llmgw.tlsconf.roles import ETCD_CN_PREFIX, ROLE_BY_OID, admin_name
from llmgw.wire import InvalidNodeId, validate_node_id


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
    return _valid_now(cert, path, what)


def _valid_now(cert: x509.Certificate, path: Path, what: str) -> x509.Certificate:
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


def load_ca_bundle(path: Path | str) -> tuple[x509.Certificate, ...]:
    """
    Every root in the CA bundle C{path} (one or more PEM certificates),
    each a CA certificate that is valid now.

    @raise TLSConfigError: naming the file, the root and the reason.
    """
    path = Path(path)
    data = _read(path, "CA certificate")
    try:
        roots = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise TLSConfigError(f"CA certificate {path} is not a PEM certificate: {e}") from e
    return _check_roots(roots, path)


def _check_roots(roots: list[x509.Certificate], path: Path) -> tuple[x509.Certificate, ...]:
    if not roots:
        raise TLSConfigError(f"CA certificate {path} holds no certificate")
    now = datetime.datetime.now(datetime.UTC)
    for i, root in enumerate(roots):
        what = f"CA certificate {path}" + (
            f" (root {i + 1} of {len(roots)}, {root.subject.rfc4514_string()})" if len(roots) > 1 else ""
        )
        try:
            is_ca = root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise TLSConfigError(f"{what} is not a CA certificate")
        if root.not_valid_after_utc < now:
            raise TLSConfigError(
                f"{what} expired on {root.not_valid_after_utc.isoformat()}"
                + ("; retire it (`llmgw ctl cert retire-ca`)" if len(roots) > 1 else "")
            )
        if root.not_valid_before_utc > now:
            raise TLSConfigError(f"{what} is not valid before {root.not_valid_before_utc.isoformat()}")
    return tuple(roots)


def load_key_file(path: Path | str) -> Any:
    path = Path(path)
    try:
        return serialization.load_pem_private_key(_read(path, "key"), password=None)
    except (ValueError, TypeError) as e:
        raise TLSConfigError(f"key {path} is not an unencrypted PEM private key: {e}") from e


@dataclass(frozen=True)
class TLSFiles:
    """
    A certificate, its key and the CA roots, loaded and checked together;
    and the CA's CRLs where C{crl_path} is given and the file exists.

    C{roots}: every root of C{ca_path} (all are trusted); C{ca}: the one
    that issued C{cert}. C{crls}: one per root, in the order of C{roots};
    C{crl}: the one of C{ca}.
    """

    ca: x509.Certificate
    cert: x509.Certificate
    key: Any
    ca_path: Path
    cert_path: Path
    key_path: Path
    crl_path: Path | None = None
    crl: x509.CertificateRevocationList | None = None
    roots: tuple[x509.Certificate, ...] = ()
    crls: tuple[x509.CertificateRevocationList, ...] = ()

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
        return cls.of(load_ca_bundle(ca_path), load_cert_file(cert_path), load_key_file(key_path),
                      ca_path, cert_path, key_path, crl_path)

    @classmethod
    def of(
        cls, roots: Sequence[x509.Certificate], cert: x509.Certificate, key: Any,
        ca_path: Path, cert_path: Path, key_path: Path, crl_path: Path | str | None = None,
    ) -> TLSFiles:
        """
        What L{load} returns for files that hold C{roots}, C{cert} and
        C{key}, with the same checks, for a caller that has just written them
        (a node that joined) and need not read them back.

        @raise TLSConfigError: as L{load}.
        """
        roots = _check_roots(list(roots), ca_path)
        cert = _valid_now(cert, cert_path, "certificate")
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        enc = serialization.Encoding.DER
        if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
            raise TLSConfigError(f"key {key_path} does not belong to certificate {cert_path}")
        ca = next((root for root in roots if issued_by(cert, root)), None)
        if ca is None:
            raise TLSConfigError(
                f"certificate {cert_path} was not issued by the CA in {ca_path} "
                f"(issuer {cert.issuer.rfc4514_string()})"
            )
        crl = None
        crls: list[x509.CertificateRevocationList] = []
        if crl_path is not None:
            crl_path = Path(crl_path)
            if crl_path.exists():
                try:
                    crls = load_crls(crl_path, roots)
                except CRLError as e:
                    raise TLSConfigError(
                        f"{e} (with several roots in {ca_path}, {crl_path} needs a CRL of each: "
                        "`llmgw ctl cert crl --renew` signs them)" if len(roots) > 1 else str(e)
                    ) from e
                crl = crls[roots.index(ca)]
        return cls(ca, cert, key, ca_path, cert_path, key_path, crl_path, crl, roots, tuple(crls))

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

    def trust_root(self) -> Any:
        """
        Every root, as a Twisted trust root.
        """
        return ssl.trustRootFromCertificates([
            ssl.Certificate.loadPEM(root.public_bytes(serialization.Encoding.PEM))
            for root in (self.roots or (self.ca,))
        ])

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
        the CA's roots, TLS 1.2 at least. Peers must present a certificate;
        with CRLs, a peer certificate they list fails the handshake.
        C{groups}: the key-exchange groups (L{set_groups}), or OpenSSL's
        defaults.
        """
        return self.present(bare_context(groups))

    def present(self, context: SSL.Context) -> SSL.Context:
        """
        Give C{context} (from L{bare_context}, no connection made with it
        yet) what L{context} would: returns it, as L{context} returns a new one.
        """
        return present(context, self.cert, self.key, self.roots or (self.ca,),
                       self.crls or ((self.crl,) if self.crl is not None else ()))


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


def _client_leaf(cert: x509.Certificate, what: str) -> str:
    """
    The single common name of a client certificate that may be an
    identity: a leaf, for client authentication, whose key may sign
    (keyUsage digitalSignature: proving the key in a handshake is a
    signature, and a certificate its issuer restricted to key agreement
    is not meant to prove anything).

    @raise IdentityError: saying which of those it fails.
    """
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise IdentityError(f"the client certificate is a CA certificate, not {what}")
    except x509.ExtensionNotFound:
        pass
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        raise IdentityError(
            "the client certificate has no key usage; an identity needs digitalSignature"
        ) from None
    if not ku.digital_signature:
        raise IdentityError(
            "the client certificate's key usage lacks digitalSignature "
            "(a key that may not sign proves no identity)"
        )
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise IdentityError("the client certificate has no extended key usage") from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        if ExtendedKeyUsageOID.SERVER_AUTH in eku:
            raise IdentityError(
                "the client certificate is not issued for client authentication: it is a "
                f"server certificate (serverAuth), not {what}"
            )
        raise IdentityError("the client certificate is not issued for client authentication")
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        raise IdentityError(f"the client certificate has {len(cns)} common names, not one")
    cn = cns[0].value
    if isinstance(cn, bytes):
        cn = cn.decode("utf-8", "replace")
    if cn.startswith(ETCD_CN_PREFIX):
        raise IdentityError(f"the client certificate {cn!r} is one for etcd's own TLS (`ctl cert etcd`), "
                            f"not {what}")
    return cn


def admin_roles(cert: x509.Certificate) -> list[str]:
    """
    The llmgw admin roles a certificate's extended key usage names.
    """
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return []
    return [ROLE_BY_OID[oid] for oid in eku if oid in ROLE_BY_OID]


def peer_node_id(cert: x509.Certificate) -> str:
    """
    The node id a verified client certificate proves.

    The chain has already been checked against the CA by OpenSSL; this checks
    what makes the certificate a node identity: a leaf, issued for client
    authentication, whose key may sign, with exactly one common name that is
    a valid node id, and no admin role (an admin certificate is not a node's,
    whatever its name).

    @raise IdentityError: saying which of those it fails.
    """
    cn = _client_leaf(cert, "a node's")
    roles = admin_roles(cert)
    if roles:
        raise IdentityError(
            f"the client certificate is an admin certificate ({cn!r}, role {roles[0]}), "
            "not a node's"
        )
    try:
        return validate_node_id(cn)
    except InvalidNodeId as e:
        raise IdentityError(f"the client certificate's common name is not a node id: {e}") from e


@dataclass(frozen=True)
class AdminIdentity:
    """
    Who an admin certificate says its holder is: C{name} (its common name)
    and C{role} (one of L{llmgw.tlsconf.ca.ADMIN_ROLES}).
    """

    name: str
    role: str

    def __str__(self) -> str:
        return f"{self.name} ({self.role})"


def peer_admin(cert: x509.Certificate) -> AdminIdentity:
    """
    The admin a verified client certificate proves: a client leaf as for
    L{peer_node_id}, carrying exactly one llmgw admin role. Node and server
    certificates are refused, saying which they are.

    @raise IdentityError: saying why it is not an admin certificate.
    """
    try:
        cn = _client_leaf(cert, "an admin certificate")
    except IdentityError as e:
        raise IdentityError(f"{e}; the admin API takes admin certificates only") from None
    roles = admin_roles(cert)
    if not roles:
        raise IdentityError(
            f"the client certificate {cn!r} is a node certificate, not an admin certificate "
            "(issue one with `llmgw ctl cert admin NAME --role viewer|operator|gateway`)"
        )
    if len(roles) != 1:
        raise IdentityError(f"the client certificate {cn!r} names {len(roles)} admin roles, not one")
    try:
        name = admin_name(cn)
    except CAError as e:
        raise IdentityError(f"the client certificate's common name is not an admin name: {e}") from e
    return AdminIdentity(name, roles[0])


def verify_server_identity(cert: x509.Certificate, host: str) -> None:
    """
    Check that C{cert} names C{host} (an IP address or a DNS name) in its
    subject alternative names.

    @raise ServerIdentityError: it does not, with the SANs it does hold.
    """
    # The names are listed only for the error: every handshake comes here.
    try:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            verify_certificate_hostname(cert, host)
        else:
            verify_certificate_ip_address(cert, str(ip))
    except (VerificationError, CertificateError):
        raise ServerIdentityError(host, subject_alt_names(cert)) from None


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

    def __init__(self, host: str, files: TLSFiles, groups: str = AGENT_GROUPS,
                 context: SSL.Context | None = None):
        self.host = host.strip("[]")
        self.files = files
        #: Key-exchange groups, the first one sent a key share for.
        self.groups = groups
        # A context made before the files were there (L{bare_context} with
        # C{groups}, by a node that joins) is given them rather than made anew.
        self._context = self._make_context(files, context)
        #: The last verification failure, for callers that want it without a
        #: connection.
        self.last_error: ServerIdentityError | None = None

    def _make_context(self, files: TLSFiles, bare: SSL.Context | None = None) -> SSL.Context:
        context = files.context(self.groups) if bare is None else files.present(bare)
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


@implementer(IPolicyForHTTPS)
class ClientTLSPolicy:
    """
    Twisted's HTTP agent's TLS policy for a client of the admin API (the
    standalone gateway): trust only llmgw's roots, present C{files}'
    certificate, and check that the server's certificate names the host
    dialled (as L{AgentClientTLS} does for agents). One connection creator
    per host, built on first use; L{reload} drops them.
    """

    def __init__(self, files: TLSFiles):
        self.files = files
        self._creators: dict[str, AgentClientTLS] = {}

    def creatorForNetloc(self, hostname: bytes, port: int) -> AgentClientTLS:  # noqa: N802
        host = hostname.decode("ascii", "replace")
        creator = self._creators.get(host)
        if creator is None:
            creator = self._creators[host] = AgentClientTLS(host, self.files, AGENT_GROUPS_CLASSICAL)
        return creator

    def reload(self, files: TLSFiles | None = None) -> TLSFiles:
        """
        Use C{files} (by default the same paths read again) for new
        connections.

        @raise TLSConfigError: the files are refused; the running ones stay.
        """
        self.files = files if files is not None else self.files.reread()
        self._creators = {}
        return self.files


def admin_files(certs_dir: Path | str, name: str) -> TLSFiles:
    """
    An admin client's files in C{certs_dir}: C{ca.pem} and
    C{admin-NAME.pem/.key} (what C{llmgw ctl cert admin NAME} writes).

    @raise TLSConfigError: naming the file and the reason.
    """
    d = Path(certs_dir)
    try:
        admin_name(name)
    except CAError as e:
        raise TLSConfigError(str(e)) from e
    return TLSFiles.load(d / "ca.pem", d / f"admin-{name}.pem", d / f"admin-{name}.key")


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
    "bare_context",
    "AdminIdentity",
    "ClientTLSPolicy",
    "admin_files",
    "admin_roles",
    "load_ca_bundle",
    "peer_admin",
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
