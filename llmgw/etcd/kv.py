"""
The etcd v3 key-value shapes as the JSON gateway writes them: L{KeyValue}
read back, the transaction parts (L{Compare}, and the ops L{Put}, L{Range},
L{Delete}) written, L{TxnResult} and L{WatchEvent}. Keys and values are
bytes here and base64 on the wire; the gateway writes 64-bit integers as
strings, which are read back as ints.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """
    The C{range_end} that makes a range request cover every key starting
    with C{prefix} (etcd's convention: the prefix with its last byte below
    0xff incremented, the rest dropped; C{b"\\0"} for the whole keyspace).
    """
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            key=unb64(kv.get("key")),
            value=unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True)
class Compare:
    """
    One condition of a transaction: C{target} is C{"CREATE"}, C{"MOD"},
    C{"VERSION"}, C{"VALUE"} or C{"LEASE"}; C{result} C{"EQUAL"},
    C{"NOT_EQUAL"}, C{"GREATER"} or C{"LESS"}.
    """

    key: bytes
    target: str
    result: str
    operand: int | bytes

    _FIELDS = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version",
               "VALUE": "value", "LEASE": "lease"}

    def to_json(self) -> dict[str, Any]:
        name = self._FIELDS[self.target]
        operand: Any = b64(self.operand) if isinstance(self.operand, bytes) else str(self.operand)
        return {"key": b64(self.key), "target": self.target, "result": self.result, name: operand}

    @classmethod
    def absent(cls, key: bytes) -> Compare:
        """The key does not exist."""
        return cls(key, "CREATE", "EQUAL", 0)

    @classmethod
    def mod_revision(cls, key: bytes, revision: int) -> Compare:
        """The key was last written at C{revision} (0: it does not exist)."""
        return cls(key, "MOD", "EQUAL", revision)

    @classmethod
    def held_by(cls, key: bytes, lease: int) -> Compare:
        """The key exists and is attached to C{lease}."""
        return cls(key, "LEASE", "EQUAL", lease)


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(self.key), "value": b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


def _key_range(key: bytes, range_end: bytes) -> dict[str, str]:
    body = {"key": b64(key)}
    if range_end:
        body["range_end"] = b64(range_end)
    return body


@dataclass(frozen=True)
class Range:
    key: bytes
    range_end: bytes = b""

    def to_json(self) -> dict[str, Any]:
        return {"request_range": _key_range(self.key, self.range_end)}


@dataclass(frozen=True)
class Delete:
    key: bytes
    range_end: bytes = b""

    def to_json(self) -> dict[str, Any]:
        return {"request_delete_range": _key_range(self.key, self.range_end)}


Op = Put | Range | Delete


@dataclass(frozen=True)
class TxnResult:
    """
    C{succeeded}: whether every compare held (the success ops ran);
    C{revision}: the store's revision after the transaction; C{responses}:
    one per op that ran, each C{{"kvs": [KeyValue, ...]}} for a range and
    etcd's JSON otherwise.
    """

    succeeded: bool
    revision: int
    responses: list[dict[str, Any]] = field(default_factory=list)

    def kvs(self, index: int) -> list[KeyValue]:
        """The key-values of the range op at C{index} ([] if none)."""
        if index >= len(self.responses):
            return []
        kvs: list[KeyValue] = self.responses[index].get("kvs", [])
        return kvs


@dataclass(frozen=True)
class WatchEvent:
    """C{kind}: C{"PUT"} or C{"DELETE"}; C{kv}: the key after the event."""

    kind: str
    kv: KeyValue
