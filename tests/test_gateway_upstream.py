"""
The gateway's HTTP/1.1 client to replicas, through a StringTransport.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.deadline import Deadline
from llmgw.gateway.upstream import UpstreamConnection, UpstreamPool, UpstreamProtocolError
from tests.gateway_helpers import cyclic_leftovers


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def response_started(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.events.append(("start", status, reason, headers))

    def response_data(self, data: bytes) -> None:
        self.events.append(("data", data))

    def response_finished(self) -> None:
        self.events.append(("finished",))

    def response_failed(self, reason: Failure, started: bool) -> None:
        self.events.append(("failed", reason.type, started))

    def data(self) -> bytes:
        return b"".join(e[1] for e in self.events if e[0] == "data")


class FailureKeeper(Recorder):
    """
    A L{Recorder} that also keeps each failure's reason.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[Failure] = []

    def response_failed(self, reason: Failure, started: bool) -> None:
        super().response_failed(reason, started)
        self.reasons.append(reason)


def connection(pool: UpstreamPool | None = None) -> tuple[UpstreamConnection, StringTransport]:
    conn = UpstreamConnection(pool, "10.0.0.1:8000")
    t = StringTransport()
    conn.makeConnection(t)
    return conn, t


def feed(conn: UpstreamConnection, data: bytes, step: int) -> None:
    for i in range(0, len(data), step):
        conn.dataReceived(data[i : i + step])


