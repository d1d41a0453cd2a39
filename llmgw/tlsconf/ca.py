"""
llmgw's private certificate authority.

A public authority cannot issue these certificates (they no longer sign the
clientAuth usage), so llmgw keeps a small CA of its own: an ECDSA P-256 key
that lives on one machine and a self-signed root that every node trusts.

Files in the CA directory (default C{./certs}):

    ca.pem, ca.key                    the root and its key
    server.pem, server.key            the control plane's certificate
    agent-NODE.pem, agent-NODE.key    one node's certificate
    issued.jsonl                      one JSON line per certificate issued

Keys are written with mode 0600, through a temporary file and a rename, so a
reader never sees half a key.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.wire import InvalidNodeId, validate_node_id

#: Certificates start this far in the past, so a node whose clock is a little
#: behind does not see them as not yet valid.
BACKDATE = datetime.timedelta(minutes=5)
DEFAULT_CA_DAYS = 3650
DEFAULT_LEAF_DAYS = 365


class CAError(Exception):
    """
    A CA operation was refused; the message says why, for an operator.
    """


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def write_private(path: Path, data: bytes) -> None:
    """
    Write C{data} to C{path} with mode 0600, atomically.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_public(path: Path, data: bytes) -> None:
    """
    Write C{data} to C{path} with mode 0644, atomically.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def random_serial() -> int:
    # 159 random bits: positive, under the 20-octet limit, never repeated in practice.
    return secrets.randbits(159) | 1


def parse_host(host: str) -> x509.GeneralName:
    """
    The subject alternative name for C{host}: an IP entry for an address, a
    DNS entry for a name.

    @raise CAError: C{host} is empty or not a plausible DNS name.
    """
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise CAError("empty --host")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if any(c.isspace() or c in "/:@" for c in host) or len(host) > 253:
        raise CAError(f"--host {host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host.lower())


@dataclass(frozen=True)
class Issued:
    """
    A certificate and key just issued, and where they were written.
    """

    certificate: x509.Certificate
    cert_path: Path
    key_path: Path


class CertificateAuthority:
    """
    The CA in one directory.

    Build one with L{CertificateAuthority.init} (a new CA) or
    L{CertificateAuthority.load} (an existing one).
    """

    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.directory = directory
        self.key = key
        self.certificate = cert

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
                "pass --force to replace it, which invalidates every certificate it issued"
            )
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(random_serial())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        write_private(directory / "ca.key", key_pem(key))
        write_public(directory / "ca.pem", cert_pem(cert))
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
        try:
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        except ValueError as e:
            raise CAError(f"{cert_file} is not a PEM certificate: {e}") from e
        try:
            key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise CAError(f"{key_file} is not an unencrypted PEM private key: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CAError(f"{key_file} is not an ECDSA key")
        if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
            raise CAError(f"{key_file} does not belong to {cert_file}")
        return cls(directory, key, cert)

    def _leaf(
        self, subject_cn: str, days: int, sans: Sequence[x509.GeneralName],
        usage: x509.ObjectIdentifier,
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        not_after = min(
            now + datetime.timedelta(days=days), self.certificate.not_valid_after_utc
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(random_serial())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=True, key_cert_sign=False,
                    crl_sign=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self.key.public_key()
                ),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return key, builder.sign(self.key, hashes.SHA256())

    def _write_leaf(
        self, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, kind: str
    ) -> Issued:
        cert_path = self.directory / f"{stem}.pem"
        key_path = self.directory / f"{stem}.key"
        write_private(key_path, key_pem(key))
        write_public(cert_path, cert_pem(cert))
        self._record(cert, cert_path, kind)
        return Issued(cert, cert_path, key_path)

    def issue_server(self, hosts: Iterable[str], days: int = DEFAULT_LEAF_DAYS) -> Issued:
        """
        Issue the control plane's certificate for C{hosts} and write
        C{server.pem} and C{server.key}.

        @raise CAError: no host was given, or one is malformed.
        """
        sans = [parse_host(h) for h in hosts]
        if not sans:
            raise CAError(
                "a server certificate needs at least one --host: the name or IP "
                "address that agents dial"
            )
        first = sans[0].value
        key, cert = self._leaf(str(first), days, sans, ExtendedKeyUsageOID.SERVER_AUTH)
        return self._write_leaf("server", key, cert, "server")

    def issue_agent(self, node_id: str, days: int = DEFAULT_LEAF_DAYS) -> Issued:
        """
        Issue node C{node_id}'s client certificate and write
        C{agent-NODE_ID.pem} and C{.key}.

        @raise CAError: C{node_id} is not a valid node id.
        """
        try:
            validate_node_id(node_id)
        except InvalidNodeId as e:
            raise CAError(str(e)) from e
        key, cert = self._leaf(node_id, days, [], ExtendedKeyUsageOID.CLIENT_AUTH)
        return self._write_leaf(f"agent-{node_id}", key, cert, "agent")

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
        entry = {
            "serial": format(cert.serial_number, "x"),
            "subject": cert.subject.rfc4514_string(),
            "kind": kind,
            "not_before": cert.not_valid_before_utc.isoformat(),
            "not_after": cert.not_valid_after_utc.isoformat(),
            "file": path.name,
        }
        with open(self.directory / "issued.jsonl", "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")

    def signed(self, cert: x509.Certificate) -> bool:
        """
        Whether C{cert} was issued by this CA (issuer name and signature).
        """
        if cert.issuer != self.certificate.subject:
            return False
        try:
            cert.verify_directly_issued_by(self.certificate)
        except (ValueError, TypeError, Exception):
            return False
        return True


def load_certificate(path: Path | str) -> x509.Certificate:
    """
    Read one PEM certificate.

    @raise CAError: the file is missing or is not a PEM certificate.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CAError(f"cannot read {path}: {e.strerror}") from e
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CAError(f"{path} is not a PEM certificate: {e}") from e


def subject_alt_names(cert: x509.Certificate) -> list[str]:
    """
    The certificate's DNS and IP subject alternative names, as strings.
    """
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    names = [f"DNS:{n}" for n in ext.value.get_values_for_type(x509.DNSName)]
    names += [f"IP:{n}" for n in ext.value.get_values_for_type(x509.IPAddress)]
    return names


def extended_key_usages(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return []
    names = {
        ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
        ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    }
    return [names.get(oid, oid.dotted_string) for oid in ext.value]


def describe(path: Path | str, ca_dir: Path | str | None = None) -> dict[str, object]:
    """
    What C{llmgw ctl cert show} prints: subject, SANs, usages, validity,
    serial, and whether the certificate chains to the CA in C{ca_dir}.

    @raise CAError: the file is not a certificate.
    """
    cert = load_certificate(path)
    now = _now()
    info: dict[str, object] = {
        "file": str(path),
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": format(cert.serial_number, "x"),
        "sans": subject_alt_names(cert),
        "usages": extended_key_usages(cert),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "expires_in_days": round((cert.not_valid_after_utc - now).total_seconds() / 86400, 1),
    }
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        info["is_ca"] = bc.ca
    except x509.ExtensionNotFound:
        info["is_ca"] = False
    if ca_dir is not None:
        ca_file = Path(ca_dir) / "ca.pem"
        if ca_file.exists():
            ca_cert = load_certificate(ca_file)
            try:
                cert.verify_directly_issued_by(ca_cert)
                ok = cert.issuer == ca_cert.subject
            except Exception:
                ok = False
            info["chains_to_ca"] = ok
            info["ca"] = str(ca_file)
        else:
            info["chains_to_ca"] = None
            info["ca"] = f"{ca_file} (missing)"
    return info
