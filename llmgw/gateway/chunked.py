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
- a chunk size that is empty, not hexadecimal or over 15 digits
  (extensions after C{;} and blanks around the size are allowed);
- chunk data not followed by CRLF;
- a trailer line (with its CRLF) over L{MAX_TRAILER_LINE} bytes.

The line bounds hold however the bytes are split across calls: a line that
arrives whole is held to the same bound as one that arrives in pieces.
Trailer fields are skipped, never kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

#: The most a chunk-size line (with extensions and its CRLF) may take.
MAX_SIZE_LINE: Final = 1024
#: The most one trailer line (with its CRLF) may take.
MAX_TRAILER_LINE: Final = 64 * 1024

_HEX: Final = b"0123456789abcdefABCDEF"
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

    __slots__ = ("_state", "_remaining", "_seen", "done")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0
        # How much of an incomplete line the last call searched already:
        # the caller passes that line again, and it is not searched again
        # (a line arriving a byte at a time costs its length, not its square).
        self._seen = 0
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
                    # Not bare hex digits: drop extensions and blanks.
                    size = size.split(b";", 1)[0].strip(b" \t")
                    if size.strip(_HEX):
                        raise ChunkError(f"Bad chunk size {bytes(size[:20])!r}")
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
                # Trailer fields are skipped up to the empty line.
                eol = buf.find(b"\r\n", pos + self._seen, pos + MAX_TRAILER_LINE)
                if eol < 0:
                    if end - pos >= MAX_TRAILER_LINE:
                        raise ChunkError("The trailer is too long", trailer=True)
                    self._seen = max(0, end - pos - 1)
                    break
                self._seen = 0
                empty = eol == pos
                pos = eol + 2
                if empty:
                    state = _DONE
                    self.done = True
                    break
            else:  # _DONE: nothing more belongs to this body.
                break
        self._state = state
        self._remaining = remaining
        return pos
