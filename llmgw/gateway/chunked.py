"""
Incremental decoding of HTTP/1.1 chunked transfer coding (RFC 9112 §7.1),
shared by the front (request bodies) and the upstream client (replica
responses).

A L{ChunkedDecoder} holds where it is in the framing (a chunk-size line,
chunk data, the CRLF after the data, the trailer) between calls. Each
L{ChunkedDecoder.feed} consumes as much of a buffer as it can, hands each
piece of chunk data (a slice of the buffer, never empty) to a callback and
says how many bytes it used; the caller keeps the rest and passes it again,
followed by what arrives next, on its next call. Once the
last chunk and the trailer are read, L{ChunkedDecoder.done} is set and the
bytes after them (a pipelined request, or out-of-step bytes from a replica)
are left unused.

The work is a few C{bytes.find} calls and slices a chunk, never a step per
byte. Malformed framing raises L{ChunkError}:

- a chunk-size line (with extensions and its CRLF) over L{MAX_SIZE_LINE}
  bytes;
- a chunk size that is empty, not hexadecimal or over 15 digits;
- chunk extensions that are not RFC 9112's (§7.1.1):
  C{*( BWS ";" BWS name [ BWS "=" BWS value ] )}, a name a token, a value
  a token or a quoted string (so no bare CR or LF, no control byte, no
  blank before the size or after it without an extension);
- chunk data not followed by CRLF;
- a trailer line (with its CRLF) over L{MAX_TRAILER_LINE} bytes, more than
  L{MAX_TRAILER_LINES} trailer lines, or over L{MAX_TRAILER} bytes of them
  in all (the head's bounds: trailer fields are header fields sent late);
- a trailer line that is not a field line (C{name: value}, the name a
  token, no bare CR or LF, no control byte).

The line bounds hold however the bytes are split across calls: a line that
arrives whole is held to the same bound as one that arrives in pieces.
Trailer fields are skipped, never kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

#: The most a chunk-size line (with extensions and its CRLF) may take.
MAX_SIZE_LINE: Final = 1024
#: The most one trailer line (with its CRLF) may take.
MAX_TRAILER_LINE: Final = 64 * 1024
#: The most trailer lines a body may end with (as many as a head's header
#: lines, L{llmgw.gateway.httphead.MAX_HEADERS}).
MAX_TRAILER_LINES: Final = 100
#: The most the trailer lines (with their CRLFs) may take in all (as much
#: as a request head, L{llmgw.gateway.front.MAX_HEAD}).
MAX_TRAILER: Final = 64 * 1024

_HEX: Final = b"0123456789abcdefABCDEF"
#: RFC 9112 §7.1.1's chunk-ext, after the size: BWS is blanks, a name is a
#: token, a value a token or a quoted string (RFC 9110 §5.6.2, §5.6.4).
_TOKEN_RE: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_EXTENSIONS: Final = re.compile(
    rb"(?:[ \t]*;[ \t]*" + _TOKEN_RE + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN_RE
    + rb'|"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"))?)*'
)
#: A trailer field line: a token, a colon, then a value of visible bytes,
#: blanks and obs-text (RFC 9110 §5.5).
_FIELD_LINE: Final = re.compile(_TOKEN_RE + rb":[\t -~\x80-\xff]*")
_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


class ChunkError(ValueError):
    """
    The chunked framing is malformed; the message says how. C{trailer} is
    true when what was wrong is a trailer line over its bound.
    """

    def __init__(self, message: str, trailer: bool = False):
        super().__init__(message)
        self.trailer = trailer


class ChunkedDecoder:
    """
    The state of one chunked body being decoded; see the module's
    description. After a L{ChunkError} the decoder is not to be used again.
    """

    __slots__ = ("_state", "_remaining", "_seen", "_trailer_lines", "_trailer_bytes", "done")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0
        # How much of an incomplete line the last call searched already:
        # the caller passes that line again, and it is not searched again
        # (a line arriving a byte at a time costs its length, not its square).
        self._seen = 0
        # The trailer lines read so far, and their bytes.
        self._trailer_lines = 0
        self._trailer_bytes = 0
        #: Whether the last chunk and the trailer have been read.
        self.done = False

    def feed(self, buf: bytes | bytearray, piece: Callable[[Any], object]) -> int:
        """
        Decode what C{buf} holds, calling C{piece} with each piece of chunk
        data in order (slices of C{buf}: bytearrays when it is one).

        @return: how many bytes of C{buf} were used. The rest is either an
            incomplete line (pass it again, with more bytes after it) or,
            when L{done} is set, what follows the body.
        @raise ChunkError: the framing is malformed.
        """
        pos = 0
        end = len(buf)
        state = self._state
        remaining = self._remaining
        while pos < end:
            if state == _SIZE:
                eol = buf.find(b"\r\n", pos + self._seen, pos + MAX_SIZE_LINE)
                if eol < 0:
                    if end - pos >= MAX_SIZE_LINE:
                        raise ChunkError("A chunk-size line is too long")
                    self._seen = max(0, end - pos - 1)
                    break
                self._seen = 0
                size = buf[pos:eol]
                if size.strip(_HEX):
                    # Not bare hex digits: the size, then extensions.
                    line = bytes(size)
                    digits = len(line) - len(line.lstrip(_HEX))
                    size = line[:digits]
                    # A blank may come after the size only before a ";".
                    if not digits or not line[digits:].lstrip(b" \t").startswith(b";"):
                        raise ChunkError(f"Bad chunk size {line[:20]!r}")
                    if _EXTENSIONS.fullmatch(line, digits) is None:
                        raise ChunkError(f"Bad chunk extension in {line[:40]!r} (RFC 9112 §7.1.1)")
                if not 0 < len(size) < 16:
                    raise ChunkError(f"Bad chunk size {bytes(size[:20])!r}")
                remaining = int(size, 16)
                pos = eol + 2
                state = _DATA if remaining else _TRAILER
            elif state == _DATA:
                take = end - pos
                if take > remaining:
                    take = remaining
                piece(buf[pos : pos + take])
                pos += take
                remaining -= take
                if remaining:
                    break
                # The CRLF after the data, when it is here already.
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                    state = _SIZE
                elif end - pos >= 2:
                    raise ChunkError("Chunk data is not followed by CRLF")
                else:
                    state = _CRLF
            elif state == _CRLF:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkError("Chunk data is not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state == _TRAILER:
                # Trailer fields are checked and skipped up to the empty
                # line. A line may take what the trailer's whole bound has
                # left, and its empty line's CRLF besides.
                bound = min(MAX_TRAILER_LINE, MAX_TRAILER - self._trailer_bytes + 2)
                eol = buf.find(b"\r\n", pos + self._seen, pos + bound)
                if eol < 0:
                    if end - pos >= bound:
                        raise ChunkError("The trailer is too long", trailer=True)
                    self._seen = max(0, end - pos - 1)
                    break
                self._seen = 0
                if eol == pos:
                    pos = eol + 2
                    state = _DONE
                    self.done = True
                    break
                if _FIELD_LINE.fullmatch(buf, pos, eol) is None:
                    raise ChunkError(f"Malformed trailer line {bytes(buf[pos:min(eol, pos + 40)])!r}")
                self._trailer_lines += 1
                self._trailer_bytes += eol + 2 - pos
                if self._trailer_lines > MAX_TRAILER_LINES or self._trailer_bytes > MAX_TRAILER:
                    raise ChunkError(
                        f"The trailer has over {MAX_TRAILER_LINES} lines or {MAX_TRAILER} bytes", trailer=True
                    )
                pos = eol + 2
            else:  # _DONE: nothing more belongs to this body.
                break
        self._state = state
        self._remaining = remaining
        return pos
