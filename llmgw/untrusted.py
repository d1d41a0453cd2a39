"""
What the HTTP surfaces (the admin API, the gateway) do with strings and JSON
a client sent.

L{clip} quotes a client string in an error body or a log line: at most a
bounded prefix, control characters escaped, with its full length, so that a
1 MB model name costs neither a 1 MB answer nor a 1 MB log line.

L{load_json} parses a request body as RFC 8259 has JSON, refusing what would
make C{json.loads} recurse past a bounded depth (measured by a linear scan
before parsing, so no C{RecursionError} is possible), what Python's C{json}
takes but JSON has not (C{NaN}, C{Infinity}, a leading byte order mark: a
body is forwarded as it came, and the replica may read these otherwise)
and, where asked, a top-level key given twice (two C{"model"} keys would be
routed by one and read by the replica as the other).

This module sits below C{llmgw.control} and C{llmgw.gateway} and imports
neither.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from itertools import accumulate, count
from operator import sub
from typing import Any, Final

#: Characters of a client string quoted in an error or a log line.
CLIP: Final = 64
#: Deepest nesting of arrays and objects a JSON body may have.
MAX_JSON_DEPTH: Final = 64

_NOT_STRUCTURE: Final = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_BLOCK: Final = 4096
_DEPTH_STEP: Final = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")


def clip(value: str | bytes, limit: int = CLIP) -> str:
    """
    C{value} quoted (as C{repr} does: control characters escaped) for an
    error message or a log line; past C{limit} characters only the first
    C{limit}, an ellipsis and the full length.
    """
    if isinstance(value, bytes):
        unit = "bytes"
        size = len(value)
        text = value[: limit + 1].decode("utf-8", "replace")
    else:
        unit = "characters"
        size = len(value)
        text = value
    if size <= limit and len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}\u2026 ({size} {unit})"


class JSONInputError(ValueError):
    """
    A request body that is refused; C{code} says why (C{invalid_json},
    C{json_too_deep}, C{duplicate_key}), the message says what was wrong.
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """
    Whether the JSON text C{raw} (UTF-8) nests arrays and objects more than
    C{limit} levels deep, counting brackets outside strings (unclosed ones
    count). Linear in C{len(raw)}, in C loops.

    Where C{raw} is malformed the count past its first error is
    approximate, but C{json.loads} never reads past that error either.
    """
    # A small body with few brackets cannot nest deep: two counts settle it.
    # A large one rarely has so few, and the scan costs about as much.
    if len(raw) < 16384 and raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Escaped backslashes, then escaped quotes, cannot end a string: drop
    # them; then every quote opens or closes a string. Keep only quotes and
    # brackets, and of those only what lies between strings.
    # find, not in: bytes' in tries its operand as a number first, making
    # and dropping a TypeError each time.
    if raw.find(b"\\") >= 0:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = raw.translate(None, _NOT_STRUCTURE).split(b'"')[::2]
    steps = b"".join(outside).translate(_DEPTH_STEP)
    # Each open bracket adds 2 and each close 0; less 1 per bracket, the
    # running sum is the depth after each one. In blocks, so that a body of
    # nothing but open brackets is refused after its first block.
    depth = 0
    for start in range(0, len(steps), _BLOCK):
        block = steps[start : start + _BLOCK]
        if depth + max(map(sub, accumulate(block), count(1))) > limit:
            return True
        depth += sum(block) - len(block)
    return False


