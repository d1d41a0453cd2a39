"""
Keys and certificates as PEM files: read with errors an operator can act on
(L{CAError}), written atomically (through a temporary file and a rename, so
a reader never sees half a key), keys with mode 0600.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


class CAError(Exception):
    """
    A CA operation was refused; the message says why, for an operator.
    """


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


def load_bundle(path: Path) -> list[x509.Certificate]:
    """
    Every certificate in the PEM file C{path}, in order.

    @raise CAError: the file is unreadable or holds no certificate.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CAError(f"cannot read {path}: {e.strerror}") from e
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise CAError(f"{path} is not a PEM certificate bundle: {e}") from e
    if not certs:
        raise CAError(f"{path} holds no certificate")
    return certs


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """
    The unencrypted ECDSA private key in the PEM file C{path}.

    @raise CAError: the file is unreadable, encrypted, or not an ECDSA key.
    """
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as e:
        raise CAError(f"cannot read {path}: {e.strerror}") from e
    except (ValueError, TypeError) as e:
        raise CAError(f"{path} is not an unencrypted PEM private key: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CAError(f"{path} is not an ECDSA key")
    return key

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
