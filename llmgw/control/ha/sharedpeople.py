"""
The people of an HA control plane, kept in etcd (DESIGN §17, §21): users
and their browser sessions, so that every member lets in the same users and
a session opened on one member holds on another after a failover.

- B{Users}: one key a user, C{PREFIX/users/NAME}, whose value is the user's
  JSON as C{users.json} keeps it (scrypt hash, salt, parameters, role).
  L{UserStore} adds, changes and removes them (C{llmgw ctl user --etcd});
  each member keeps a copy (L{SharedUsers}, a L{PrefixMirror}) that logins
  and session checks read synchronously.
- B{Sessions}: one key a session, C{PREFIX/sessions/SHA256(ID)} (the
  cookie's hash, so that reading etcd gives nobody a cookie), with the user,
  the role, the stamp of the user's password (never the hash itself), the
  CSRF token and when it was opened, attached to a lease of the idle
  limit: whichever member a session is used on keeps its lease alive (at
  most once a tenth of the limit), so etcd deletes it, on every member,
  once nobody used it for that long; its lifetime is counted from when it
  was opened. A login answers once the session is written
  (L{SharedSessions.opening}); a logout revokes its lease. Every member
  keeps a copy, so a member finds a session opened on another with no etcd
  read per request. Why kept rather than signed with a key in etcd: a
  logout, a removed user and a changed password end a session on every
  member at once, which a signed cookie alone could not.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.admin.base import Refused
from llmgw.control.admin.sessions import Session, SessionBook
from llmgw.control.core.users import MAX_USERS, User, UserBook, UserError, UserFile, check_name
from llmgw.control.ha.prefixmirror import PrefixMirror
from llmgw.etcd import Compare, EtcdError, Put, prefix_end


def users_prefix(prefix: str) -> bytes:
    """Where an HA control plane's users live in etcd."""
    return (prefix.rstrip("/") + "/users/").encode()


def sessions_prefix(prefix: str) -> bytes:
    """Where an HA control plane's browser sessions live in etcd."""
    return (prefix.rstrip("/") + "/sessions/").encode()


def _user_value(user: User) -> bytes:
    return json.dumps(user.to_data(), sort_keys=True).encode()


class UserStore:
    """
    The users under C{prefix} in etcd, changed with a compare on each key
    (C{store}: an etcd client, L{llmgw.ctl.etcdkv.SyncKV} or a fake). Every
    method returns a Deferred.
    """

    def __init__(self, store: Any, prefix: str):
        self.store = store
        self.prefix = users_prefix(prefix)

    def key(self, name: str) -> bytes:
        return self.prefix + check_name(name).encode("ascii")

    async def _all(self) -> list[User]:
        kvs, _ = await self.store.range(self.prefix, prefix_end(self.prefix))
        return [u for u in (_decode_user(kv.value) for kv in kvs) if u is not None]

    def listing(self) -> defer.Deferred[list[dict[str, str]]]:
        """Every user's name and role, by name."""
        async def run() -> list[dict[str, str]]:
            book = UserBook()
            book.users = {u.name: u for u in await self._all()}
            return book.listing()

        return defer.ensureDeferred(run())

    def get(self, name: str) -> defer.Deferred[User | None]:
        async def run() -> User | None:
            kv = await self.store.get(self.key(name))
            return _decode_user(kv.value) if kv is not None else None

        return defer.ensureDeferred(run())

    def add(self, user: User) -> defer.Deferred[None]:
        """
        @raise UserError: the name is taken, or L{MAX_USERS} exist.
        """
        async def run() -> None:
            if len(await self._all()) >= MAX_USERS:
                raise UserError(f"there are {MAX_USERS} users already, the most kept")
            key = self.key(user.name)
            result = await self.store.txn([Compare.absent(key)], [Put(key, _user_value(user))])
            if not result.succeeded:
                raise UserError(f"user {user.name!r} exists (`llmgw ctl user passwd` changes a password)")

        return defer.ensureDeferred(run())

    def replace(self, user: User) -> defer.Deferred[None]:
        """
        A new hash (or role) for an existing user: their sessions end.

        @raise KeyError: no such user.
        """
        async def run() -> None:
            key = self.key(user.name)
            result = await self.store.txn([Compare(key, "CREATE", "GREATER", 0)], [Put(key, _user_value(user))])
            if not result.succeeded:
                raise KeyError(user.name)

        return defer.ensureDeferred(run())

    def remove(self, name: str) -> defer.Deferred[None]:
        """
        @raise KeyError: no such user.
        """
        async def run() -> None:
            if not await self.store.delete(self.key(name)):
                raise KeyError(name)

        return defer.ensureDeferred(run())