class ParseTests(SynchronousTestCase):
    def test_content_length_any_split(self) -> None:
        """
        A Content-Length response is read whole however the bytes are split,
        and the connection goes back to the pool.
        """
        raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\nhello world"
        for step in (1, 2, 7, len(raw)):
            pool = UpstreamPool(Clock())
            conn, t = connection(pool)
            rec = Recorder()
            conn.send(b"REQUEST", rec)
            self.assertEqual(t.value(), b"REQUEST")
            feed(conn, raw, step)
            self.assertEqual(rec.events[0][:3], ("start", 200, b"OK"))
            self.assertIn((b"content-type", b"application/json"), rec.events[0][3])
            self.assertEqual(rec.data(), b"hello world")
            self.assertEqual(rec.events[-1], ("finished",))
            self.assertIs(pool.take("10.0.0.1:8000"), conn)

    def test_chunked_any_split(self) -> None:
        """
        A chunked response is handed over without its framing (extensions
        and trailers ignored), however the bytes are split.
        """
        raw = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        )
        for step in (1, 3, 9, len(raw)):
            pool = UpstreamPool(Clock())
            conn, t = connection(pool)
            rec = Recorder()
            conn.send(b"R", rec)
            feed(conn, raw, step)
            self.assertEqual(rec.data(), b"hello world")
            self.assertEqual(rec.events[-1], ("finished",))
            self.assertIs(pool.take("10.0.0.1:8000"), conn)

    def test_chunks_handed_over_as_they_come(self) -> None:
        """
        Each event of a stream is handed over as soon as its chunk is read,
        before the response ends.
        """
        conn, t = connection()
        rec = Recorder()
        conn.send(b"R", rec)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.dataReceived(b"8\r\ndata: 1\n\r\n")
        self.assertEqual(rec.data(), b"data: 1\n")
        self.assertNotIn(("finished",), rec.events)
        conn.dataReceived(b"8\r\ndata: 2\n\r\n0\r\n\r\n")
        self.assertEqual(rec.data(), b"data: 1\ndata: 2\n")
        self.assertEqual(rec.events[-1], ("finished",))

    def test_head_read_always_reports_data(self) -> None:
        """
        In the read that completes a head, the handler hears
        C{response_data} right after C{response_started}: with the body
        bytes that read held, or C{b""} when it held none or only chunk
        framing (so a handler holding the head knows to send it).
        """
        cases = [
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b""),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab", b"ab"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b""),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n", b""),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", b"ab"),
            (b"HTTP/1.1 200 OK\r\n\r\n", b""),
        ]
        for head, first in cases:
            conn, t = connection()
            rec = Recorder()
            conn.send(b"R", rec)
            conn.dataReceived(head)
            self.assertEqual([e[0] for e in rec.events], ["start", "data"], head)
            self.assertEqual(rec.events[1], ("data", first), head)

    def test_interim_response_skipped(self) -> None:
        """
        A 100 Continue before the answer is skipped.
        """
        conn, t = connection()
        rec = Recorder()
        conn.send(b"R", rec)
        conn.dataReceived(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        self.assertEqual(rec.events[0][1], 204)
        self.assertEqual(rec.events[-1], ("finished",))

    def test_connection_close_not_reused(self) -> None:
        """
        A response with C{Connection: close}, or one read to the end of the
        connection, does not go back to the pool.
        """
        pool = UpstreamPool(Clock())
        conn, t = connection(pool)
        rec = Recorder()
        conn.send(b"R", rec)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        self.assertEqual(rec.events[-1], ("finished",))
        self.assertTrue(t.disconnecting)
        self.assertIsNone(pool.take("10.0.0.1:8000"))

        conn, t = connection(pool)
        rec = Recorder()
        conn.send(b"R", rec)
        conn.dataReceived(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        self.assertNotIn(("finished",), rec.events)
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(rec.data(), b"until the end")
        self.assertEqual(rec.events[-1], ("finished",))
        self.assertIsNone(pool.take("10.0.0.1:8000"))

    def test_lost_before_and_during(self) -> None:
        """
        A connection lost before any byte is a failure that did not start;
        lost in the middle of a body, one that did.
        """
        conn, t = connection()
        rec = Recorder()
        conn.send(b"R", rec)
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(rec.events, [("failed", ConnectionDone, False)])

        conn, t = connection()
        rec = Recorder()
        conn.send(b"R", rec)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(rec.events[-1], ("failed", ConnectionDone, True))

    def test_garbage_fails(self) -> None:
        """
        Bytes that are not an HTTP/1.x response, a bad chunk size or a head
        over the limit fail the request and close the connection.
        """
        for raw in (
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000,
        ):
            conn, t = connection()
            rec = Recorder()
            conn.send(b"R", rec)
            conn.dataReceived(raw)
            self.assertEqual(rec.events[-1][:2], ("failed", UpstreamProtocolError), raw[:30])
            self.assertTrue(t.disconnected)

    def test_bad_chunked_framing_fails(self) -> None:
        """
        Malformed chunked framing from a replica (a size that is not plain
        hex, a size line over 1024 bytes even when it arrives whole, data
        without its CRLF, a trailer line over 64 KiB) fails the request with
        the decoder's reason and closes the connection, however the bytes
        are split.
        """
        cases = [
            (b"0x5\r\nhello\r\n0\r\n\r\n", "Bad chunk size b'0x5'"),
            (b"5;" + b"e" * 1100 + b"\r\nhello\r\n0\r\n\r\n", "chunk-size line is too long"),
            (b"5\r\nhello!\r\n0\r\n\r\n", "not followed by CRLF"),
            (b"0\r\nX: " + b"t" * 70000 + b"\r\n\r\n", "trailer is too long"),
        ]
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        for body, message in cases:
            for step in (1, 7, len(head + body)):
                conn, t = connection()
                rec = FailureKeeper()
                conn.send(b"R", rec)
                feed(conn, head + body, step)
                (reason,) = rec.reasons
                self.assertIsInstance(reason.value, UpstreamProtocolError)
                self.assertIn(message, str(reason.value))
                self.assertTrue(t.disconnected)

    def test_unsolicited_bytes_close(self) -> None:
        """
        Bytes from an idle connection (no request outstanding) close it.
        """
        pool = UpstreamPool(Clock())
        conn, t = connection(pool)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\n\r\n")
        self.assertTrue(t.disconnected)


class FlowTests(SynchronousTestCase):
    def test_pause_resume_abort(self) -> None:
        """
        Pausing a connection pauses its transport (the replica's socket is
        no longer read); aborting drops it and reports nothing more.
        """
        conn, t = connection()
        rec = Recorder()
        conn.send(b"R", rec)
        conn.pause()
        self.assertEqual(t.producerState, "paused")
        conn.resume()
        self.assertEqual(t.producerState, "producing")
        conn.abort()
        self.assertTrue(t.disconnected)
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(rec.events, [])


class PoolTests(SynchronousTestCase):
    def test_idle_limit_and_close(self) -> None:
        """
        At most C{max_idle} connections per address stay idle, newest
        first out; L{UpstreamPool.close} closes them all.
        """
        pool = UpstreamPool(Clock(), max_idle=2)
        conns = [connection(pool) for _ in range(3)]
        for conn, _ in conns:
            pool.release(conn)
        self.assertEqual(pool.idle_count("10.0.0.1:8000"), 2)
        self.assertTrue(conns[2][1].disconnecting)
        self.assertIs(pool.take("10.0.0.1:8000"), conns[1][0])
        pool.release(conns[1][0])
        pool.close()
        self.assertTrue(conns[0][1].disconnecting and conns[1][1].disconnecting)
        self.assertIsNone(pool.take("10.0.0.1:8000"))

    def test_lost_idle_leaves_pool(self) -> None:
        """
        An idle connection the replica closes is never handed out.
        """
        pool = UpstreamPool(Clock())
        conn, t = connection(pool)
        pool.release(conn)
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertIsNone(pool.take("10.0.0.1:8000"))


class StrictHeadTests(SynchronousTestCase):
    def answer(self, raw: bytes, pool: UpstreamPool | None = None) -> tuple[FailureKeeper, StringTransport]:
        conn, t = connection(pool)
        rec = FailureKeeper()
        conn.send(b"R", rec)
        conn.dataReceived(raw)
        return rec, t

    def assertRefused(self, raw: bytes, *words: str) -> None:
        rec, t = self.answer(raw)
        self.assertEqual([e[0] for e in rec.events], ["failed"], raw)
        (reason,) = rec.reasons
        self.assertIsInstance(reason.value, UpstreamProtocolError)
        for w in words:
            self.assertIn(w, str(reason.value))
        self.assertTrue(t.disconnected)

    def test_content_length_only_digits(self) -> None:
        """
        A Content-Length is ASCII digits only, at most 18 of them: Python's
        C{int} also takes C{1_0}, C{+10} and C{ 10 }-like forms, which
        another parser would read differently. Two that disagree are
        refused; two that agree are one.
        """
        for value in (b"1_0", b"+10", b"-1", b"0x10", b"1e1", b"10, 10", b"1" * 19, b"\xd9\xa1"):
            self.assertRefused(
                b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\n0123456789", "Content-Length"
            )
        self.assertRefused(
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nContent-Length: 2\r\n\r\n0123456789",
            "two Content-Lengths",
        )
        rec, _ = self.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length:  2 \r\n\r\nok")
        self.assertEqual(rec.data(), b"ok")
        self.assertEqual(rec.events[-1], ("finished",))

    def test_transfer_coding_list(self) -> None:
        """
        A Transfer-Encoding is read as a list of codings: only C{chunked},
        alone (in any case, across header lines, with empty list elements),
        is decoded; any other coding (C{gzip, chunked}, C{xchunked},
        C{chunked, gzip}, C{chunked} twice) is refused, and so is any
        Transfer-Encoding in an HTTP/1.0 answer.
        """
        body = b"2\r\nok\r\n0\r\n\r\n"
        for value in (b"gzip, chunked", b"xchunked", b"notchunked", b"chunked, gzip", b"chunked, chunked",
                      b"identity"):
            self.assertRefused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + value + b"\r\n\r\n" + body,
                               "Transfer-Encoding")
        self.assertRefused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                           + body, "Transfer-Encoding")
        self.assertRefused(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body, "HTTP/1.0")
        for value in (b"chunked", b"Chunked", b" chunked ,", b", chunked"):
            rec, _ = self.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + value + b"\r\n\r\n" + body)
            self.assertEqual(rec.data(), b"ok", value)
            self.assertEqual(rec.events[-1], ("finished",))

    def test_chunked_with_a_length_not_reused(self) -> None:
        """
        An answer both chunked and with a Content-Length is read chunked,
        and its connection is not reused (RFC 9112 §6.3: a sign of
        smuggling).
        """
        pool = UpstreamPool(Clock())
        rec, t = self.answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            pool,
        )
        self.assertEqual(rec.data(), b"ok")
        self.assertTrue(t.disconnecting)
        self.assertIsNone(pool.take("10.0.0.1:8000"))

    def test_header_syntax(self) -> None:
        """
        Header names must be tokens and values free of control characters
        but HTAB (no bare CR or LF); the status code is three digits and the
        reason phrase plain text; a header line needs a colon. Each is
        refused with what was wrong.
        """
        cases = [
            (b"HTTP/1.1 200 OK\r\nX Y: 1\r\n\r\n", "not a token"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding\x0b: chunked\r\n\r\n", "not a token"),
            (b"HTTP/1.1 200 OK\r\n X: folded\r\n\r\n", "not a token"),
            (b"HTTP/1.1 200 OK\r\nX: a\rSet-Cookie: b\r\n\r\n", "control character"),
            (b"HTTP/1.1 200 OK\r\nX: a\nSet-Cookie: b\r\n\r\n", "control character"),
            (b"HTTP/1.1 200 OK\r\nX: a\x7fb\r\n\r\n", "control character"),
            (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "without a colon"),
            (b"HTTP/1.1 2_00 OK\r\n\r\n", "status line"),
            (b"HTTP/1.1 +200 OK\r\n\r\n", "status line"),
            (b"HTTP/1.1 200 O\rK\r\n\r\n", "status line"),
        ]
        for raw, words in cases:
            self.assertRefused(raw, words)
        rec, _ = self.answer(b"HTTP/1.1 200 OK\r\nX-Tab: a\tb\r\nX-Latin: caf\xe9\r\nX-Empty:\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(rec.events[0][3][:3], [(b"x-tab", b"a\tb"), (b"x-latin", b"caf\xe9"), (b"x-empty", b"")])
        rec, _ = self.answer(b"HTTP/1.1 204\r\n\r\n")
        self.assertEqual(rec.events[0][:3], ("start", 204, b""))


class Relayer(Recorder):
    """
    A L{Recorder} that takes heads in the common shape as one block
    (C{response_relayed}), as the gateway's proxy does.
    """

    def response_relayed(self, status: int, reason: bytes, block: bytes, length: int) -> None:
        self.events.append(("relayed", status, reason, block, length))


class RelayTests(SynchronousTestCase):
    def test_common_head_relayed_without_own_headers(self) -> None:
        """
        A head with one Content-Length and neither Transfer-Encoding nor
        Connection reaches a relaying handler as one block of its lines,
        as the replica wrote them, less Server, Date, Content-Length,
        Keep-Alive and the other headers a proxy writes itself; the body
        and the connection's reuse are as for any response.
        """
        raw = (
            b"HTTP/1.1 201 Made\r\nServer: fake/1\r\nDate: Tue, 01 Dec 2026 13:27:28 GMT\r\n"
            b"X-Instance: a:1\r\nKeep-Alive: timeout=5\r\nserver-timing: x;dur=1\r\n"
            b"CONTENT-LENGTH:  5\r\nContent-Type: text/plain\r\n\r\nhello"
        )
        for step in (1, 3, len(raw)):
            pool = UpstreamPool(Clock())
            conn, t = connection(pool)
            rec = Relayer()
            conn.send(b"REQUEST", rec)
            feed(conn, raw, step)
            self.assertEqual(
                rec.events[0],
                ("relayed", 201, b"Made",
                 b"\r\nX-Instance: a:1\r\nserver-timing: x;dur=1\r\nContent-Type: text/plain", 5),
            )
            self.assertEqual(rec.data(), b"hello")
            self.assertEqual(rec.events[-1], ("finished",))
            self.assertIs(pool.take(conn.address), conn)

    def test_other_heads_take_the_general_way(self) -> None:
        """
        A head with a Connection or Transfer-Encoding header, two or no
        Content-Lengths, no body by its status, or a blank before a colon
        (which a proxy must remove), is reported to C{response_started}
        with its headers parsed, even to a relaying handler; and HTTP/1.0
        is not kept alive on either way.
        """
        heads = [
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
            # A blank before a colon: the line is rebuilt, not passed on.
            b"HTTP/1.1 200 OK\r\nX-Foo : bar\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX-Foo\t: bar\r\nContent-Length: 2\r\n\r\nok",
        ]
        for raw in heads:
            conn, t = connection(UpstreamPool(Clock()))
            rec = Relayer()
            conn.send(b"REQUEST", rec)
            conn.dataReceived(raw)
            self.assertEqual(rec.events[0][0], "start", raw)
            self.assertEqual(rec.events[-1], ("finished",), raw)
            if b"X-Foo" in raw:
                self.assertIn((b"x-foo", b"bar"), rec.events[0][3])
        pool = UpstreamPool(Clock())
        conn, t = connection(pool)
        rec = Relayer()
        conn.send(b"REQUEST", rec)
        conn.dataReceived(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.assertEqual(rec.events[0], ("relayed", 200, b"OK", b"", 2))
        self.assertIsNone(pool.take(conn.address))
        self.assertTrue(t.disconnecting)

    def test_bad_length_refused_on_either_way(self) -> None:
        """
        A relaying handler hears of a Content-Length that is not a plain
        number as a protocol error, as any handler does.
        """
        class RelayingKeeper(FailureKeeper, Relayer):
            pass

        conn, t = connection()
        rec = RelayingKeeper()
        conn.send(b"REQUEST", rec)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n")
        self.assertEqual(rec.events, [("failed", UpstreamProtocolError, True)])


class TimerTests(SynchronousTestCase):
    def test_one_timer_from_response_to_response(self) -> None:
        """
        The timer a handler arms on a connection calls it when it comes
        due; disarmed, it stays for the connection's next response (armed
        again for later, no new reactor call is made until it comes due)
        and calls nothing when it comes due; it goes with the connection.
        """
        clock = Clock()
        conn, t = connection()
        fired: list[str] = []
        conn.arm(clock, 10, lambda: fired.append("a"))
        (first,) = clock.getDelayedCalls()
        clock.advance(4)
        cb_b = lambda: fired.append("b")  # noqa: E731
        conn.disarm(lambda: None)  # not the armed callback: nothing changes
        conn.arm(clock, 10, cb_b)
        self.assertEqual(clock.getDelayedCalls(), [first])
        clock.advance(9)
        self.assertEqual(fired, [])
        clock.advance(1)
        self.assertEqual(fired, ["b"])
        conn.arm(clock, 10, cb_b)
        conn.disarm(cb_b)
        clock.advance(10)
        self.assertEqual(fired, ["b"])
        self.assertEqual(clock.getDelayedCalls(), [])
        conn.arm(clock, 10, cb_b)
        conn.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_later_while_armed(self) -> None:
        """
        L{UpstreamConnection.later} puts the armed callback's time later
        (or sooner); disarmed, it does nothing.
        """
        clock = Clock()
        conn, t = connection()
        fired: list[str] = []
        cb = lambda: fired.append("x")  # noqa: E731
        conn.arm(clock, 10, cb)
        clock.advance(8)
        conn.later(10)
        clock.advance(9)
        self.assertEqual(fired, [])
        clock.advance(1)
        self.assertEqual(fired, ["x"])
        conn.arm(clock, 10, cb)
        conn.later(2)
        clock.advance(2)
        self.assertEqual(fired, ["x", "x"])
        conn.arm(clock, 10, cb)
        conn.disarm(cb)
        conn.later(1)
        clock.advance(20)
        self.assertEqual(fired, ["x", "x"])

    def test_idle_wait_between_reads(self) -> None:
        """
        Armed with C{idle}, the connection puts the callback C{idle}
        seconds after each read that comes after the response's head and
        leaves the response unfinished; a read of part of the head moves
        nothing, nor does the read that finishes the response.
        """
        clock = Clock()
        conn, t = connection()
        fired: list[str] = []
        conn.send(b"GET / HTTP/1.1\r\n\r\n", Recorder())
        conn.arm(clock, 5, lambda: fired.append("due"), 3)
        clock.advance(4)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\n")  # part of the head: the first wait goes on
        clock.advance(1)
        self.assertEqual(fired, ["due"])
        conn, t = connection()
        conn.send(b"GET / HTTP/1.1\r\n\r\n", Recorder())
        conn.arm(clock, 5, lambda: fired.append("idle"), 3)
        clock.advance(4)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        clock.advance(2.5)
        conn.dataReceived(b"c")
        clock.advance(2.5)
        self.assertEqual(fired, ["due"])
        clock.advance(0.5)
        self.assertEqual(fired, ["due", "idle"])

    def test_finishing_read_moves_no_timer(self) -> None:
        """
        The read that finishes the response leaves the armed time as it was
        (the handler disarms it as it ends).
        """
        clock = Clock()
        conn, t = connection()
        fired: list[str] = []
        conn.send(b"GET / HTTP/1.1\r\n\r\n", Recorder())
        conn.arm(clock, 5, lambda: fired.append("due"), 30)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        clock.advance(5)
        self.assertEqual(fired, ["due"])

    def test_sooner_is_a_new_timer(self) -> None:
        """
        Armed for sooner than its timer is due, the connection calls at the
        sooner time (the later call is dropped).
        """
        clock = Clock()
        conn, t = connection()
        fired: list[str] = []
        conn.arm(clock, 100, lambda: fired.append("late"))
        conn.arm(clock, 5, lambda: fired.append("soon"))
        clock.advance(5)
        self.assertEqual(fired, ["soon"])
        clock.advance(100)
        self.assertEqual(fired, ["soon"])


class ReleaseTests(SynchronousTestCase):
    def test_kept_connection_holds_no_handler(self) -> None:
        """
        A connection kept for the next request holds nothing of the last
        one's handler (a relaying handler holds the client's request and
        connection: kept, every idle connection would keep a closed
        client's).
        """
        pool = UpstreamPool(Clock())
        conn, t = connection(pool)
        rec = Relayer()
        ref = weakref.ref(rec)
        conn.send(b"REQUEST", rec)
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.assertEqual(rec.events[-1], ("finished",))
        del rec
        gc.collect()
        self.assertIsNone(ref())
        self.assertIs(pool.take(conn.address), conn)


class EndTests(SynchronousTestCase):
    def test_ended_connection_freed_at_once(self) -> None:
        """
        A replica connection that has ended, after a response (its timeout
        armed) and kept idle until then, is freed when its last reference
        goes: nothing of it is left for the cyclic garbage collector.
        """

        def run() -> None:
            clock = Clock()
            pool = UpstreamPool(clock)
            conn, t = connection(pool)
            rec = Recorder()
            conn.send(b"REQUEST", rec)
            conn.arm(clock, 30, lambda: None)
            conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            self.assertEqual(rec.events[-1], ("finished",))
            self.assertEqual(pool.idle_count(), 1)
            conn.connectionLost(Failure(ConnectionDone()))
            self.assertEqual(pool.idle_count(), 0)

        self.assertEqual(cyclic_leftovers(run, UpstreamConnection, Deadline), 0)

    def test_connected_through_the_pool_freed_at_once(self) -> None:
        """
        So is a connection the pool made (L{UpstreamPool.connect}): what
        built it does not keep it.
        """

        def run() -> None:
            reactor = MemoryReactorClock()
            pool = UpstreamPool(reactor)
            made: list[UpstreamConnection] = []
            pool.connect("127.0.0.1:8000").addCallback(made.append)
            host, port, factory = reactor.tcpClients[0][:3]
            factory.buildProtocol(IPv4Address("TCP", host, port)).makeConnection(StringTransport())
            conn = made.pop()
            conn.send(b"REQUEST", Recorder())
            conn.arm(reactor, 30, lambda: None)
            conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            conn.connectionLost(Failure(ConnectionDone()))

        self.assertEqual(cyclic_leftovers(run, UpstreamConnection, Deadline), 0)

    def test_connect_builds_the_pools_connection(self) -> None:
        """
        L{UpstreamPool.connect} connects to the address given and fires with
        the connection built for it, once the connection is made.
        """
        reactor = MemoryReactorClock()
        pool = UpstreamPool(reactor)
        made: list[UpstreamConnection] = []
        pool.connect("127.0.0.1:8000").addCallback(made.append)
        host, port, factory = reactor.tcpClients[0][:3]
        self.assertEqual((host, port), ("127.0.0.1", 8000))
        self.assertEqual(made, [])
        factory.buildProtocol(IPv4Address("TCP", host, port)).makeConnection(StringTransport())
        self.assertEqual(len(made), 1)
        self.assertIsInstance(made[0], UpstreamConnection)
        self.assertEqual(made[0].address, "127.0.0.1:8000")
        self.assertTrue(made[0].connected_)
