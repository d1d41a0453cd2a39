"""
Certificates a node asks for rather than receives: the hash that names a CA
in a join token (L{spki_hash}), the key and request a node makes for itself
(L{new_request}), the checks a request passes before anything signs it
(L{check_request}), and the node certificate signed from it (L{sign_request}).

A request may ask for one thing only: a client certificate whose common name
is the node id. Whatever else it carries (subject alternative names, other
attributes, extensions) is refused rather than dropped, so that an operator
approving it sees what the node asked for.
"""

from __future__ import annotations

import datetime
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tlsconf.certs import BACKDATE, LEAF_KEY_USAGE, now_utc, random_serial
from llmgw.wire import InvalidNodeId, validate_node_id

#: The largest request accepted, in bytes of PEM: a P-256 request is about
#: 450, an RSA-4096 one about 1,700.
MAX_REQUEST_PEM = 8192
#: The smallest RSA key accepted, in bits.
MIN_RSA_BITS = 2048
#: Curves whose keys are accepted.
CURVES = (ec.SECP256R1, ec.SECP384R1)
#: The node certificates' default lifetime.
DEFAULT_NODE_LIFETIME = datetime.timedelta(days=30)


class RequestRefused(ValueError):
    """
    A certificate request was refused; the message says why, for the node's
    operator.
    """


def spki_hash(cert: x509.Certificate) -> str:
    """
    C{sha256:HEX} of C{cert}'s SubjectPublicKeyInfo (DER): what a join token
    names its CA by, as kubeadm's discovery-token-ca-cert-hash does. It stays
    the same for a root re-issued with the same key.
    """
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


def new_request(node_id: str) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    """
    A new P-256 key and the PEM request for a node certificate named
    C{node_id}, signed with it.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM)


def public_key_hash(csr_or_cert: x509.CertificateSigningRequest | x509.Certificate) -> str:
    """The sha256 of the public key a request or certificate carries (DER SPKI)."""
    der = csr_or_cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def key_description(csr: x509.CertificateSigningRequest) -> str:
    """The request's key, for an operator: C{ECDSA secp256r1}, C{RSA 2048}, ..."""
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        return f"ECDSA {key.curve.name}"
    if isinstance(key, rsa.RSAPublicKey):
        return f"RSA {key.key_size}"
    return type(key).__name__


def check_request(pem: bytes, node_id: str) -> x509.CertificateSigningRequest:
    """
    The request in C{pem} if it asks for a client certificate for
    C{node_id} and nothing more, with a strong key, and is signed by it.

    @raise RequestRefused: it is too large, unparseable, badly signed, for
        another name, asks for more, or its key is weak.
    """
    if len(pem) > MAX_REQUEST_PEM:
        raise RequestRefused(f"the certificate request is {len(pem)} bytes, over {MAX_REQUEST_PEM}")
    try:
        validate_node_id(node_id)
    except InvalidNodeId as e:
        raise RequestRefused(str(e)) from e
    try:
        csr = x509.load_pem_x509_csr(pem)
    except ValueError as e:
        raise RequestRefused(f"the certificate request is not a PEM PKCS#10 request: {e}") from e
    if not csr.is_signature_valid:
        raise RequestRefused("the certificate request's signature does not verify with its own key")
    attrs = list(csr.subject)
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(attrs) != 1 or len(cns) != 1:
        raise RequestRefused(
            f"the certificate request's subject is {csr.subject.rfc4514_string()!r}: it must be "
            f"exactly CN={node_id}"
        )
    if cns[0].value != node_id:
        raise RequestRefused(
            f"the certificate request is for {cns[0].value!r}, not for node {node_id!r}"
        )
    extensions = [e.oid.dotted_string for e in csr.extensions]
    if extensions:
        raise RequestRefused(
            "the certificate request asks for extensions (" + ", ".join(extensions) + "): a node "
            "may ask only for a client certificate for its name, which carries none of its choosing"
        )
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, CURVES):
            raise RequestRefused(f"the request's key is on curve {key.curve.name}: use P-256 or P-384")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise RequestRefused(
                f"the request's RSA key has {key.key_size} bits, under the {MIN_RSA_BITS} required"
            )
    else:
        raise RequestRefused(f"the request's key is a {type(key).__name__}: use ECDSA P-256 or RSA")
    return csr


def sign_request(
    csr: x509.CertificateSigningRequest, node_id: str, issuer_key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate, lifetime: datetime.timedelta = DEFAULT_NODE_LIFETIME,
    now: datetime.datetime | None = None,
) -> x509.Certificate:
    """
    The node certificate for a request L{check_request} accepted: common
    name C{node_id}, clientAuth only, valid for C{lifetime} but never past
    C{issuer}'s end. Nothing of the request but its key is copied.
    """
    now = now if now is not None else now_utc()
    not_after = min(now + lifetime, issuer.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(issuer.subject)
        .public_key(csr.public_key())
        .serial_number(random_serial())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(LEAF_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
        .sign(issuer_key, hashes.SHA256())
    )


def check_issued(cert_pem: bytes, csr: x509.CertificateSigningRequest, node_id: str,
                 roots: list[x509.Certificate]) -> x509.Certificate:
    """
    The certificate in C{cert_pem} if it is what C{csr} asked for: the
    request's key, CN C{node_id}, clientAuth, from one of C{roots}. (An
    operator's approval comes back through the admin API: it is checked, not
    trusted.)

    @raise RequestRefused: it is not.
    """
    from llmgw.tlsconf.certs import common_name_of, issued_by

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise RequestRefused(f"not a PEM certificate: {e}") from e
    if public_key_hash(cert) != public_key_hash(csr):
        raise RequestRefused("the certificate is not for the request's key")
    if common_name_of(cert) != node_id:
        raise RequestRefused(f"the certificate is for {common_name_of(cert)!r}, not {node_id!r}")
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = None
    if usages is None or list(usages) != [ExtendedKeyUsageOID.CLIENT_AUTH]:
        raise RequestRefused("the certificate must carry the clientAuth usage and nothing else")
    if not any(issued_by(cert, root) for root in roots):
        raise RequestRefused("the certificate was not issued by a root this control plane trusts")
    return cert
