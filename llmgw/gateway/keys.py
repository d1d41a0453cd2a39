"""
API keys: who may call the gateway.

A keys file is either one key per line (blank lines and C{#} comments
skipped; a key is then named by its line number), or, when its name ends in
C{.toml}, a table of names to keys::

    [keys]
    alice = "sk-..."
    batch-jobs = "sk-..."

    [keys.team-a]            # a key with limits (either may be left out)
    key = "sk-..."
    requests_per_minute = 60
    tokens_per_minute = 100000
    console_roles = ["operator", "admin"]   # who may spend it in the console

A key whose table names C{console_roles} may be spent by the control
plane's console (its playground) for people logged in with one of those
roles (C{viewer}, C{operator}, C{admin}); the control plane then holds it
in memory to send it on, and the browser never sees it. Any other key is
never used by the console.

Keys are compared by their SHA-256 digest and only names ever reach a log.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from pathlib import Path

from twisted.logger import Logger

from llmgw.gateway.usage import KeyLimits

log = Logger()

MIN_KEY_LENGTH = 8
#: The fields of a key's table besides C{key}: its limits.
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute")
#: The field of a key's table naming the console roles that may spend it.
CONSOLE_FIELD = "console_roles"
#: The roles of people in the console (L{llmgw.control.core.users}).
CONSOLE_ROLES = ("viewer", "operator", "admin")


class KeysError(ValueError):
    """
    A keys file cannot be used; the message says where and why (never the
    key itself).
    """


class KeyRing:
    """
    The keys the gateway accepts, by name, and their limits
    (C{limits[name]}; a key with none is not in it).
    """

    def __init__(self, keys: dict[str, str], limits: dict[str, KeyLimits] | None = None,
                 console: dict[str, frozenset[str]] | None = None):
        self.limits = {name: lim for name, lim in (limits or {}).items() if lim}
        #: The keys the console may spend, by name: the key and the roles.
        self.console = {name: (keys[name], roles) for name, roles in (console or {}).items() if roles}
        self._by_digest: dict[bytes, str] = {}
        for name, key in keys.items():
            digest = hashlib.sha256(key.encode()).digest()
            if digest in self._by_digest:
                raise KeysError(f"keys {self._by_digest[digest]!r} and {name!r} are the same key")
            self._by_digest[digest] = name

    def __len__(self) -> int:
        return len(self._by_digest)

    def names(self) -> list[str]:
        return sorted(self._by_digest.values())

    def console_keys(self, role: str | None) -> list[str]:
        """
        The names of the keys the console may spend for a person with
        C{role}; C{None} (the operator at the host, on a loopback API
        without TLS): every key that names any console role.
        """
        return sorted(n for n, (_, roles) in self.console.items() if role is None or role in roles)

    def console_key(self, name: str, role: str | None) -> str | None:
        """
        The key named C{name} if the console may spend it for C{role}
        (as L{console_keys}); else C{None}.
        """
        found = self.console.get(name)
        if found is None or (role is not None and role not in found[1]):
            return None
        return found[0]

    def authenticate(self, authorization: bytes | None) -> str | None:
        """
        The name of the key in an C{Authorization: Bearer KEY} header value,
        or C{None} when the header is missing, malformed or holds no key of
        this ring.
        """
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        if not token:
            return None
        return self._by_digest.get(hashlib.sha256(token).digest())


def parse_keys(text: str, toml: bool, source: str = "keys file") -> KeyRing:
    """
    Read keys from C{text}.

    @raise KeysError: the text holds no key, a malformed entry (a limit
        that is not a positive whole number, a field that is not a limit),
        a key that is too short or has spaces in it, or the same key twice.
    """
    keys: dict[str, str] = {}
    limits: dict[str, KeyLimits] = {}
    console: dict[str, frozenset[str]] = {}
    if toml:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise KeysError(f"{source}: not valid TOML: {e}") from None
        table = data.get("keys", data)
        if not isinstance(table, dict):
            raise KeysError(f"{source}: [keys] must be a table of name = \"key\"")
        for name, key in table.items():
            if isinstance(key, dict):
                console[name] = _console_roles(name, key, source)
                key, limits[name] = _key_table(name, {k: v for k, v in key.items() if k != CONSOLE_FIELD}, source)
            elif not isinstance(key, str):
                raise KeysError(
                    f"{source}: key {name!r} must be a string, or a table [keys.{name}] "
                    f"with key = \"...\" and limits"
                )
            keys[name] = key
    else:
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            keys[f"line {number}"] = line
    if not keys:
        raise KeysError(f"{source}: holds no key")
    for name, key in keys.items():
        if len(key) < MIN_KEY_LENGTH:
            raise KeysError(f"{source}: key {name!r} is shorter than {MIN_KEY_LENGTH} characters")
        if any(c.isspace() for c in key):
            raise KeysError(f"{source}: key {name!r} contains white space")
    try:
        return KeyRing(keys, limits, console)
    except KeysError as e:
        raise KeysError(f"{source}: {e}") from None


def _console_roles(name: str, table: dict[str, object], source: str) -> frozenset[str]:
    """
    The console roles a C{[keys.NAME]} table names (none: not the console's).

    @raise KeysError: not a list of known roles.
    """
    roles = table.get(CONSOLE_FIELD, [])
    if not isinstance(roles, list) or not all(isinstance(r, str) and r in CONSOLE_ROLES for r in roles):
        raise KeysError(
            f"{source}: key {name!r}: {CONSOLE_FIELD} must be a list of console roles "
            f"({', '.join(CONSOLE_ROLES)}), not {roles!r}"
        )
    return frozenset(roles)


def _key_table(name: str, table: dict[str, object], source: str) -> tuple[str, KeyLimits]:
    """
    The key and limits of a C{[keys.NAME]} table.

    @raise KeysError: naming the key (never its value) and what is wrong.
    """
    unknown = sorted(set(table) - {"key", *LIMIT_FIELDS})
    if unknown:
        raise KeysError(
            f"{source}: key {name!r}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"a key's table takes key, {', '.join(LIMIT_FIELDS)}, {CONSOLE_FIELD}"
        )
    key = table.get("key")
    if not isinstance(key, str):
        raise KeysError(f"{source}: key {name!r} needs key = \"...\" (a string) in its table")
    values: dict[str, int] = {}
    for field in LIMIT_FIELDS:
        if field not in table:
            continue
        value = table[field]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KeysError(
                f"{source}: key {name!r}: {field} must be a positive whole number, not {value!r}"
            )
        values[field] = value
    return key, KeyLimits(**values)


def load_keys(path: Path) -> KeyRing:
    """
    Read a keys file (TOML when its name ends in C{.toml}).

    A file that others than its owner may read is used, with a warning.

    @raise KeysError: the file cannot be read or holds no usable key.
    """
    try:
        text = path.read_text()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise KeysError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KeysError(f"{path}: not UTF-8 text") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warn(
            "keys file {path} is readable by others than its owner (mode {mode:o}); "
            "chmod 600 it",
            path=str(path),
            mode=stat.S_IMODE(mode),
        )
    return parse_keys(text, toml=path.suffix == ".toml", source=str(path))
