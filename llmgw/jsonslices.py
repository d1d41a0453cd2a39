"""
L{load_json_sliced}: what L{llmgw.untrusted.load_json} does, in slices.

C{json.loads} holds the process for as long as a body takes to parse: 0.6 s
for 8 MiB of small keys on a 2-core machine. A generator that reads at most
L{SLICE_TOKENS} tokens and L{SLICE_BYTES} bytes between two yields lets its
caller give the reactor back after each slice (L{llmgw.gateway.bigbody}).

The body is walked as bytes, in Python, and no step reads more than
L{PIECE} bytes at once: a long string is read in pieces (each by the C
scanner C{json.loads} uses), a long number or run of blanks in windows,
and the UTF-8 check is made in pieces too, so no single token, however
long, holds the caller. Only what is kept is decoded and built.

The value is C{json.loads}'s, and the same bodies are refused: not UTF-8,
a byte order mark, C{NaN} or C{Infinity}, nesting past the depth limit
(counted as containers are opened), a repeated top-level key that
C{unique} covers, an integer of more digits than Python converts. Messages
of malformed bodies may word the error differently. With C{keep},
C{kept_items} and C{kept_chars} the value is a bounded sample instead:
see L{load_json_sliced}.

This module sits below C{llmgw.gateway} and imports nothing of llmgw's but
L{llmgw.untrusted}.
"""

from __future__ import annotations

import codecs
import re
import sys
from collections.abc import Callable, Collection, Generator
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, Final

from llmgw.untrusted import MAX_JSON_DEPTH, JSONInputError, clip

#: Tokens read between two yields.
SLICE_TOKENS: Final = 1024
#: Bytes read between two yields (a long token counts by its length).
SLICE_BYTES: Final = 256 * 1024
#: The most bytes of one token (a string's piece, a window of digits or
#: blanks) read in one call.
PIECE: Final = 64 * 1024
#: Characters of a kept string kept even past its value's budget (a
#: C{"role"} after a long first message), the values' count bounding them.
SHORT: Final = 64
#: Bytes checked as UTF-8 between two yields.
DECODE_BYTES: Final = 1024 * 1024

