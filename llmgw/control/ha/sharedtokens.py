"""
Join tokens of an HA control plane, kept in etcd (DESIGN §17, §20), one key
a token: C{PREFIX/join-tokens/ID}, whose value is the token's JSON as the
standalone book keeps it (L{llmgw.control.core.jointokens.token_to_data}:
the secret's hash, never the secret). Every member reads the same tokens,
and they outlive any member.

A use is spent by a transaction that compares the key's mod revision with
the one just read: of two members spending the last use at once, one
writes and the other reads the token again, finds it used up and refuses.
A join is refused when etcd cannot be reached: no certificate is issued
for a use that was not counted. (A write whose answer was lost may have
counted a use that issued nothing: the count errs on the safe side.)

The same class serves C{llmgw ctl token} (over a synchronous client whose
Deferreds have fired when returned, L{llmgw.ctl.etcdkv}) and the control
plane (over L{llmgw.etcd.EtcdClient}), so both read and write alike.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from twisted.internet import defer

from llmgw.control.core.jointokens import (
    KEEP_ENDED,
    MAX_TOKENS,
    JoinToken,
    TokenBook,
    TokenRefused,
    token_from_data,
    token_to_data,
)
from llmgw.etcd import Compare, Delete, EtcdError, Put, prefix_end
from llmgw.tlsconf.jointoken import ID_PATTERN

#: How often a spend or a revoke reads the token again after losing a race
#: to another member's write, before it gives up.
MAX_TRIES = 8


def tokens_prefix(prefix: str) -> bytes:
    """Where an HA control plane's join tokens live in etcd."""
    return (prefix.rstrip("/") + "/join-tokens/").encode()


class TokenStoreUnavailable(TokenRefused):
    """
    The tokens in etcd could not be read or written: the join is refused
    (and counted nowhere); the message says why and that a retry may pass.
    """


