"""
Join tokens: what lets a node that has no certificate yet ask for one.

A token is printed once, as one string (L{llmgw.tlsconf.jointoken}):
C{llmgw1.ID.SECRET.CAHASH}, where C{CAHASH} is the hex sha256 of the CA
root's SubjectPublicKeyInfo, which the node checks the control plane
against before it sends anything. The book keeps only a hash of the
secret, with the token's end, its uses left, the node-name prefix it
allows and whether it was revoked; so the file it is kept in lets nobody
join.

Decisions here take the time as an argument and touch no file; L{TokenFile}
keeps the book in a JSON file, rewritten whole and atomically at each change.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from twisted.logger import Logger

from llmgw.control.core.kept import write_atomically
from llmgw.tlsconf.jointoken import ID_PATTERN

#: Tokens a book holds at most (live and recently ended): bounds the file and
#: every listing.
MAX_TOKENS = 1000
#: How long an ended token (expired, used up, revoked) stays listed.
KEEP_ENDED = 86400.0
#: The most uses one token may grant.
MAX_USES = 100_000


class TokenRefused(Exception):
    """
    A join was refused for its token; the message says why (and never
    whether the id exists for a wrong secret: both read the same).
    """


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class JoinToken:
    """One token as the book keeps it: never its secret."""

    id: str
    secret_hash: str
    created: float
    expires: float
    uses: int
    used: int = 0
    node_prefix: str = ""
    revoked: bool = False
    #: Node ids that joined with it, newest last (bounded).
    nodes: tuple[str, ...] = field(default_factory=tuple)

    def state(self, now: float) -> str:
        """C{"revoked"}, C{"expired"}, C{"used up"} or C{"valid"}."""
        if self.revoked:
            return "revoked"
        if now >= self.expires:
            return "expired"
        if self.used >= self.uses:
            return "used up"
        return "valid"

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id, "created": self.created, "expires": self.expires,
            "uses": self.uses, "used": self.used, "node_prefix": self.node_prefix,
            "state": self.state(now), "nodes": list(self.nodes),
        }


class TokenBook:
    """
    Every join token, by id. Not thread-safe; the reactor's.
    """

    def __init__(self) -> None:
        self.tokens: dict[str, JoinToken] = {}

    def create(self, now: float, ttl: float, uses: int = 1, node_prefix: str = "") -> tuple[JoinToken, str]:
        """
        A new token and its secret (which the book does not keep).

        @raise ValueError: C{ttl} or C{uses} out of range, or the book is full.
        """
        if not 0 < ttl <= 365 * 86400:
            raise ValueError(f"a token's ttl must be between 1 second and 365 days, not {ttl:g}s")
        if not 0 < uses <= MAX_USES:
            raise ValueError(f"a token's uses must be between 1 and {MAX_USES}, not {uses}")
        if node_prefix and not re.match(r"^[a-z0-9][a-z0-9.-]{0,61}$", node_prefix):
            raise ValueError(f"node prefix {node_prefix[:80]!r} is not the start of a node id")
        self.prune(now)
        if len(self.tokens) >= MAX_TOKENS:
            raise ValueError(f"{MAX_TOKENS} tokens exist: revoke some (`llmgw ctl token revoke ID`)")
        tid = secrets.token_hex(4)
        while tid in self.tokens:
            tid = secrets.token_hex(4)
        secret = secrets.token_hex(16)
        token = JoinToken(tid, _hash_secret(secret), now, now + ttl, uses, 0, node_prefix)
        self.tokens[tid] = token
        return token, secret

    def check(self, token_id: str, secret: str, node_id: str, now: float) -> JoinToken:
        """
        The token if C{secret} opens it and it may admit C{node_id} now.

        @raise TokenRefused: unknown id or wrong secret (said alike), revoked,
            expired, used up, or C{node_id} outside its prefix.
        """
        token = self.tokens.get(token_id)
        if token is None or not hmac.compare_digest(token.secret_hash, _hash_secret(secret)):
            raise TokenRefused(f"join token {token_id[:16]!r} is unknown or its secret is wrong")
        state = token.state(now)
        if state != "valid":
            raise TokenRefused(f"join token {token_id} is {state}")
        if not node_id.startswith(token.node_prefix):
            raise TokenRefused(
                f"join token {token_id} admits only node names starting with {token.node_prefix!r}, "
                f"not {node_id!r}"
            )
        return token

    def use(self, token_id: str, node_id: str) -> JoinToken:
        """Count one use of a token L{check} accepted, for C{node_id}."""
        token = self.tokens[token_id]
        token = replace(token, used=token.used + 1, nodes=(*token.nodes, node_id)[-100:])
        self.tokens[token_id] = token
        return token

    def revoke(self, token_id: str) -> JoinToken:
        """
        @raise KeyError: no such token.
        """
        token = replace(self.tokens[token_id], revoked=True)
        self.tokens[token_id] = token
        return token

    def prune(self, now: float) -> None:
        """Forget tokens ended more than L{KEEP_ENDED} ago (or used up and expired)."""
        for tid, t in list(self.tokens.items()):
            if t.state(now) != "valid" and now - t.expires > KEEP_ENDED:
                del self.tokens[tid]

    def listing(self, now: float) -> list[dict[str, Any]]:
        return [t.describe(now) for t in sorted(self.tokens.values(), key=lambda t: t.created)]

    def to_data(self) -> dict[str, Any]:
        return {"tokens": [token_to_data(t) for t in self.tokens.values()]}

    def take_data(self, data: Any) -> None:
        """
        @raise ValueError, KeyError, TypeError: the data is not a book's.
        """
        tokens = {}
        for raw in data["tokens"]:
            t = token_from_data(raw)
            tokens[t.id] = t
        self.tokens = tokens


def token_to_data(token: JoinToken) -> dict[str, Any]:
    """One token as JSON data (what L{token_from_data} reads)."""
    # Not asdict: its deep copy of the nodes (thousands on a fleet's token)
    # is paid at every rewrite of the book, on the reactor.
    return dict({f.name: getattr(token, f.name) for f in fields(token)}, nodes=list(token.nodes))


def token_from_data(raw: Any) -> JoinToken:
    """
    @raise ValueError, KeyError, TypeError: C{raw} is not a token's data.
    """
    t = JoinToken(
        id=str(raw["id"]), secret_hash=str(raw["secret_hash"]), created=float(raw["created"]),
        expires=float(raw["expires"]), uses=int(raw["uses"]), used=int(raw["used"]),
        node_prefix=str(raw.get("node_prefix", "")), revoked=bool(raw.get("revoked", False)),
        nodes=tuple(str(n) for n in raw.get("nodes", [])),
    )
    if not ID_PATTERN.match(t.id):
        raise ValueError(f"token id {t.id!r}")
    return t


class TokenFile:
    """
    A L{TokenBook} kept in a JSON file (mode 0600: the secrets' hashes are no
    secret, but what joined is the operator's business), loaded at start and
    rewritten at every change. A damaged file is moved aside, never fatal.
    """

    log = Logger()

    def __init__(self, path: Path | None):
        self.path = path
        self.book = TokenBook()
        self._seen = 0

    def refresh(self) -> None:
        """Read the file again if something else (`llmgw ctl token`) changed it since."""
        if self.path is not None and self.path.exists() and self.path.stat().st_mtime_ns != self._seen:
            self.load()

    def load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        self._seen = self.path.stat().st_mtime_ns
        try:
            self.book.take_data(json.loads(self.path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            aside = self.path.with_name(self.path.name + ".unreadable")
            self.log.error("join tokens in {path} are unreadable ({error}); moved to {aside}, "
                           "no token is valid", path=str(self.path), error=str(e), aside=str(aside))
            self.path.replace(aside)
            self.book = TokenBook()

    def save(self) -> None:
        self.write(self.text())

    def text(self) -> str:
        """The book as L{write} keeps it (read it on the reactor: the book is the reactor's)."""
        return json.dumps(self.book.to_data(), sort_keys=True)

    def write(self, text: str) -> None:
        """Keep C{text} (from L{text}) as the file, atomically; safe in a thread."""
        if self.path is None:
            return
        write_atomically(self.path, text, mode=0o600)
        self._seen = self.path.stat().st_mtime_ns
