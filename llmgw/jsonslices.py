"""
L{load_json_sliced}: what L{llmgw.untrusted.load_json} does, in slices.

C{json.loads} holds the process for as long as a body takes to parse: 0.6 s
for 8 MiB of small keys on a 2-core machine. A generator that parses a few
thousand tokens at a time, and yields between them, lets its caller give
the reactor back after each slice (L{llmgw.gateway.bigbody}).

Containers are walked here, in Python; everything else (strings, numbers,
C{true}, C{false}, C{null}) is read by the C scanner that C{json.loads}
uses, one token a call. The value is the same as C{json.loads}'s, and the
same bodies are refused: not UTF-8, a byte order mark, C{NaN} or
C{Infinity}, nesting past the depth limit (counted as containers are
opened), a repeated top-level key that C{unique} covers. Messages of
malformed bodies may word the error differently.

This module sits below C{llmgw.gateway} and imports nothing of llmgw's but
L{llmgw.untrusted}.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Collection, Generator
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, Final

from llmgw.untrusted import MAX_JSON_DEPTH, JSONInputError, clip, scan_once

#: Tokens parsed between two yields.
SLICE_TOKENS: Final = 2048
#: Characters consumed between two yields (long strings count by length).
SLICE_CHARS: Final = 256 * 1024
#: Bytes decoded from UTF-8 between two yields.
DECODE_BYTES: Final = 1024 * 1024

_BOM: Final = b"\xef\xbb\xbf"
_WS: Final = re.compile(r"[ \t\n\r]*")


def _error(message: str, text: str, pos: int) -> JSONInputError:
    e = json.JSONDecodeError(message, text, pos)
    return JSONInputError(f"the body is not valid JSON: {e}", "invalid_json")


def load_json_sliced(
    raw: bytes,
    max_depth: int = MAX_JSON_DEPTH,
    unique: Collection[str] | None = (),
    keep: Collection[str] | None = None,
) -> Generator[None, None, Any]:
    """
    A generator that parses C{raw} as L{llmgw.untrusted.load_json} does,
    yielding C{None} after each slice of work (at most L{SLICE_TOKENS}
    tokens, L{SLICE_CHARS} characters or L{DECODE_BYTES} bytes decoded, and
    one token however long) and returning the value.

    @param keep: when the value is an object, the top-level keys kept in
        it; others are checked and left out (C{None}: all kept). Millions of small containers cost the cyclic
        garbage collector full passes of hundreds of milliseconds each, in
        whichever slice is unlucky.
    @raise JSONInputError: as L{llmgw.untrusted.load_json} does, from the
        slice that finds it.
    """
    if raw.startswith(_BOM):
        raise JSONInputError(
            "the body is not valid JSON: it starts with a byte order mark (JSON sent over a network has none)",
            "invalid_json",
        )
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    pieces = []
    try:
        for start in range(0, len(raw), DECODE_BYTES):
            pieces.append(decoder.decode(raw[start : start + DECODE_BYTES]))
            yield None
        pieces.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        raise JSONInputError(f"the body is not valid JSON: it is not UTF-8 ({e})", "invalid_json") from None
    text = "".join(pieces)
    del pieces
    return (yield from _walk(text, max_depth, unique, keep))


class _Dropped:
    """
    Stands for a container that is checked and not kept: it keeps nothing,
    and says whether it is an object. Two of them serve all (no
    allocation, nothing for the garbage collector to count).
    """

    __slots__ = ("is_dict",)

    def __init__(self, is_dict: bool):
        self.is_dict = is_dict


_DROPPED_LIST: Final = _Dropped(False)
_DROPPED_DICT: Final = _Dropped(True)


def _walk(
    text: str, max_depth: int, unique: Collection[str] | None, keep: Collection[str] | None
) -> Generator[None, None, Any]:
    # Always a match (of nothing, at worst).
    ws: Callable[[str, int], Any] = _WS.match
    end = len(text)
    # Open containers, innermost last; a dict's key waits in keys.
    stack: list[Any] = []
    keys: list[str] = []
    repeated: list[str] = []
    seen: set[str] = set()
    tokens = 0
    mark = 0
    i = ws(text, 0).end()
    while True:
        # A value starts at i.
        tokens += 1
        if tokens >= SLICE_TOKENS or i - mark >= SLICE_CHARS:
            yield None
            tokens, mark = 0, i
        c = text[i : i + 1]
        if c == "{" or c == "[":
            if len(stack) >= max_depth:
                raise JSONInputError(
                    f"the JSON body nests arrays and objects more than {max_depth} levels deep",
                    "json_too_deep",
                )
            i = ws(text, i + 1).end()
            # Within a top-level value of an object that is not kept,
            # nothing is built.
            dropped = bool(stack) and keep is not None and type(stack[0]) is dict and (
                type(stack[-1]) is _Dropped or len(stack) == 1 and keys[-1] not in keep
            )
            if c == "[":
                if text[i : i + 1] != "]":
                    stack.append(_DROPPED_LIST if dropped else [])
                    continue
                i += 1
                value: Any = _DROPPED_LIST if dropped else []
            else:
                if text[i : i + 1] != "}":
                    stack.append(_DROPPED_DICT if dropped else {})
                    i = _key(text, i, keys)
                    continue
                i += 1
                value = _DROPPED_DICT if dropped else {}
        else:
            try:
                value, i = scan_once(text, i)
            except StopIteration as e:
                raise _error("Expecting value", text, e.value) from None
            except JSONInputError:
                raise
            except ValueError as e:
                raise JSONInputError(f"the body is not valid JSON: {e}", "invalid_json") from None
        # A value ends at i: put it in its container, closing those that end.
        while True:
            if not stack:
                i = ws(text, i).end()
                if i != end:
                    raise _error("Extra data", text, i)
                _check_repeats(repeated)
                return value
            top = stack[-1]
            kind = type(top)
            if kind is list:
                top.append(value)
            elif kind is _Dropped:
                if top.is_dict:
                    keys.pop()
            else:
                key = keys.pop()
                top_level = len(stack) == 1
                if top_level and (unique is None or key in unique):
                    if key in seen:
                        repeated.append(key)
                    seen.add(key)
                if type(value) is _Dropped or top_level and keep is not None and key not in keep:
                    # Left out (a million keys would cost the dict's
                    # resizes); a later repeat of the key may still set it.
                    top.pop(key, None)
                else:
                    top[key] = value
            i = ws(text, i).end()
            c = text[i : i + 1]
            is_dict = kind is dict or kind is _Dropped and top.is_dict
            if c == ",":
                i = ws(text, i + 1).end()
                if is_dict:
                    i = _key(text, i, keys)
                break
            if c == ("}" if is_dict else "]"):
                i += 1
                value = stack.pop()
                continue
            raise _error("Expecting ',' delimiter", text, i)


def _key(text: str, i: int, keys: list[str]) -> int:
    """
    Read an object's key and its colon at C{i}; push the key on C{keys} and
    return where its value starts.
    """
    if text[i : i + 1] != '"':
        raise _error("Expecting property name enclosed in double quotes", text, i)
    try:
        key, i = scanstring(text, i + 1, True)
    except ValueError as e:
        raise JSONInputError(f"the body is not valid JSON: {e}", "invalid_json") from None
    i = _WS.match(text, i).end()  # type: ignore[union-attr]
    if text[i : i + 1] != ":":
        raise _error("Expecting ':' delimiter", text, i)
    keys.append(key)
    return _WS.match(text, i + 1).end()  # type: ignore[union-attr]


def _check_repeats(repeated: list[str]) -> None:
    names = list(dict.fromkeys(repeated))
    if names:
        raise JSONInputError(
            "the body's JSON object names " + ", ".join(clip(k) for k in names[:3]) + " more than once",
            "duplicate_key",
        )


def run_sliced(gen: Generator[None, None, Any]) -> Any:
    """
    Run C{gen} to its end at once and return its value (for tests, and for
    callers with no reactor to give back).
    """
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
