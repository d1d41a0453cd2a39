"""
People who log in to the admin API's page: each a name, a role and a
password kept only as a memory-hard hash (scrypt, from C{cryptography}),
with its own salt and the hash's parameters beside it, so that stronger
parameters later still verify the passwords hashed before.

L{UserBook} holds the users and hashes and verifies passwords; hashing and
verifying take tens of milliseconds and tens of MiB on purpose, so a server
calls them in a thread, never on the reactor. L{UserFile} keeps the book in
a JSON file (C{CERTS/users.json}, mode 0600), rewritten whole and atomically
at each change by C{llmgw ctl user}, and read again by the control plane
when it changes.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidKey
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from twisted.logger import Logger

from llmgw.control.core.kept import write_atomically
from llmgw.wire import InvalidNodeId, validate_node_id

#: The file in the certificates directory the users are kept in.
USERS_FILE = "users.json"
#: The roles a user may have: C{viewer} reads, C{operator} also changes
#: the fleet, C{admin} may do all an operator may.
USER_ROLES = ("viewer", "operator", "admin")
#: scrypt's cost (log2 of N), block size and parallelism for new hashes:
#: 32 MiB and about 0.1 s a hash.
SCRYPT_LOG_N = 15
SCRYPT_R = 8
SCRYPT_P = 1
#: The weakest parameters a stored hash may have (a file edited by hand to
#: cheaper ones is refused, not trusted), and the dearest (a hash that
#: would cost more than 1 GiB to check is refused, not computed).
MIN_LOG_N, MAX_LOG_N = 14, 20
MAX_R, MAX_P = 16, 4
SALT_BYTES = 16
HASH_BYTES = 32
#: Users a book holds at most.
MAX_USERS = 1000
#: Passwords shorter than this are refused when set; longer than the most
#: are refused when set and never hashed when tried.
MIN_PASSWORD, MAX_PASSWORD = 8, 1024


class UserError(ValueError):
    """
    A user or password that may not be kept; the message says why.
    """


@dataclass(frozen=True)
class User:
    """
    One user as the book keeps it: never the password.
    """

    name: str
    role: str
    log_n: int
    r: int
    p: int
    salt: bytes
    hash: bytes

    def to_data(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "kdf": "scrypt",
            "log_n": self.log_n, "r": self.r, "p": self.p,
            "salt": base64.b64encode(self.salt).decode("ascii"),
            "hash": base64.b64encode(self.hash).decode("ascii"),
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> User:
        """
        @raise UserError: C{data} is not a user this version keeps.
        """
        if data.get("kdf") != "scrypt":
            raise UserError(f"user {data.get('name')!r}: unknown password hash {data.get('kdf')!r}")
        try:
            user = cls(
                name=check_name(data["name"]), role=check_role(data["role"]),
                log_n=int(data["log_n"]), r=int(data["r"]), p=int(data["p"]),
                salt=base64.b64decode(data["salt"], validate=True),
                hash=base64.b64decode(data["hash"], validate=True),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"user {data.get('name')!r} is unreadable: {e}") from None
        if not (MIN_LOG_N <= user.log_n <= MAX_LOG_N and 1 <= user.r <= MAX_R and 1 <= user.p <= MAX_P):
            raise UserError(f"user {user.name!r}: scrypt parameters out of range "
                            f"(log_n {user.log_n}, r {user.r}, p {user.p})")
        if len(user.salt) < SALT_BYTES or len(user.hash) != HASH_BYTES:
            raise UserError(f"user {user.name!r}: salt or hash of the wrong length")
        return user


def check_name(name: Any) -> str:
    """
    C{name} if it may name a user (the rules of node ids: it goes into log
    lines), else L{UserError}.
    """
    if not isinstance(name, str):
        raise UserError("a user name is a string")
    try:
        return validate_node_id(name)
    except InvalidNodeId as e:
        raise UserError(f"user name: {e}") from None


def check_role(role: Any) -> str:
    if role not in USER_ROLES:
        raise UserError(f"a user's role is one of {', '.join(USER_ROLES)}, not {role!r}")
    result: str = role
    return result


def check_password(password: str) -> None:
    """
    @raise UserError: C{password} may not be set (too short or too long).
    """
    if len(password) < MIN_PASSWORD:
        raise UserError(f"a password has at least {MIN_PASSWORD} characters")
    if len(password) > MAX_PASSWORD:
        raise UserError(f"a password has at most {MAX_PASSWORD} characters")


def _kdf(log_n: int, r: int, p: int, salt: bytes) -> Scrypt:
    return Scrypt(salt=salt, length=HASH_BYTES, n=2**log_n, r=r, p=p)


def hash_password(name: str, role: str, password: str, log_n: int = SCRYPT_LOG_N,
                  r: int = SCRYPT_R, p: int = SCRYPT_P) -> User:
    """
    A new L{User} with C{password} hashed under a fresh random salt. Slow
    on purpose: call it off the reactor.

    @raise UserError: the name, role or password may not be kept.
    """
    check_name(name)
    check_role(role)
    check_password(password)
    salt = os.urandom(SALT_BYTES)
    return User(name, role, log_n, r, p, salt, _kdf(log_n, r, p, salt).derive(password.encode("utf-8")))


#: What an unknown user's password is checked against, so that a wrong
#: name costs the same time as a wrong password and tells nobody which.
_NOBODY = User("nobody", "viewer", SCRYPT_LOG_N, SCRYPT_R, SCRYPT_P, b"\0" * SALT_BYTES, b"\0" * HASH_BYTES)


def verify_password(user: User | None, password: str) -> bool:
    """
    Whether C{password} is C{user}'s; C{False} for no user, after as much
    work as for one. Slow on purpose: call it off the reactor.
    """
    target = user if user is not None else _NOBODY
    if len(password) > MAX_PASSWORD:
        return False
    try:
        _kdf(target.log_n, target.r, target.p, target.salt).verify(password.encode("utf-8"), target.hash)
    except InvalidKey:
        return False
    # hmac.compare_digest only to say plainly that the answer for nobody is no.
    return user is not None and hmac.compare_digest(target.name, user.name)


class UserBook:
    """
    The users, by name. Changes return nothing and raise L{UserError} (or
    C{KeyError} for a name it does not hold).
    """

    def __init__(self) -> None:
        self.users: dict[str, User] = {}

    def get(self, name: str) -> User | None:
        return self.users.get(name)

    def add(self, user: User) -> None:
        if user.name in self.users:
            raise UserError(f"user {user.name!r} exists (`llmgw ctl user passwd` changes a password)")
        if len(self.users) >= MAX_USERS:
            raise UserError(f"there are {MAX_USERS} users already, the most kept")
        self.users[user.name] = user

    def replace(self, user: User) -> None:
        if user.name not in self.users:
            raise KeyError(user.name)
        self.users[user.name] = user

    def remove(self, name: str) -> None:
        del self.users[name]

    def listing(self) -> list[dict[str, str]]:
        return [{"name": u.name, "role": u.role} for u in sorted(self.users.values(), key=lambda u: u.name)]

    def to_data(self) -> dict[str, Any]:
        return {"users": [u.to_data() for u in sorted(self.users.values(), key=lambda u: u.name)]}

    def take_data(self, data: Any) -> list[str]:
        """
        Take the users in C{data} (as L{to_data} writes); returns warnings
        about the users skipped, one line each.

        @raise UserError: C{data} is not a users file at all.
        """
        if not isinstance(data, dict) or not isinstance(data.get("users"), list):
            raise UserError('a users file is a JSON object with a "users" list')
        users: dict[str, User] = {}
        warnings = []
        for item in data["users"][:MAX_USERS]:
            try:
                if not isinstance(item, dict):
                    raise UserError("a user is a JSON object")
                user = User.from_data(item)
            except UserError as e:
                warnings.append(f"{e}; skipped")
                continue
            users[user.name] = user
        self.users = users
        return warnings


class UserFile:
    """
    A L{UserBook} kept in a JSON file (mode 0600: the hashes are slow to
    attack, not public), loaded at start, read again by L{refresh} when
    another process (C{llmgw ctl user}) changed it, and rewritten whole at
    each change. A damaged file is moved aside, never fatal: nobody may
    log in until it is written again.
    """

    log = Logger()

    def __init__(self, path: Path | None):
        self.path = path
        self.book = UserBook()
        self._seen: int | None = None

    def refresh(self) -> None:
        """
        Read the file again if it changed since it was read (one C{stat});
        a file removed since leaves no user.
        """
        if self.path is None:
            return
        try:
            seen: int | None = self.path.stat().st_mtime_ns
        except OSError:
            seen = None
        if seen != self._seen:
            self.load()

    def load(self) -> None:
        self.book = UserBook()
        if self.path is None:
            return
        try:
            self._seen = self.path.stat().st_mtime_ns
        except OSError:
            self._seen = None
            return
        try:
            warnings = self.book.take_data(json.loads(self.path.read_text()))
        except (OSError, ValueError) as e:
            aside = self.path.with_name(self.path.name + ".unreadable")
            self.log.error("users in {path} are unreadable ({error}); moved to {aside}, "
                           "nobody may log in", path=str(self.path), error=str(e), aside=str(aside))
            self.path.replace(aside)
            self.book = UserBook()
            self._seen = None
            return
        for warning in warnings:
            self.log.warn("users in {path}: {warning}", path=str(self.path), warning=warning)

    def save(self) -> None:
        if self.path is None:
            return
        # Unreadable to others from the start. (Not by setting the umask:
        # that is the whole process's, threads writing files included.)
        write_atomically(self.path, json.dumps(self.book.to_data(), sort_keys=True, indent=1), mode=0o600)
        self._seen = self.path.stat().st_mtime_ns
