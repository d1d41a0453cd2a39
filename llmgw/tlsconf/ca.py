"""
llmgw's private certificate authority.

A public authority cannot issue these certificates (they no longer sign the
clientAuth usage), so llmgw keeps a small CA of its own: an ECDSA P-256 key
that lives on one machine and a self-signed root that every node trusts.

Files in the CA directory (default C{./certs}):

    ca.pem                            every trusted root (the bundle); the
                                      active one first
    ca.key                            the active root's key (it signs)
    ca-previous.pem, ca-previous.key  the root being retired, during a
                                      rollover only (L{CertificateAuthority.rotate})
    ca-retired-SERIAL.pem             a root retired by L{CertificateAuthority.retire}
    server.pem, server.key            the control plane's certificate
    agent-NODE.pem, agent-NODE.key    one node's certificate
    admin-NAME.pem, admin-NAME.key    one admin client's certificate (with its role)
    issued.jsonl                      one JSON line per certificate issued

Leaves carry the key usage TLS needs of an ECDSA key, digitalSignature,
and nothing else; the extended key usage says what they are for
(serverAuth, clientAuth, and for admin clients an llmgw role, see
L{llmgw.tlsconf.roles}); no node or server certificate carries a role.

This module is the CA directory: what is issued, what is recorded, the
rollover. Making a certificate is L{llmgw.tlsconf.certs}, reading and
writing PEM files (keys with mode 0600, through a temporary file and a
rename, so a reader never sees half a key) L{llmgw.tlsconf.pem}, and
showing one to an operator L{llmgw.tlsconf.describe}.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.tlsconf.certs import (
    common_name_of,
    issued_by,
    make_leaf,
    now_utc,
    parse_host,
    same_key,
    self_signed_root,
)
from llmgw.tlsconf.pem import (
    CAError,
    cert_pem,
    key_pem,
    load_bundle,
    load_key,
    write_private,
    write_public,
)
from llmgw.tlsconf.roles import ADMIN_ROLE_OIDS, ADMIN_ROLES, ETCD_CN_PREFIX, admin_name
from llmgw.wire import InvalidNodeId, validate_node_id

DEFAULT_CA_DAYS = 3650
DEFAULT_LEAF_DAYS = 365
#: The kinds of certificates (C{issued.jsonl}) that are identities to the
#: control plane; an etcd CA issues none of them (see L{_check_separate}).
FLEET_KINDS = ("agent", "admin-")


def signed_file(how: str) -> str:
    """The C{file} of an C{issued.jsonl} line for a certificate signed from a node's request."""
    return f"({how}: key on the node)"