class SharedUsers(UserFile):
    """
    A member's copy of the users in etcd, in place of C{users.json}: its
    L{book} follows etcd (L{mirror}); L{refresh}, L{load} and L{save} do
    nothing (changes go through L{UserStore}).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, retry_interval: float = 1.0):
        super().__init__(None)
        self.mirror = PrefixMirror(clock, store, users_prefix(prefix), "users", retry_interval)
        self.mirror.changed = self._changed
        self._skipped: set[bytes] = set()

    def load(self) -> None:
        pass

    def save(self) -> None:
        pass

    def _changed(self) -> None:
        book = UserBook()
        for key, value in self.mirror.values.items():
            user = _decode_user(value)
            if user is None or key != self.mirror.prefix + user.name.encode():
                if key not in self._skipped:
                    self.log.warn("user {key} in etcd is unreadable: skipped, it may not log in",
                                  key=key.decode("utf-8", "replace"))
                    self._skipped.add(key)
                continue
            book.users[user.name] = user
        self.book = book


def _decode_user(value: bytes) -> User | None:
    try:
        data = json.loads(value)
        return User.from_data(data) if isinstance(data, dict) else None
    except (ValueError, UserError):
        return None


def session_key(prefix: bytes, sid: str) -> bytes:
    return prefix + hashlib.sha256(sid.encode("latin-1")).hexdigest().encode("ascii")


class SharedSessions(SessionBook):
    """
    The browser sessions of every member, kept in etcd (see the module
    docstring); a member's copy is followed by L{mirror}.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, retry_interval: float = 1.0, **kw: Any):
        super().__init__(clock, **kw)
        self.store = store
        self.mirror = PrefixMirror(clock, store, sessions_prefix(prefix), "sessions", retry_interval)
        self.mirror.changed = self._changed
        #: Every session in the copy, by key: the cookie is not known until
        #: a request brings it, so their ids are "" until then.
        self.records: dict[bytes, Session] = {}
        #: The leases of the sessions opened here (the copy has the rest's).
        self.leases: dict[bytes, int] = {}
        #: When this member last kept each session's lease alive.
        self.kept: dict[bytes, float] = {}
        self._unseen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.records)

    def _changed(self) -> None:
        records: dict[bytes, Session] = {}
        now = self.clock.seconds()
        for key, value in self.mirror.values.items():
            old = self.records.get(key)
            if old is not None:
                records[key] = old
                continue
            try:
                data = json.loads(value)
                records[key] = Session("", str(data["user"]), str(data["role"]),
                                       base64.b64decode(data["stamp"], validate=True), str(data["csrf"]),
                                       float(data["opened"]), now)
            except (ValueError, KeyError, TypeError, binascii.Error):
                self.log.warn("session {key} in etcd is unreadable: skipped", key=key.decode("ascii", "replace"))
        # Opened here and written, but not yet back through the watch: kept.
        self._unseen &= {k for k in self._unseen if k not in self.mirror.values}
        for key in self._unseen:
            if key in self.records:
                records[key] = self.records[key]
        self.records = records
        for gone in [k for k in self.kept if k not in records]:
            del self.kept[gone]
            self.leases.pop(gone, None)

    def open(self, user: str, role: str, stamp: bytes) -> Session:
        raise NotImplementedError("sessions in etcd are opened with opening()")

    def opening(self, user: str, role: str, stamp: bytes) -> defer.Deferred[Session]:
        """
        A new session, written to etcd under a lease of the idle limit
        before it is answered; the oldest sessions are ended past the bound.

        @raise Refused: 503, etcd cannot be reached (nobody is let in on a
            session the other members would not know).
        """
        async def run() -> Session:
            oldest = sorted(self.records.items(), key=lambda kv: kv[1].opened)
            for key, _ in oldest[: max(0, len(oldest) - self.max_sessions + 1)]:
                self._end(key)
            now = self.clock.seconds()
            session = Session(secrets.token_urlsafe(32), user, role, stamp, secrets.token_urlsafe(32), now, now)
            key = session_key(self.mirror.prefix, session.id)
            value = json.dumps({"user": user, "role": role, "stamp": base64.b64encode(stamp).decode("ascii"),
                                "csrf": session.csrf, "opened": now}).encode()
            try:
                lease, _ = await self.store.grant(max(1, int(self.idle)))
                await self.store.put(key, value, lease=lease)
            except EtcdError as e:
                self.log.error("a session for user {user!r} could not be kept in etcd: {error}",
                               user=user, error=str(e))
                raise Refused(503, "sessions are kept in etcd, which cannot be reached now; try again",
                              headers={b"retry-after": b"1"}) from None
            self.records[key] = session
            self.leases[key] = lease
            self.kept[key] = now
            if key not in self.mirror.values:
                self._unseen.add(key)
            return session

        return defer.ensureDeferred(run())

    def find(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        key = session_key(self.mirror.prefix, sid)
        session = self.records.get(key)
        if session is None:
            return None
        now = self.clock.seconds()
        if now - session.opened >= self.lifetime:
            self._end(key)
            return None
        session.id = sid
        session.used = now
        if now - self.kept.get(key, 0.0) >= self.idle / 10:
            # The idle limit is the lease's: used here, it is kept alive.
            self.kept[key] = now
            lease = self.leases.get(key) or self.mirror.leases.get(key, 0)
            if lease:
                d = defer.ensureDeferred(self.store.keepalive(lease))
                d.addErrback(lambda f: self.log.warn(
                    "a session's lease could not be kept alive in etcd: {error}", error=f.getErrorMessage()))
        return session

    def close(self, sid: str) -> None:
        self._end(session_key(self.mirror.prefix, sid))

    def _end(self, key: bytes) -> None:
        """Forget the session here at once, and in etcd behind (a failure logged)."""
        self.records.pop(key, None)
        self._unseen.discard(key)
        self.kept.pop(key, None)
        lease = self.leases.pop(key, None) or self.mirror.leases.get(key)
        d = defer.ensureDeferred(self.store.revoke(lease) if lease else self.store.delete(key))
        d.addErrback(lambda f: self.log.warn("a closed session stays in etcd until its lease ends: {error}",
                                             error=f.getErrorMessage()))


class SharedPeople:
    """
    What an HA member keeps in etcd for joins and logins: gives its join
    authority the tokens in etcd and its admin API's logins the users and
    sessions in etcd, and follows them while started.
    """

    def __init__(self, clock: IReactorTime, cp: Any, store: Any, prefix: str, retry_interval: float = 1.0,
                 fleet: Any = None, leading: Callable[[], bool] | None = None):
        """
        @param fleet: the member's fleet follower and C{leading}, whether it
            leads: with both, a join on a member that does not lead refuses a
            name the leader's published view lists connected
            (L{llmgw.control.ha.fleetnames}).
        """
        from llmgw.control.ha.fleetnames import FleetNames
        from llmgw.control.ha.sharedtokens import SharedTokens

        self.clock = clock
        self.cp = cp
        self.store = store
        self.prefix = prefix
        self.retry_interval = retry_interval
        self.tokens = SharedTokens(store, prefix)
        authority = getattr(cp, "joining", None)
        if authority is not None:
            authority.shared = self.tokens
            if fleet is not None and leading is not None:
                authority.held_elsewhere = FleetNames(clock, fleet, leading).holds
        self.users: SharedUsers | None = None
        self.sessions: SharedSessions | None = None

    log = Logger()

    def start(self) -> None:
        """Take over the admin API's logins (made by now) and follow etcd."""
        logins = getattr(getattr(self.cp, "admin_listener", None), "logins", None)
        authority = getattr(self.cp, "joining", None)
        for what, path, command in (
            ("join tokens", getattr(getattr(authority, "tokens", None), "path", None), "token"),
            ("users", getattr(getattr(logins, "users", None), "path", None), "user"),
        ):
            if path is not None and path.exists():
                # Made without --etcd: an operator would wonder why they fail.
                self.log.warn("{path} is not read by an HA member: its {what} live in etcd "
                              "(`llmgw ctl {command} ... --etcd URLS`)", path=str(path), what=what,
                              command=command)
        if logins is not None and self.users is None:
            self.users = SharedUsers(self.clock, self.store, self.prefix, self.retry_interval)
            self.sessions = SharedSessions(self.clock, self.store, self.prefix, self.retry_interval,
                                           lifetime=logins.sessions.lifetime, idle=logins.sessions.idle)
            logins.users, logins.sessions = self.users, self.sessions
        for part in (self.users, self.sessions):
            if part is not None:
                part.mirror.start()

    def status(self) -> dict[str, Any]:
        """For C{GET /api/v1/status}: uses spent here, races lost, the copies' state."""
        return {
            "token_uses_spent": self.tokens.spent, "token_spends_raced": self.tokens.raced,
            "users": len(self.users.book.users) if self.users is not None else None,
            "sessions": len(self.sessions) if self.sessions is not None else None,
            "etcd_error": next((p.mirror.last_error for p in (self.users, self.sessions)
                                if p is not None and p.mirror.last_error), ""),
        }

    def stop(self) -> None:
        for part in (self.users, self.sessions):
            if part is not None:
                part.mirror.stop()