class SharedTokens:
    """
    The join tokens under C{prefix} in etcd (C{store}: an etcd client or
    L{llmgw.testing.fakeetcd.FakeEtcd}). Every method returns a Deferred.
    """

    def __init__(self, store: Any, prefix: str):
        self.store = store
        self.prefix = tokens_prefix(prefix)
        #: Uses spent here, and spends retried after losing a race (status, tests).
        self.spent = self.raced = 0

    def key(self, token_id: str) -> bytes:
        return self.prefix + token_id.encode("ascii")

    def _unavailable(self, e: EtcdError, doing: str) -> TokenStoreUnavailable:
        return TokenStoreUnavailable(
            f"join tokens live in etcd, which cannot be reached to {doing} ({e}): the join is refused; "
            "try again")

    async def _read(self, token_id: str) -> tuple[JoinToken, int] | None:
        """The token and its mod revision, or None for an unknown id."""
        if not ID_PATTERN.match(token_id):
            return None
        kv = await self.store.get(self.key(token_id))
        if kv is None:
            return None
        try:
            return token_from_data(json.loads(kv.value)), kv.mod_revision
        except (ValueError, KeyError, TypeError) as e:
            raise TokenRefused(f"join token {token_id} in etcd is unreadable ({e}); it admits nobody") from None

    @staticmethod
    def _checked(token: JoinToken | None, token_id: str, secret: str, node_id: str, now: float) -> TokenBook:
        book = TokenBook()
        if token is not None:
            book.tokens[token.id] = token
        book.check(token_id, secret, node_id, now)
        return book

    def check(self, token_id: str, secret: str, node_id: str, now: float) -> defer.Deferred[JoinToken]:
        """
        The token, if C{secret} opens it and it may admit C{node_id} now;
        nothing is spent.

        @raise TokenRefused: as L{TokenBook.check}; L{TokenStoreUnavailable}
            when etcd cannot be asked.
        """
        async def run() -> JoinToken:
            try:
                found = await self._read(token_id)
            except EtcdError as e:
                raise self._unavailable(e, "read the token") from None
            self._checked(found[0] if found else None, token_id, secret, node_id, now)
            assert found is not None
            return found[0]

        return defer.ensureDeferred(run())

    def spend(self, token_id: str, secret: str, node_id: str, now: float) -> defer.Deferred[JoinToken]:
        """
        Spend one use of the token for C{node_id}, atomically: the token as
        written. Checked again as L{check} does at each read.

        @raise TokenRefused: as L{check}, or the token's key kept changing.
        """
        async def run() -> JoinToken:
            try:
                for _ in range(MAX_TRIES):
                    found = await self._read(token_id)
                    book = self._checked(found[0] if found else None, token_id, secret, node_id, now)
                    assert found is not None
                    used = book.use(token_id, node_id)
                    key = self.key(token_id)
                    result = await self.store.txn(
                        [Compare.mod_revision(key, found[1])], [Put(key, _encode(used))])
                    if result.succeeded:
                        self.spent += 1
                        return used
                    self.raced += 1
            except EtcdError as e:
                raise self._unavailable(e, "spend a use of the token") from None
            raise TokenStoreUnavailable(
                f"join token {token_id} changed {MAX_TRIES} times while a use was spent: the join is "
                "refused; try again")

        return defer.ensureDeferred(run())

    def listing(self, now: float) -> defer.Deferred[list[dict[str, Any]]]:
        """Every token (L{JoinToken.describe}), oldest first; unreadable ones left out."""
        async def run() -> list[dict[str, Any]]:
            return [t.describe(now) for t, _ in await self._all()]

        return defer.ensureDeferred(run())

    async def _all(self) -> list[tuple[JoinToken, int]]:
        kvs, _ = await self.store.range(self.prefix, prefix_end(self.prefix))
        found = []
        for kv in kvs:
            try:
                found.append((token_from_data(json.loads(kv.value)), kv.mod_revision))
            except (ValueError, KeyError, TypeError):
                continue
        return sorted(found, key=lambda f: f[0].created)

    def create(self, now: float, ttl: float, uses: int = 1,
               node_prefix: str = "") -> defer.Deferred[tuple[JoinToken, str]]:
        """
        A new token and its secret (which etcd does not keep). Tokens ended
        more than L{KEEP_ENDED} ago are deleted first.

        @raise ValueError: as L{TokenBook.create}.
        """
        async def run() -> tuple[JoinToken, str]:
            book = TokenBook()
            known = await self._all()
            for t, revision in known:
                if t.state(now) != "valid" and now - t.expires > KEEP_ENDED:
                    # Only if nobody changed it since: a revision compare.
                    await self.store.txn([Compare.mod_revision(self.key(t.id), revision)],
                                         [Delete(self.key(t.id))])
                else:
                    book.tokens[t.id] = t
            if len(book.tokens) >= MAX_TOKENS:
                raise ValueError(f"{MAX_TOKENS} tokens exist: revoke some (`llmgw ctl token revoke ID`)")
            for _ in range(MAX_TRIES):
                token, secret = book.create(now, ttl, uses, node_prefix)
                key = self.key(token.id)
                result = await self.store.txn([Compare.absent(key)], [Put(key, _encode(token))])
                if result.succeeded:
                    return token, secret
                del book.tokens[token.id]
            raise ValueError("could not find a free token id; try again")

        return defer.ensureDeferred(run())

    def revoke(self, token_id: str) -> defer.Deferred[JoinToken]:
        """
        @raise KeyError: no such token.
        @raise ValueError: it kept changing under other writers.
        """
        async def run() -> JoinToken:
            for _ in range(MAX_TRIES):
                found = await self._read(token_id)
                if found is None:
                    raise KeyError(token_id)
                revoked = replace(found[0], revoked=True)
                key = self.key(token_id)
                result = await self.store.txn([Compare.mod_revision(key, found[1])], [Put(key, _encode(revoked))])
                if result.succeeded:
                    return revoked
            raise ValueError(f"join token {token_id} changed {MAX_TRIES} times while it was revoked; try again")

        return defer.ensureDeferred(run())


def _encode(token: JoinToken) -> bytes:
    return json.dumps(token_to_data(token), sort_keys=True).encode()

