"""
Making certificates: the self-signed root of a CA and the leaves it signs
(ECDSA P-256, SHA-256), their serials, subject alternative names and key
usage; and the checks that a certificate came from a root or belongs to a
key.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.tlsconf.pem import CAError

#: Certificates start this far in the past, so a node whose clock is a little
#: behind does not see them as not yet valid.
BACKDATE = datetime.timedelta(minutes=5)

#: A leaf's key usage: digitalSignature only (TLS 1.2 ECDHE and TLS 1.3 sign
#: with the key; nothing agrees keys with it).
LEAF_KEY_USAGE = x509.KeyUsage(
    digital_signature=True, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=False, key_cert_sign=False,
    crl_sign=False, encipher_only=False, decipher_only=False,
)


def now_utc() -> datetime.datetime:
    """The time now, in UTC: certificates' validity is reckoned in it."""
    return datetime.datetime.now(datetime.UTC)


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


def same_key(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> bool:
    pub = cert.public_key()
    return isinstance(pub, ec.EllipticCurvePublicKey) and (
        key.public_key().public_numbers() == pub.public_numbers()
    )


def self_signed_root(
    key: ec.EllipticCurvePrivateKey, name: str, days: int
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = now_utc()
    return (
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def make_leaf(
    issuer_key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate, subject_cn: str, days: int,
    sans: Sequence[x509.GeneralName], *usages: x509.ObjectIdentifier,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """
    A new key and a leaf certificate for it, named C{subject_cn} with
    C{sans}, for the extended key C{usages}, signed by C{issuer_key} (the key
    of C{issuer}). It is valid for C{days}, but never past C{issuer}'s end.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = now_utc()
    not_after = min(
        now + datetime.timedelta(days=days), issuer.not_valid_after_utc
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(LEAF_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer_key.public_key()
            ),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def issued_by(cert: x509.Certificate, root: x509.Certificate) -> bool:
    """
    Whether C{root} issued C{cert} (issuer name and signature).
    """
    if cert.issuer != root.subject:
        return False
    try:
        cert.verify_directly_issued_by(root)
    except Exception:
        return False
    return True


def common_name_of(cert: x509.Certificate) -> str | None:
    """The certificate's one common name, or C{None} when it has none or several."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        return None
    value = cns[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")
