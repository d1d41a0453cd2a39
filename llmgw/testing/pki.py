"""
Certificates for tests, made at run time by llmgw's own CA code.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tlsconf.ca import CertificateAuthority, cert_pem, key_pem, random_serial, write_private


def make_pki(
    directory: str | Path, nodes: tuple[str, ...] = ("node-a", "node-b"),
    server_hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
) -> CertificateAuthority:
    """
    A CA in C{directory} with a server certificate for C{server_hosts} and
    an agent certificate per node.
    """
    ca = CertificateAuthority.init(directory)
    ca.issue_server(server_hosts)
    for node in nodes:
        ca.issue_agent(node)
    return ca


def issue_raw(
    ca: CertificateAuthority,
    stem: str,
    common_name: str,
    usage: x509.ObjectIdentifier | None = ExtendedKeyUsageOID.CLIENT_AUTH,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[Path, Path]:
    """
    Issue a certificate the CLI would never issue (expired, no usage, odd
    names), for tests of what the verifiers refuse. Returns the cert and key
    paths.
    """
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    cert_path = ca.directory / f"{stem}.pem"
    key_path = ca.directory / f"{stem}.key"
    cert_path.write_bytes(cert_pem(cert))
    write_private(key_path, key_pem(key))
    return cert_path, key_path
