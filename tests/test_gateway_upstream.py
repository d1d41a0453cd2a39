"""
The gateway's HTTP/1.1 client to replicas, through a StringTransport.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.upstream import UpstreamConnection, UpstreamPool, UpstreamProtocolError


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
