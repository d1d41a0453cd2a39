"""
Certificates for tests, made at run time by llmgw's own CA code.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.tlsconf.ca import CertificateAuthority, Issued


def make_certs(
    directory: Path | str,
    server_hosts: Iterable[str] = ("127.0.0.1",),
    nodes: Iterable[str] = ("node-1",),
) -> CertificateAuthority:
    """
    A CA in C{directory} with C{server.pem/.key} naming C{server_hosts} and
    C{agent-NODE.pem/.key} for each of C{nodes}.
    """
    ca = CertificateAuthority.init(Path(directory))
    ca.issue_server(list(server_hosts))
    for node in nodes:
        ca.issue_agent(node)
    return ca


def issue_server_without_sans(ca: CertificateAuthority, common_name: str) -> Issued:
    """
    Overwrite C{server.pem/.key} with a server certificate that has no
    subject alternative name extension at all, only C{common_name}: the
    mistake agents must refuse.
    """
    key, cert = ca._leaf(common_name, 30, [], ExtendedKeyUsageOID.SERVER_AUTH)
    return ca._write_leaf("server", key, cert, "server")
