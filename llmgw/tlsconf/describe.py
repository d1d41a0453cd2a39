"""
Reading a certificate for an operator: its names, usages and validity, as
C{llmgw ctl cert show} prints them (L{describe}).
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.tlsconf.certs import issued_by, now_utc
from llmgw.tlsconf.pem import load_bundle, load_certificate
from llmgw.tlsconf.roles import ADMIN_ROLE_OIDS


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
        **{oid: f"llmgw-admin-{role}" for role, oid in ADMIN_ROLE_OIDS.items()},
    }
    return [names.get(oid, oid.dotted_string) for oid in ext.value]


def key_usages(cert: x509.Certificate) -> list[str]:
    """
    The certificate's key usage bits, by their RFC 5280 names.
    """
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return []
    out = []
    for attr, name in (
        ("digital_signature", "digitalSignature"), ("content_commitment", "nonRepudiation"),
        ("key_encipherment", "keyEncipherment"), ("data_encipherment", "dataEncipherment"),
        ("key_agreement", "keyAgreement"), ("key_cert_sign", "keyCertSign"),
        ("crl_sign", "cRLSign"),
    ):
        if getattr(ku, attr):
            out.append(name)
    return out


def describe(path: Path | str, ca_dir: Path | str | None = None) -> dict[str, object]:
    """
    What C{llmgw ctl cert show} prints: subject, SANs, usages, validity,
    serial, and whether the certificate chains to the CA in C{ca_dir}.

    @raise CAError: the file is not a certificate.
    """
    cert = load_certificate(path)
    now = now_utc()
    info: dict[str, object] = {
        "file": str(path),
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": format(cert.serial_number, "x"),
        "sans": subject_alt_names(cert),
        "usages": extended_key_usages(cert),
        "key_usages": key_usages(cert),
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
            roots = load_bundle(ca_file)
            issuer = next((r for r in roots if issued_by(cert, r)), None)
            info["chains_to_ca"] = issuer is not None
            info["ca"] = str(ca_file) + (
                f" root {issuer.subject.rfc4514_string()}" if issuer is not None and len(roots) > 1 else ""
            )
        else:
            info["chains_to_ca"] = None
            info["ca"] = f"{ca_file} (missing)"
    return info