def load_json(
    raw: bytes,
    max_depth: int = MAX_JSON_DEPTH,
    unique: Collection[str] | None = (),
) -> Any:
    """
    The JSON value in the UTF-8 body C{raw}.

    @param unique: top-level keys that may appear only once; C{None}: every
        top-level key.
    @raise JSONInputError: the body is not UTF-8 or not JSON (C{NaN},
        C{Infinity} and a leading byte order mark included), nests arrays
        and objects deeper than C{max_depth}, or repeats a top-level key
        that C{unique} covers.
    """
    if too_deep(raw, max_depth):
        raise JSONInputError(
            f"the JSON body nests arrays and objects more than {max_depth} levels deep",
            "json_too_deep",
        )
    if raw.startswith(_BOM):
        # RFC 8259 §8.1: JSON sent over a network has none; a replica that
        # reads the forwarded body may not skip it.
        raise JSONInputError(
            "the body is not valid JSON: it starts with a byte order mark (JSON sent over a network has none)",
            "invalid_json",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONInputError(f"the body is not valid JSON: it is not UTF-8 ({e})", "invalid_json") from None
    if unique is not None:
        for key in unique:
            if _may_repeat(raw, key):
                break
        else:
            try:
                return _loads(text)
            except JSONInputError:
                raise
            except ValueError as e:
                raise JSONInputError(f"the body is not valid JSON: {e}", "invalid_json") from None
    # Objects close innermost first: when the value is an object, the last
    # call of the hook was for it; only that call's repeats matter.
    last: list[list[str]] = [[]]

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        last[0] = _repeated(pairs) if len(d) != len(pairs) else []
        return d

    try:
        value = json.loads(text, object_pairs_hook=pairs_hook, parse_constant=_no_constant)
    except JSONInputError:
        raise
    except ValueError as e:
        raise JSONInputError(f"the body is not valid JSON: {e}", "invalid_json") from None
    if isinstance(value, dict):
        repeated = [k for k in dict.fromkeys(last[0]) if unique is None or k in unique]
        if repeated:
            raise JSONInputError(
                "the body's JSON object names "
                + ", ".join(clip(k) for k in repeated[:3])
                + " more than once",
                "duplicate_key",
            )
    return value


def _no_constant(name: str) -> Any:
    """
    Refuse C{NaN}, C{Infinity} or C{-Infinity}, which Python's C{json}
    reads as numbers and JSON does not have.
    """
    raise JSONInputError(f"the body is not valid JSON: {name} is not a JSON value", "invalid_json")


_SCAN: Final = json.JSONDecoder(parse_constant=_no_constant).scan_once  # type: ignore[attr-defined]
_BLANKS: Final = " \t\n\r"
#: The C scanner C{json.loads} uses, refusing C{NaN} and C{Infinity}:
#: C{scan_once(text, index)} is the one JSON value at C{index} and where it
#: ends (C{StopIteration} when none starts there).
scan_once: Final = _SCAN


def _loads(text: str) -> Any:
    """
    C{json.loads(text)}, the same value and errors, without the layers
    between it and the C scanner (about half its cost for a small body).
    """
    start = 0
    if text[:1] in _BLANKS:
        start = len(text) - len(text.lstrip(_BLANKS))
    try:
        value, end = _SCAN(text, start)
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", text, e.value) from None
    if end != len(text):
        rest = len(text) - len(text[end:].lstrip(_BLANKS))
        if rest != len(text):
            raise json.JSONDecodeError("Extra data", text, rest)
    return value


_QUOTED: Final[dict[str, bytes]] = {}
#: The UTF-8 byte order mark, which a JSON text sent over a network must
#: not start with.
_BOM: Final = b"\xef\xbb\xbf"


def _may_repeat(raw: bytes, key: str) -> bool:
    """
    Whether C{raw} might name C{key} twice: it holds C{"key"} more than once,
    or a C{\\u} escape that could spell it another way.
    """
    quoted = _QUOTED.get(key)
    if quoted is None:
        quoted = json.dumps(key).encode()
        if len(_QUOTED) < 64:
            _QUOTED[key] = quoted
    # memchr for a backslash first: most bodies have none, so no escapes at all.
    return raw.count(quoted) > 1 or (raw.find(b"\\") >= 0 and raw.find(b"\\u") >= 0)


def _repeated(pairs: list[tuple[str, Any]]) -> list[str]:
    seen: set[str] = set()
    out = []
    for k, _ in pairs:
        if k in seen:
            out.append(k)
        seen.add(k)
    return out
