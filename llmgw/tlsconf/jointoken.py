"""
A join token's printed form, C{llmgw1.ID.SECRET.CAHASH}: what an operator
hands to a node and what the node takes apart before it dials. Pure; both
the control plane's token book and the joining agent use it, so neither
needs the other's code to read a token.

C{CAHASH} is the hex sha256 of the CA root's SubjectPublicKeyInfo
(L{llmgw.tlsconf.csr.spki_hash}), which the node checks the control plane's
chain against before it sends anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN_PREFIX = "llmgw1"
ID_PATTERN = re.compile(r"^[0-9a-f]{8}$")
SECRET_PATTERN = re.compile(r"^[0-9a-f]{32}$")
HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")


class MalformedToken(ValueError):
    """A token string that is not C{llmgw1.ID.SECRET.CAHASH}."""


@dataclass(frozen=True)
class ParsedToken:
    """A token string, taken apart."""

    id: str
    secret: str
    ca_hash: str  # "sha256:HEX"


def parse_token(text: str) -> ParsedToken:
    """
    The parts of a printed token.

    @raise MalformedToken: naming which part is wrong (never echoing the secret).
    """
    parts = text.strip().split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
        raise MalformedToken(f"a join token reads {TOKEN_PREFIX}.ID.SECRET.CAHASH (four parts)")
    _, tid, secret, ca = parts
    if not ID_PATTERN.match(tid):
        raise MalformedToken("the token's id is not 8 hex digits")
    if not SECRET_PATTERN.match(secret):
        raise MalformedToken("the token's secret is not 32 hex digits")
    if not HASH_PATTERN.match(ca):
        raise MalformedToken("the token's CA hash is not 64 hex digits (sha256)")
    return ParsedToken(tid, secret, "sha256:" + ca)


def printable(token_id: str, secret: str, ca_hash: str) -> str:
    """The one string an operator hands to a node (C{ca_hash} with or without C{sha256:})."""
    return f"{TOKEN_PREFIX}.{token_id}.{secret}.{ca_hash.removeprefix('sha256:')}"
