"""
Tests for L{llmgw.gateway.chunked}, the incremental chunked-body decoder
shared by the gateway's front and its upstream client.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.chunked import (
    MAX_SIZE_LINE,
    MAX_TRAILER,
    MAX_TRAILER_LINE,
    MAX_TRAILER_LINES,
    ChunkedDecoder,
    ChunkError,
)

BODY = b"5;ext=1;q=\"a b\"\r\nhello\r\nA\r\n 012345678\r\n1 \t; e\r\n!\r\n0\r\nX-Trailer: t\r\nY: u\r\n\r\n"
DATA = b"hello 012345678!"


def feed_in_pieces(encoded: bytes, cuts: list[int]) -> tuple[list[bytes], ChunkedDecoder, bytes]:
    """
    Feed C{encoded} to a new decoder as a transport would deliver it, cut
    at C{cuts}, keeping what each call leaves unused for the next one (as
    both callers do). Returns the pieces handed over, the decoder, and what
    was left unused at the end.
    """
    decoder = ChunkedDecoder()
    pieces: list[bytes] = []
    left = b""
    bounds = [0, *cuts, len(encoded)]
    for start, stop in zip(bounds, bounds[1:], strict=False):
        buf = left + encoded[start:stop]
        used = decoder.feed(buf, pieces.append)
        left = buf[used:]
        if decoder.done:
            left += encoded[stop:]
            break
    return pieces, decoder, left


class DecoderTests(SynchronousTestCase):
    def test_whole(self) -> None:
        """
        A body fed in one buffer is handed over as its chunks' data, one
        piece a chunk, extensions after C{;} (quoted strings too), blanks
        around the size and trailer fields dropped; all of it is used and
        the decoder is done.
        """
        pieces, decoder, left = feed_in_pieces(BODY, [])
        self.assertEqual(pieces, [b"hello", b" 012345678", b"!"])
        self.assertTrue(decoder.done)
        self.assertEqual(left, b"")

    def test_every_split(self) -> None:
        """
        Split at every byte position, and at every pair of positions, the
        body decodes to the same data, never an empty piece, and ends
        done with nothing left over.
        """
        n = len(BODY)
        for i in range(1, n):
            pieces, decoder, left = feed_in_pieces(BODY, [i])
            self.assertEqual(b"".join(pieces), DATA, i)
            self.assertNotIn(b"", pieces, i)
            self.assertTrue(decoder.done, i)
            self.assertEqual(left, b"", i)
            for j in range(i + 1, n):
                pieces, decoder, left = feed_in_pieces(BODY, [i, j])
                self.assertEqual(b"".join(pieces), DATA, (i, j))
                self.assertTrue(decoder.done, (i, j))

    def test_byte_by_byte(self) -> None:
        """
        Fed one byte at a time, the decoder is done exactly at the body's
        last byte, not before.
        """
        decoder = ChunkedDecoder()
        pieces: list[bytes] = []
        left = b""
        for i in range(len(BODY)):
            self.assertFalse(decoder.done, i)
            buf = left + BODY[i : i + 1]
            left = buf[decoder.feed(buf, pieces.append) :]
        self.assertTrue(decoder.done)
        self.assertEqual(b"".join(pieces), DATA)

    def test_what_follows_is_unused(self) -> None:
        """
        Bytes after the body (a pipelined request, however it is split
        from the body) are not used, and nothing after the end is read.
        """
        after = b"POST / HTTP/1.1\r\n\r\n"
        decoder = ChunkedDecoder()
        buf = BODY + after
        out: list[bytes] = []
        used = decoder.feed(buf, out.append)
        self.assertTrue(decoder.done)
        self.assertEqual(buf[used:], after)
        for i in range(1, len(buf)):
            pieces, decoder, left = feed_in_pieces(buf, [i])
            self.assertEqual(left, after, i)
            self.assertEqual(b"".join(pieces), DATA, i)
        self.assertEqual(decoder.feed(after, out.append), 0)

    def test_empty_body(self) -> None:
        """
        A body that is only the last chunk (with or without trailer fields)
        hands over nothing and is done.
        """
        for encoded in (b"0\r\n\r\n", b"000;x\r\nT: 1\r\n\r\n"):
            pieces, decoder, left = feed_in_pieces(encoded, [])
            self.assertEqual(pieces, [])
            self.assertTrue(decoder.done)
            self.assertEqual(left, b"")

    def test_incomplete(self) -> None:
        """
        Up to its last byte a body is not done, and an unfinished line is
        left unused for the next call; chunk data is handed over as it
        arrives, before its chunk is complete.
        """
        decoder = ChunkedDecoder()
        pieces: list[bytes] = []
        self.assertEqual(decoder.feed(b"1f", pieces.append), 0)
        self.assertEqual(decoder.feed(b"1f\r\nabc", pieces.append), 7)
        self.assertEqual(pieces, [b"abc"])
        self.assertFalse(decoder.done)
        pieces, decoder, left = feed_in_pieces(BODY[:-1], [])
        self.assertFalse(decoder.done)
        self.assertEqual(left, b"\r")

    def test_big_chunk(self) -> None:
        """
        The largest size allowed (15 hex digits, upper or lower case) is
        accepted, and its data handed over as it comes.
        """
        decoder = ChunkedDecoder()
        pieces: list[bytes] = []
        used = decoder.feed(b"FFFFFFFFFFFFFFf\r\n" + b"x" * 100, pieces.append)
        self.assertEqual(used, 117)
        self.assertEqual(pieces, [b"x" * 100])
        self.assertFalse(decoder.done)

    def assert_refused(self, encoded: bytes, message: str, trailer: bool = False) -> None:
        """
        C{encoded} raises L{ChunkError} with C{message} in its text, fed
        whole, and also when split at any byte position.
        """
        decoder = ChunkedDecoder()
        out: list[bytes] = []
        e = self.assertRaises(ChunkError, decoder.feed, encoded, out.append)
        self.assertIn(message, str(e))
        self.assertEqual(e.trailer, trailer)
        self.assertIsInstance(e, ValueError)
        step = max(1, len(encoded) // 50)
        for i in range(1, len(encoded), step):
            e = self.assertRaises(ChunkError, feed_in_pieces, encoded, [i])
            self.assertIn(message, str(e), i)

    def test_bad_size(self) -> None:
        """
        A chunk size that is empty, not hexadecimal (signs, C{0x},
        underscores and blanks inside included), over 15 digits, with a
        blank before it or a blank after it and no extension, is refused,
        saying which size.
        """
        for line in (b"", b";ext", b"zz", b"-1", b"+1", b"0x1", b"1_0", b"1 0", b"1\x0b", b"1" * 16, b" 1", b"1 "):
            self.assert_refused(line + b"\r\nx\r\n0\r\n\r\n", "Bad chunk size")
        self.assert_refused(b"5\r\nhello\r\nzz\r\n", "Bad chunk size b'zz'")

    def test_size_line_too_long(self) -> None:
        """
        A chunk-size line (extensions and CRLF included) over
        L{MAX_SIZE_LINE} bytes is refused however it arrives: whole, or in
        pieces with its CRLF still to come. One exactly at the limit is
        accepted.
        """
        at_limit = b"1;" + b"e" * (MAX_SIZE_LINE - 4) + b"\r\n"
        self.assertEqual(len(at_limit), MAX_SIZE_LINE)
        pieces, decoder, _ = feed_in_pieces(at_limit + b"x\r\n0\r\n\r\n", [])
        self.assertEqual((pieces, decoder.done), ([b"x"], True))
        over = b"1;" + b"e" * (MAX_SIZE_LINE - 3) + b"\r\n"
        self.assert_refused(over + b"x\r\n0\r\n\r\n", "chunk-size line is too long")
        self.assert_refused(b"1;" + b"e" * MAX_SIZE_LINE, "chunk-size line is too long")

    def test_missing_crlf(self) -> None:
        """
        Chunk data followed by anything but CRLF (more data than the size
        said, a bare LF) is refused, whether the data and what follows come
        together or apart.
        """
        self.assert_refused(b"1\r\nab\r\n0\r\n\r\n", "not followed by CRLF")
        self.assert_refused(b"2\r\nab\n0\r\n\r\n", "not followed by CRLF")
        self.assert_refused(b"2\r\nab\r0\r\n\r\n", "not followed by CRLF")

    def test_trailer_too_long(self) -> None:
        """
        A trailer line (CRLF included) over L{MAX_TRAILER_LINE} bytes is
        refused, flagged as the trailer's fault, however it arrives; one
        exactly at the limit is skipped.
        """
        at_limit = b"X: " + b"t" * (MAX_TRAILER_LINE - 5) + b"\r\n"
        self.assertEqual(len(at_limit), MAX_TRAILER_LINE)
        pieces, decoder, left = feed_in_pieces(b"0\r\n" + at_limit + b"\r\n", [])
        self.assertEqual((pieces, decoder.done, left), ([], True, b""))
        self.assert_refused(b"0\r\nX: " + b"t" * (MAX_TRAILER_LINE - 4) + b"\r\n\r\n", "trailer", trailer=True)
        self.assert_refused(b"0\r\nX: " + b"t" * MAX_TRAILER_LINE, "trailer", trailer=True)

    def test_extensions_checked(self) -> None:
        """
        Chunk extensions are RFC 9112's: C{;name} or C{;name=value} with
        blanks around the C{;} and C{=}, a token or quoted-string value
        (escapes included). Anything else on the size line (a bare LF or CR,
        a control byte, an empty name, a value that is neither, an
        unclosed quote) is refused as a bad extension.
        """
        good = [b"1;a", b"1 ;a", b"1; a = b", b"1;a;b=c", b'1;a="x \\" y\t\xff"', b"1;a=b \t;c"]
        for line in good:
            pieces, decoder, _ = feed_in_pieces(line + b"\r\nx\r\n0\r\n\r\n", [])
            self.assertEqual((pieces, decoder.done), ([b"x"], True), line)
        bad = [
            b"1;a\nb", b"1;a\rb", b"1;a=b\nc", b"1;", b"1;=b", b"1;a=", b"1;a b", b"1;a=b c",
            b'1;a="b', b'1;a="b\x01"', b"1;a=\x00", b"1;a@b", b'1;a=b"c"', b"1;;a",
        ]
        for line in bad:
            self.assert_refused(line + b"\r\nx\r\n0\r\n\r\n", "Bad chunk extension")

    def test_trailer_lines_checked(self) -> None:
        """
        A trailer line must be a field line (a token name, a colon, a value
        with no control byte): a bare LF or CR in it, a name that is not a
        token or a line with no colon is refused (not as the trailer's
        length).
        """
        for line in (b"X: a\nb", b"X: a\rb", b"X : a", b" X: a", b"NoColon", b"X: \x01"):
            self.assert_refused(b"0\r\n" + line + b"\r\n\r\n", "Malformed trailer line")

    def test_trailer_count_bounded(self) -> None:
        """
        At most L{MAX_TRAILER_LINES} trailer lines are skipped; one more is
        refused as the trailer's fault, however it arrives.
        """
        at_limit = b"0\r\n" + b"X: y\r\n" * MAX_TRAILER_LINES + b"\r\n"
        pieces, decoder, left = feed_in_pieces(at_limit, [])
        self.assertEqual((pieces, decoder.done, left), ([], True, b""))
        over = b"0\r\n" + b"X: y\r\n" * (MAX_TRAILER_LINES + 1) + b"\r\n"
        self.assert_refused(over, "trailer", trailer=True)

    def test_trailer_total_bounded(self) -> None:
        """
        The trailer lines together take at most L{MAX_TRAILER} bytes (CRLFs
        included): lines each under their own bound but over it together are
        refused as the trailer's fault, however they arrive; exactly at it
        they are skipped.
        """
        line = b"X: " + b"t" * 1019 + b"\r\n"
        self.assertEqual(MAX_TRAILER % len(line), 0)
        at_limit = b"0\r\n" + line * (MAX_TRAILER // len(line)) + b"\r\n"
        pieces, decoder, left = feed_in_pieces(at_limit, [])
        self.assertEqual((pieces, decoder.done, left), ([], True, b""))
        self.assert_refused(b"0\r\n" + line * (MAX_TRAILER // len(line)) + b"X: y\r\n\r\n", "trailer", trailer=True)
        self.assert_refused(b"0\r\n" + line * (MAX_TRAILER // len(line)) + b"XY", "trailer", trailer=True)