def issued_line(cert: x509.Certificate, file: str, kind: str) -> str:
    """One line of C{issued.jsonl} (ending in a newline): what C{ctl cert revoke} looks up."""
    entry = {
        "serial": format(cert.serial_number, "x"),
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "kind": kind,
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "file": file,
    }
    return json.dumps(entry, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Issued:
    """
    A certificate and key just issued, and where they were written.

    C{replaced}: the certificate that was in C{cert_path} before (on
    C{--renew}/C{--force}), or C{None}.
    """

    certificate: x509.Certificate
    cert_path: Path
    key_path: Path
    replaced: x509.Certificate | None = None


#: C{replace} values of the C{issue_*} methods: what to do when the files
#: already exist.
REFUSE, FORCE, RENEW = "refuse", "force", "renew"


class CertificateAuthority:
    """
    The CA in one directory.

    Build one with L{CertificateAuthority.init} (a new CA) or
    L{CertificateAuthority.load} (an existing one).

    C{certificate} and C{key} are the active root, which signs everything
    issued; C{roots} is every root in the bundle (C{ca.pem}), the active one
    first; C{previous} is the root being retired during a rollover (with its
    key, so its CRL can still be signed), else C{None}.
    """

    def __init__(
        self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate,
        roots: Sequence[x509.Certificate] | None = None,
        previous: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None = None,
    ):
        self.directory = directory
        self.key = key
        self.certificate = cert
        self.roots = list(roots) if roots is not None else [cert]
        self.previous = previous

    @property
    def cert_path(self) -> Path:
        return self.directory / "ca.pem"

    @classmethod
    def init(
        cls, directory: Path | str, force: bool = False, days: int = DEFAULT_CA_DAYS,
        name: str = "llmgw CA",
    ) -> CertificateAuthority:
        """
        Make a new CA in C{directory}.

        @raise CAError: a CA is already there and C{force} is false.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if not force and ((directory / "ca.pem").exists() or (directory / "ca.key").exists()):
            raise CAError(
                f"a CA already exists in {directory} (ca.pem/ca.key); "
                "pass --force to replace it, which invalidates every certificate it issued "
                "(`llmgw ctl cert rotate-ca` replaces it without a fleet-wide outage)"
            )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self_signed_root(key, name, days)
        write_private(directory / "ca.key", key_pem(key))
        write_public(directory / "ca.pem", cert_pem(cert))
        (directory / "ca-previous.key").unlink(missing_ok=True)
        (directory / "ca-previous.pem").unlink(missing_ok=True)
        if force:
            (directory / "issued.jsonl").unlink(missing_ok=True)
        ca = cls(directory, key, cert)
        ca._record(cert, directory / "ca.pem", "ca")
        return ca

    @classmethod
    def load(cls, directory: Path | str) -> CertificateAuthority:
        """
        Load the CA in C{directory}.

        @raise CAError: the files are missing, unreadable, or do not match.
        """
        directory = Path(directory)
        cert_file, key_file = directory / "ca.pem", directory / "ca.key"
        if not cert_file.exists() or not key_file.exists():
            raise CAError(
                f"no CA in {directory} (need ca.pem and ca.key); "
                "make one with `llmgw ctl cert init`"
            )
        roots = load_bundle(cert_file)
        key = load_key(key_file)
        active = [c for c in roots if same_key(key, c)]
        if not active:
            raise CAError(f"{key_file} belongs to none of the certificates in {cert_file}")
        cert = active[0]
        ordered = [cert] + [c for c in roots if c is not cert]
        previous = None
        prev_cert, prev_key = directory / "ca-previous.pem", directory / "ca-previous.key"
        if prev_key.exists() and prev_cert.exists():
            pkey = load_key(prev_key)
            pcert = load_bundle(prev_cert)[0]
            if not same_key(pkey, pcert):
                raise CAError(f"{prev_key} does not belong to {prev_cert}")
            previous = (pkey, pcert)
        return cls(directory, key, cert, ordered, previous)

    # -- rollover ---------------------------------------------------------------

    def signers(self) -> list[tuple[ec.EllipticCurvePrivateKey, x509.Certificate]]:
        """
        The roots whose keys this CA holds (the active one first, then the
        one being retired): each signs its own CRL.
        """
        out = [(self.key, self.certificate)]
        if self.previous is not None:
            out.append(self.previous)
        return out

    def rotate(self, days: int = DEFAULT_CA_DAYS) -> x509.Certificate:
        """
        Start a rollover: make a new root beside the active one, which
        becomes the previous one (C{ca-previous.pem/.key}); write the bundle
        C{ca.pem} with both (new first); from now on everything is issued by
        the new root. Certificates of the old one stay valid everywhere that
        has the bundle, until L{retire}.

        @raise CAError: a rollover is already under way.
        """
        if self.previous is not None:
            raise CAError(
                f"a rollover is already under way in {self.directory} (ca-previous.pem: "
                f"{self.previous[1].subject.rfc4514_string()}); finish it with "
                "`llmgw ctl cert retire-ca` first"
            )
        now = now_utc()
        key = ec.generate_private_key(ec.SECP256R1())
        base = common_name_of(self.certificate) or "llmgw CA"
        base = base.split(" (", 1)[0]
        name = f"{base} ({now:%Y-%m-%d %H:%M:%S}, {secrets.token_hex(3)})"
        cert = self_signed_root(key, name, days)
        old_key, old_cert = self.key, self.certificate
        d = self.directory
        # Previous first, then the bundle, then the new key: a crash midway
        # leaves a CA that still loads (with the old root active).
        write_private(d / "ca-previous.key", key_pem(old_key))
        write_public(d / "ca-previous.pem", cert_pem(old_cert))
        others = [c for c in self.roots if c is not old_cert]
        bundle = [cert, old_cert, *others]
        write_public(d / "ca.pem", b"".join(cert_pem(c) for c in bundle))
        write_private(d / "ca.key", key_pem(key))
        self.key, self.certificate = key, cert
        self.roots = bundle
        self.previous = (old_key, old_cert)
        self._record(cert, d / "ca.pem", "ca")
        return cert

    def leaves(self) -> list[tuple[Path, x509.Certificate]]:
        """
        The leaf certificates in the directory (server, agents, admins).
        """
        out = []
        for path in sorted(self.directory.glob("*.pem")):
            if path.name in ("ca.pem", "ca-previous.pem", "crl.pem") or path.name.startswith(
                ("ca-retired-", ".")
            ):
                continue
            try:
                out.append((path, x509.load_pem_x509_certificate(path.read_bytes())))
            except (OSError, ValueError):
                continue
        return out

    def retire(self, force: bool = False) -> tuple[x509.Certificate, list[Path]]:
        """
        End a rollover: take the previous root out of the bundle, delete its
        key and keep its certificate as C{ca-retired-SERIAL.pem}. Returns
        the retired root and the leaf files in the directory it still
        issued (with C{force}; without it they refuse the retirement).

        @raise CAError: no rollover is under way, or leaves in the directory
            were issued by the previous root and C{force} is false.
        """
        if self.previous is None:
            raise CAError(
                f"no rollover is under way in {self.directory} (no ca-previous.key); "
                "start one with `llmgw ctl cert rotate-ca`"
            )
        pkey, pcert = self.previous
        stale = [path for path, cert in self.leaves() if issued_by(cert, pcert)]
        if stale and not force:
            names = ", ".join(p.name for p in stale[:10])
            more = f" and {len(stale) - 10} more" if len(stale) > 10 else ""
            raise CAError(
                f"{len(stale)} certificates in {self.directory} were issued by the root being "
                f"retired and stop working everywhere once it goes: {names}{more}; renew them "
                "(`llmgw ctl cert agent|server|admin ... --renew`) and roll them out first, "
                "or pass --force"
            )
        d = self.directory
        self.roots = [c for c in self.roots if c != pcert]
        write_public(d / "ca.pem", b"".join(cert_pem(c) for c in self.roots))
        write_public(d / f"ca-retired-{pcert.serial_number:x}.pem", cert_pem(pcert))
        (d / "ca-previous.key").unlink(missing_ok=True)
        (d / "ca-previous.pem").unlink(missing_ok=True)
        self.previous = None
        return pcert, stale

    # -- issuing ----------------------------------------------------------------

    def _check_replace(self, stem: str, replace: str) -> x509.Certificate | None:
        """
        The certificate already at C{stem}, if any, when C{replace} allows
        writing over it.

        @raise CAError: a key or certificate is there and C{replace} is
            L{REFUSE}.
        """
        cert_path = self.directory / f"{stem}.pem"
        key_path = self.directory / f"{stem}.key"
        if not (cert_path.exists() or key_path.exists()):
            return None
        if replace == REFUSE:
            raise CAError(
                f"{key_path.name} already exists in {self.directory}: refusing to replace a "
                "key that may be in use; pass --renew to issue a new certificate and key in "
                "its place (the old one stays valid until it expires or is revoked), "
                "or --force"
            )
        try:
            return x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError):
            return None

    def _write_leaf(
        self, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, kind: str,
        replaced: x509.Certificate | None = None,
    ) -> Issued:
        cert_path = self.directory / f"{stem}.pem"
        key_path = self.directory / f"{stem}.key"
        write_private(key_path, key_pem(key))
        write_public(cert_path, cert_pem(cert))
        self._record(cert, cert_path, kind)
        return Issued(cert, cert_path, key_path, replaced)

    def issue_server(
        self, hosts: Iterable[str], days: int = DEFAULT_LEAF_DAYS, replace: str = FORCE
    ) -> Issued:
        """
        Issue the control plane's certificate for C{hosts} and write
        C{server.pem} and C{server.key}.

        @param replace: L{REFUSE}, L{FORCE} or L{RENEW} (see
            L{_check_replace}); the CLI refuses by default.
        @raise CAError: no host was given, or one is malformed, or the files
            exist and C{replace} is L{REFUSE}.
        """
        sans = [parse_host(h) for h in hosts]
        if not sans:
            raise CAError(
                "a server certificate needs at least one --host: the name or IP "
                "address that agents dial"
            )
        replaced = self._check_replace("server", replace)
        first = sans[0].value
        key, cert = make_leaf(self.key, self.certificate, str(first), days, sans,
                              ExtendedKeyUsageOID.SERVER_AUTH)
        return self._write_leaf("server", key, cert, "server", replaced)

    def issue_agent(
        self, node_id: str, days: int = DEFAULT_LEAF_DAYS, replace: str = FORCE, shared: bool = False
    ) -> Issued:
        """
        Issue node C{node_id}'s client certificate and write
        C{agent-NODE_ID.pem} and C{.key}.

        @param shared: issue it even if this CA issued etcd certificates.
        @raise CAError: C{node_id} is not a valid node id, the files exist
            and C{replace} is L{REFUSE}, or this is an etcd CA (see
            L{_check_separate}) and not C{shared}.
        """
        try:
            validate_node_id(node_id)
        except InvalidNodeId as e:
            raise CAError(str(e)) from e
        self._check_separate("agent", shared)
        replaced = self._check_replace(f"agent-{node_id}", replace)
        key, cert = make_leaf(self.key, self.certificate, node_id, days, [],
                              ExtendedKeyUsageOID.CLIENT_AUTH)
        return self._write_leaf(f"agent-{node_id}", key, cert, "agent", replaced)

    def issue_etcd(
        self, name: str, hosts: Iterable[str] = (), days: int = DEFAULT_LEAF_DAYS, replace: str = FORCE,
        shared: bool = False,
    ) -> Issued:
        """
        Issue a certificate for etcd's own TLS from this CA, which must
        be a CA directory of its own (an etcd that trusted the fleet's CA
        would take every agent's certificate), and write C{etcd-NAME.pem}
        and C{.key}. It serves as both server and client (etcd peers are
        both): an etcd member's client and peer certificate, naming C{hosts}
        (the addresses in its URLs), or a control-plane member's etcd client
        certificate (no hosts needed). Its common name is C{etcd:NAME}
        (L{ETCD_CN_PREFIX}), so the control plane takes it neither as a
        node's nor as an admin's.

        @param shared: issue it even if this CA issued node or admin
            certificates.
        @raise CAError: the name is not a valid id, a host is malformed, the
            files exist and C{replace} is L{REFUSE}, or this CA issued node
            or admin certificates and not C{shared}.
        """
        try:
            validate_node_id(name)
        except InvalidNodeId as e:
            raise CAError(str(e).replace("node id", "etcd certificate name")) from e
        sans = [parse_host(h) for h in hosts]
        self._check_separate("etcd", shared)
        replaced = self._check_replace(f"etcd-{name}", replace)
        key, cert = make_leaf(self.key, self.certificate, ETCD_CN_PREFIX + name, days, sans,
                              ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
        return self._write_leaf(f"etcd-{name}", key, cert, "etcd", replaced)

    def issue_admin(
        self, name: str, role: str, days: int = DEFAULT_LEAF_DAYS, replace: str = FORCE,
        shared: bool = False,
    ) -> Issued:
        """
        Issue an admin client certificate for C{name} with C{role} (one of
        L{ADMIN_ROLES}) and write C{admin-NAME.pem} and C{.key}.

        @param shared: issue it even if this CA issued etcd certificates.
        @raise CAError: the name or role is not valid, the files exist and
            C{replace} is L{REFUSE}, or this is an etcd CA and not C{shared}.
        """
        admin_name(name)
        if role not in ADMIN_ROLE_OIDS:
            raise CAError(f"unknown admin role {role!r}; choose one of {', '.join(ADMIN_ROLES)}")
        self._check_separate("admin", shared)
        replaced = self._check_replace(f"admin-{name}", replace)
        key, cert = make_leaf(
            self.key, self.certificate, name, days, [], ExtendedKeyUsageOID.CLIENT_AUTH,
            ADMIN_ROLE_OIDS[role],
        )
        return self._write_leaf(f"admin-{name}", key, cert, f"admin-{role}", replaced)

    def _check_separate(self, kind: str, shared: bool) -> None:
        """
        Keep etcd's CA apart from the fleet's: an etcd that trusts a CA takes
        every client certificate it issued, so a GPU host's agent
        certificate would be an etcd client that may rewrite the leader key,
        the fleet state and the published routes.

        @raise CAError: C{kind} is C{"etcd"} and this CA issued node or
            admin certificates, or the other way round; unless C{shared}.
        """
        if shared:
            return
        kinds = {str(e.get("kind", "")) for e in self.issued()}
        if kind == "etcd":
            fleet = sorted(k for k in kinds if k.startswith(FLEET_KINDS))
            if fleet:
                raise CAError(
                    f"the CA in {self.directory} issued {', '.join(fleet)} certificates: an etcd that "
                    f"trusted it would take each as a client (any GPU host could rewrite the leader "
                    f"key and the fleet state); make etcd a CA of its own (`llmgw ctl cert init --certs "
                    f"etcd-pki`), or give --shared-ca to issue from this one anyway")
        elif "etcd" in kinds:
            raise CAError(
                f"the CA in {self.directory} issued etcd certificates: etcd trusts it, so a {kind} "
                f"certificate from it would be an etcd client too; issue {kind} certificates from the "
                f"fleet's CA, or give --shared-ca to issue from this one anyway")

    def issued(self) -> list[dict[str, object]]:
        """
        Every certificate this CA recorded issuing, oldest first.
        """
        path = self.directory / "issued.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def _record(self, cert: x509.Certificate, path: Path, kind: str) -> None:
        # On disk before the certificate is handed out: revoking by name
        # looks its serial up here. (The control plane batches its lines:
        # llmgw.control.shell.tokenwrites.)
        with open(self.issued_path, "a") as f:
            f.write(issued_line(cert, path.name, kind))
            f.flush()
            os.fsync(f.fileno())

    @property
    def issued_path(self) -> Path:
        """The log of what this CA issued, one JSON object a line (L{issued_line})."""
        return self.directory / "issued.jsonl"

    def record_signed(self, cert: x509.Certificate, how: str) -> None:
        """
        Note a node certificate signed from a node's request (its key never
        here, so no file): C{llmgw ctl cert revoke NODE} finds it by name.
        C{how} says where it went (C{joined}, C{renewed}, C{approved}).
        """
        self._record(cert, Path(signed_file(how)), "agent")

    def signed(self, cert: x509.Certificate) -> bool:
        """
        Whether C{cert} was issued by one of this CA's roots (issuer name and
        signature).
        """
        return any(issued_by(cert, root) for root in self.roots)
