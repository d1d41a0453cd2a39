"""
What an llmgw certificate says its holder is, beyond its name: an admin
client's role, an extended key usage under llmgw's own object identifier
arc (L{ADMIN_ROLE_OIDS}), inside the signed certificate so only the CA can
set it; and the common-name prefix that marks a certificate for etcd's own
TLS (L{ETCD_CN_PREFIX}).
"""

from __future__ import annotations

from cryptography import x509

from llmgw.tlsconf.pem import CAError
from llmgw.wire import InvalidNodeId, validate_node_id

#: llmgw's object identifier arc: a UUID-derived OID (ITU-T X.667, the
#: 2.25 arc), which needs no registration and collides with nobody's.
LLMGW_OID_ARC = "2.25.207025164388289127420234717139102062531"
#: The extended key usage that makes a client certificate an admin
#: certificate with that role.
ADMIN_ROLE_OIDS: dict[str, x509.ObjectIdentifier] = {
    "viewer": x509.ObjectIdentifier(LLMGW_OID_ARC + ".1.1"),
    "operator": x509.ObjectIdentifier(LLMGW_OID_ARC + ".1.2"),
    "gateway": x509.ObjectIdentifier(LLMGW_OID_ARC + ".1.3"),
}
ADMIN_ROLES = tuple(ADMIN_ROLE_OIDS)
ROLE_BY_OID = {oid: role for role, oid in ADMIN_ROLE_OIDS.items()}
#: What the common name of a certificate for etcd's own TLS starts with: the
#: control plane takes it neither as a node's nor as an admin's. (Not an
#: extended key usage of llmgw's own: etcd refuses a certificate with one.)
ETCD_CN_PREFIX = "etcd:"


def admin_name(name: str) -> str:
    """
    C{name} if it is a valid admin name (the same rules as node ids: it
    goes into file names and log lines).

    @raise CAError: it is not.
    """
    try:
        return validate_node_id(name)
    except InvalidNodeId as e:
        raise CAError(f"admin name: {e}") from e