_BOM: Final = b"\xef\xbb\xbf"
# Bounded: a run of blanks longer than PIECE is read a window at a time.
_WS: Final = re.compile(rb"[ \t\n\r]{0,%d}" % PIECE)
#: The characters of a string that needs no escape decoded, up to a window.
_SIMPLE: Final = re.compile(rb'[^"\\\x00-\x1f]{0,%d}' % PIECE)
_NUMBER: Final = re.compile(rb"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_DIGITS: Final = re.compile(rb"[0-9]{0,%d}" % PIECE)
_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C
_NUMBER_START: Final = frozenset(b"-0123456789")
_LITERALS: Final = ((b"true", True), (b"false", False), (b"null", None))
_CONSTANTS: Final = (b"NaN", b"Infinity", b"-Infinity")


def _error(message: str, pos: int) -> JSONInputError:
    return JSONInputError(f"the body is not valid JSON: {message} at byte {pos}", "invalid_json")


def load_json_sliced(
    raw: bytes,
    max_depth: int = MAX_JSON_DEPTH,
    unique: Collection[str] | None = (),
    keep: Collection[str] | None = None,
    kept_items: int | None = None,
    kept_chars: int | None = None,
) -> Generator[None, None, Any]:
    """
    A generator that parses C{raw} as L{llmgw.untrusted.load_json} does,
    yielding C{None} after each slice of work (at most L{SLICE_TOKENS}
    tokens and about L{SLICE_BYTES} bytes) and returning the value.

    @param keep: when the value is an object, the top-level keys kept in
        it; others are checked and left out (C{None}: all kept). Millions of
        small containers cost the cyclic garbage collector full passes of
        hundreds of milliseconds each, in whichever slice is unlucky.
    @param kept_items: at most this many values are put in the containers
        of each kept top-level value (of the whole value, when it is not an
        object), in document order; the rest are checked and left out, so
        a kept list or object may lack its tail (C{None}: no bound). This
        bounds what is built, and its freeing, whatever the body.
    @param kept_chars: at most this many characters of string values are
        kept in each kept top-level value, in document order: a string past
        the budget is cut to L{SHORT} characters; a key is cut at
        C{kept_chars}; a kept
        number written with more characters is C{None} (C{None}: no bound).
    @raise JSONInputError: as L{llmgw.untrusted.load_json} does, from the
        slice that finds it.
    """
    if raw.startswith(_BOM):
        raise JSONInputError(
            "the body is not valid JSON: it starts with a byte order mark (JSON sent over a network has none)",
            "invalid_json",
        )
    # Checked first, so that any piece of it decodes later.
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        for start in range(0, len(raw), DECODE_BYTES):
            decoder.decode(raw[start : start + DECODE_BYTES])
            yield None
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise JSONInputError(f"the body is not valid JSON: it is not UTF-8 ({e})", "invalid_json") from None
    walk = _Walk(raw, max_depth, unique, keep, kept_items, kept_chars)
    return (yield from walk.run())


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


class _Walk:
    """
    One walk over a body: its bytes and the bounds on what it keeps.
    """

    def __init__(
        self,
        raw: bytes,
        max_depth: int,
        unique: Collection[str] | None,
        keep: Collection[str] | None,
        kept_items: int | None,
        kept_chars: int | None,
    ):
        self.raw = raw
        self.max_depth = max_depth
        self.unique = unique
        self.keep = keep
        self.kept_items = sys.maxsize if kept_items is None else kept_items
        self.kept_chars = sys.maxsize if kept_chars is None else kept_chars
        #: Characters the kept value being read may still keep.
        self.chars_left = self.kept_chars

    def run(self) -> Generator[None, None, Any]:
        raw = self.raw
        end = len(raw)
        keep = self.keep
        unique = self.unique
        ws: Callable[[bytes, int], Any] = _WS.match
        simple: Callable[[bytes, int], Any] = _SIMPLE.match
        number: Callable[[bytes, int, int], Any] = _NUMBER.match
        # Open containers, innermost last; a dict's key waits in keys.
        stack: list[Any] = []
        keys: list[str | None] = []
        repeated: list[str] = []
        seen: set[str] = set()
        built = 0
        tokens = 0
        mark = 0
        value: Any
        i = yield from self.blanks(0)
        while True:
            # A value starts at i.
            tokens += 1
            if tokens >= SLICE_TOKENS or i - mark >= SLICE_BYTES:
                yield None
                tokens, mark = 0, i
            # Whether this value is kept: the whole body, a kept top-level
            # value, or within a kept container while the budget lasts.
            if not stack:
                need = True
            else:
                top = stack[-1]
                if type(top) is _Dropped:
                    need = False
                elif len(stack) == 1 and type(top) is dict:
                    need = keep is None or keys[-1] in keep
                    # Each kept top-level value has a budget of its own.
                    built = 0
                    self.chars_left = self.kept_chars
                else:
                    need = built < self.kept_items
            c = raw[i] if i < end else -1
            if c == _QUOTE:
                j = simple(raw, i + 1).end()
                if raw[j : j + 1] == b'"':
                    # No escape, no control character: the quote ends it.
                    value = self.decode(i + 1, j, max(self.chars_left, SHORT)) if need else None
                    i = j + 1
                else:
                    value, i = yield from self.long_string(i + 1, need, max(self.chars_left, SHORT))
                if value is not None:
                    self.chars_left -= len(value)
            elif c == 0x7B or c == 0x5B:
                if len(stack) >= self.max_depth:
                    raise JSONInputError(
                        f"the JSON body nests arrays and objects more than {self.max_depth} levels deep",
                        "json_too_deep",
                    )
                i += 1
                j = ws(raw, i).end()
                i = j if j - i < PIECE else (yield from self.blanks(j))
                if c == 0x5B:
                    if i >= end or raw[i] != 0x5D:
                        stack.append([] if need else _DROPPED_LIST)
                        continue
                    i += 1
                    value = [] if need else _DROPPED_LIST
                else:
                    if i >= end or raw[i] != 0x7D:
                        stack.append({} if need else _DROPPED_DICT)
                        i = yield from self.key(i, keys, need or len(stack) == 1)
                        continue
                    i += 1
                    value = {} if need else _DROPPED_DICT
            elif c in _NUMBER_START:
                m = number(raw, i, i + PIECE)
                # A number cut by the window may also have lost a "." or an
                # "e-" before it: near the window's end, the long way decides.
                if m is not None and m.end() - i < PIECE - 8 and m.end() - i <= 4000:
                    j = m.end()
                    value = (int(raw[i:j]) if m.lastindex == 1 else float(raw[i:j])) if need else None
                    i = j
                else:
                    value, i = yield from self.number(i, need)
            else:
                for word, literal in _LITERALS:
                    if raw.startswith(word, i):
                        value = literal
                        i += len(word)
                        break
                else:
                    for word in _CONSTANTS:
                        if raw.startswith(word, i):
                            raise JSONInputError(
                                f"the body is not valid JSON: {word.decode()} is not a JSON value", "invalid_json"
                            )
                    raise _error("Expecting value", i)
            # A value ends at i: put it in its container, closing those that end.
            while True:
                if not stack:
                    i = yield from self.blanks(i)
                    if i != end:
                        raise _error("Extra data", i)
                    _check_repeats(repeated)
                    return value
                top = stack[-1]
                kind = type(top)
                if kind is list:
                    if need:
                        top.append(value)
                        built += 1
                elif kind is _Dropped:
                    if top.is_dict:
                        keys.pop()
                else:
                    key = keys.pop()
                    assert key is not None
                    if len(stack) == 1:
                        if unique is None or key in unique:
                            if key in seen:
                                repeated.append(key)
                            seen.add(key)
                        if type(value) is _Dropped or not need:
                            # Left out (a million keys would cost the dict's
                            # resizes); a later repeat of the key may still set it.
                            top.pop(key, None)
                        else:
                            top[key] = value
                    elif need:
                        top[key] = value
                        built += 1
                j = ws(raw, i).end()
                i = j if j - i < PIECE else (yield from self.blanks(j))
                c = raw[i] if i < end else -1
                is_dict = kind is dict or kind is _Dropped and top.is_dict
                if c == 0x2C:
                    i += 1
                    j = ws(raw, i).end()
                    i = j if j - i < PIECE else (yield from self.blanks(j))
                    if is_dict:
                        i = yield from self.key(i, keys, kind is dict)
                    break
                if c == (0x7D if is_dict else 0x5D):
                    i += 1
                    value = stack.pop()
                    # Its parent keeps it if it was kept itself.
                    need = type(value) is not _Dropped
                    continue
                raise _error("Expecting ',' delimiter", i)

    def blanks(self, i: int) -> Generator[None, None, int]:
        """
        Where the run of blanks at C{i} ends, read a window at a time.
        """
        while True:
            j = _WS.match(self.raw, i).end()  # type: ignore[union-attr]
            if j - i < PIECE:
                return j
            i = j
            yield None

    def key(self, i: int, keys: list[str | None], need: bool) -> Generator[None, None, int]:
        """
        Read an object's key and its colon at C{i}; push the key (C{None}
        when not C{need}ed) on C{keys} and return where its value starts.
        A key is cut at C{kept_chars}, and counts against no budget: a long
        first message must not cost the later ones their C{"role"}.
        """
        limit = self.kept_chars
        raw = self.raw
        if i >= len(raw) or raw[i] != _QUOTE:
            raise _error("Expecting property name enclosed in double quotes", i)
        j = _SIMPLE.match(raw, i + 1).end()  # type: ignore[union-attr]
        if raw[j : j + 1] == b'"':
            key = self.decode(i + 1, j, limit) if need else None
            i = j + 1
        else:
            key, i = yield from self.long_string(i + 1, need, limit)
        i = yield from self.blanks(i)
        if i >= len(raw) or raw[i] != 0x3A:
            raise _error("Expecting ':' delimiter", i)
        keys.append(key)
        return (yield from self.blanks(i + 1))

    def decode(self, i: int, j: int, limit: int) -> str:
        """
        The string C{raw[i:j]} (no escapes in it), cut to at most C{limit}
        characters.
        """
        if j - i > limit:
            return self.raw[i : i + max(limit, 0)].decode("utf-8", "ignore")[: max(limit, 0)]
        return self.raw[i:j].decode("utf-8")

    def long_string(self, i: int, need: bool, limit: int) -> Generator[None, None, tuple[str | None, int]]:
        """
        A string with escapes, or a long one (at most C{limit} characters
        of it kept): read by C{scanstring} in pieces that grow to L{PIECE}
        bytes, each cut where no escape or character is split.
        """
        raw = self.raw
        end = len(raw)
        start = i - 1
        parts: list[str] = []
        chars = 0
        size = 256
        while True:
            e = min(i + size, end)
            if e < end:
                e = _cut(raw, i, e)
            piece = raw[i:e].decode("utf-8")
            try:
                text, n = scanstring(piece + '"', 0, True)
            except ValueError as err:
                message = getattr(err, "msg", str(err))
                raise _error(message, i + len(piece[: getattr(err, "pos", 0)].encode())) from None
            closed = n <= len(piece)
            if closed:
                # n is just past the closing quote, inside the piece.
                e = i + len(piece[:n].encode())
            elif e == end:
                raise _error("Unterminated string starting at", start)
            if need and chars < limit:
                if parts and parts[-1] and text and _joins(parts[-1], text):
                    # A surrogate pair split between two pieces.
                    parts[-1], text = parts[-1][:-1], chr(0x10000 + ((ord(parts[-1][-1]) - 0xD800) << 10)
                                                          + (ord(text[0]) - 0xDC00)) + text[1:]
                parts.append(text)
                chars += len(text)
            if closed:
                value = "".join(parts) if need else None
                if value is not None and len(value) > limit:
                    value = value[: max(limit, 0)]
                return value, e
            i = e
            if size < PIECE:
                size = min(4 * size, PIECE)
            else:
                yield None

    def number(self, i: int, need: bool) -> Generator[None, None, tuple[Any, int]]:
        """
        The number at C{i}, when C{need}ed, and where it ends; one written
        with more than L{PIECE} characters is read a window at a time.
        """
        raw = self.raw
        m = _NUMBER.match(raw, i, i + PIECE)
        if m is None:
            if raw.startswith(b"-Infinity", i):
                raise JSONInputError("the body is not valid JSON: -Infinity is not a JSON value", "invalid_json")
            raise _error("Expecting value", i)
        j = m.end()
        # A number cut by the window may also have lost a "." or an "e-"
        # before it: near the window's end, the long way decides.
        if j - i >= PIECE - 8:
            j = yield from self.long_number(i)
            integral = raw.find(b".", i, j) < 0 and raw.find(b"e", i, j) < 0 and raw.find(b"E", i, j) < 0
        else:
            integral = m.group(2) is None and m.group(3) is None
        digits = j - i - (raw[i] == 0x2D)
        if integral and digits > sys.get_int_max_str_digits() > 0:
            raise JSONInputError(
                f"the body is not valid JSON: an integer of {digits} digits (more than "
                f"{sys.get_int_max_str_digits()}) at byte {i}",
                "invalid_json",
            )
        if not need or j - i > self.kept_chars:
            return None, j
        token = raw[i:j]
        return (int(token) if integral else float(token)), j

    def long_number(self, i: int) -> Generator[None, None, int]:
        """
        Where the number at C{i} ends, checked as JSON writes numbers.
        """
        raw = self.raw
        if raw[i] == 0x2D:
            i += 1
        if raw[i : i + 1] == b"0":
            i += 1
        else:
            i = yield from self.digits(i)
        if raw[i : i + 1] == b".":
            i = yield from self.digits(i + 1, at_least_one=True)
        if raw[i : i + 1] in (b"e", b"E"):
            i += 1
            if raw[i : i + 1] in (b"+", b"-"):
                i += 1
            i = yield from self.digits(i, at_least_one=True)
        return i

    def digits(self, i: int, at_least_one: bool = False) -> Generator[None, None, int]:
        start = i
        while True:
            j = _DIGITS.match(self.raw, i).end()  # type: ignore[union-attr]
            if j - i < PIECE:
                break
            i = j
            yield None
        if at_least_one and j == start:
            raise _error("Expecting digits of a number", j)
        return j


def _cut(raw: bytes, i: int, e: int) -> int:
    """
    C{e} moved back, no further than C{i}, so that C{raw[i:e]} ends
    neither inside a UTF-8 character nor inside an escape of a string
    whose content starts at C{i}.
    """
    while e > i and raw[e] & 0xC0 == 0x80:
        e -= 1
    if _odd_backslashes(raw, i, e):
        # A backslash that escapes the character after the cut.
        return e - 1
    b = raw.rfind(b"\\", max(i, e - 5), e)
    if b >= 0 and raw[b + 1 : b + 2] == b"u" and _odd_backslashes(raw, i, b + 1):
        # A \uXXXX the cut would split.
        return b
    return e


def _odd_backslashes(raw: bytes, i: int, e: int) -> bool:
    """
    Whether C{raw[i:e]} ends with an odd run of backslashes.
    """
    seg = raw[i:e]
    return (len(seg) - len(seg.rstrip(b"\\"))) % 2 == 1


def _joins(before: str, after: str) -> bool:
    """
    Whether C{before} ends with a high surrogate and C{after} starts with a
    low one (two escapes that C{json.loads} reads as one character).
    """
    return "\ud800" <= before[-1] <= "\udbff" and "\udc00" <= after[0] <= "\udfff"


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
