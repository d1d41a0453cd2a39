"""
Tests for L{llmgw.transportpeek}: each private attribute of
Twisted's TCP transport it reads, pinned by a test that fails when Twisted
renames, drops or changes the meaning of it; the Twisted range it vouches
for, and setup.cfg's bound on Twisted, the same; and its fallback.

The transports are real L{twisted.internet.tcp.Server}s around one end of
a socket pair, on a L{MemoryReactorClock}: their sends are real, and the
tests drive C{doWrite} themselves.
"""

from __future__ import annotations

import configparser
import re
import socket
from pathlib import Path

from twisted.internet import tcp
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw import transportpeek
from llmgw.transportpeek import (
    ATTRIBUTES,
    TWISTED_RANGE,
    busy,
    queued,
    raw_socket,
    reactor_of,
)

ROOT = Path(__file__).resolve().parent.parent
#: More than a socket pair's buffers take, and several of Twisted's sends.
BIG = 4 * 1024 * 1024


class _Connected(SynchronousTestCase):
    """
    Builds a connected Twisted TCP transport on a memory reactor.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        mine, self.peer = socket.socketpair()
        self.peer.setblocking(False)
        self.addCleanup(self.peer.close)
        self.addCleanup(mine.close)
        self.sock = mine
        self.protocol = Protocol()
        self.t = tcp.Server(mine, self.protocol, ("127.0.0.1", 1), None, 1, self.reactor)
        self.protocol.makeConnection(self.t)

    def drain(self) -> int:
        """
        Read everything the peer has been sent so far; return how much.
        """
        n = 0
        while True:
            try:
                got = self.peer.recv(1024 * 1024)
            except BlockingIOError:
                return n
            if not got:
                return n
            n += len(got)

    def partly_sent(self) -> None:
        """
        Write L{BIG} bytes and let Twisted send once: part went, the rest
        waits in the transport.
        """
        self.t.write(b"x" * BIG)
        self.t.doWrite()


class AttributeTests(_Connected):
    """
    One test per name in L{ATTRIBUTES}, named C{test_<name>}; each reads
    the attribute itself, so a rename fails it outright.
    """

    def test_idle_transport(self) -> None:
        """
        A connected transport with nothing written is vouched for, holds
        nothing and is not busy.
        """
        self.assertIs(raw_socket(self.t), self.sock)
        self.assertFalse(queued(self.t))
        self.assertFalse(busy(self.t))

    def test__tempDataLen(self) -> None:
        """
        C{_tempDataLen} counts bytes written since Twisted last sent:
        written bytes are queued.
        """
        self.t.write(b"abc")
        self.assertEqual(self.t._tempDataLen, 3)
        self.assertTrue(queued(self.t))
        self.assertTrue(busy(self.t))

    def test_dataBuffer(self) -> None:
        """
        C{dataBuffer} holds what Twisted is sending once it moved the
        written bytes there (C{_tempDataLen} back to 0): still queued.
        """
        self.partly_sent()
        self.assertEqual((self.t._tempDataLen, len(self.t.dataBuffer)), (0, BIG))
        self.assertTrue(queued(self.t))

    def test_offset(self) -> None:
        """
        C{offset} is how far into C{dataBuffer} the socket has taken:
        exactly what the peer can read; once all is sent, both are reset
        and nothing is queued.
        """
        self.partly_sent()
        self.assertEqual(self.t.offset, self.drain())
        self.assertTrue(0 < self.t.offset < BIG)
        for _ in range(10_000):
            if not self.t.dataBuffer:
                break
            self.t.doWrite()
            self.drain()
        self.assertEqual((self.t.offset, self.t.dataBuffer), (0, b""))
        self.assertFalse(queued(self.t))
        self.assertFalse(busy(self.t))

    def test_disconnecting(self) -> None:
        """
        C{disconnecting} is set by C{loseConnection}: busy.
        """
        self.t.loseConnection()
        self.assertTrue(self.t.disconnecting)
        self.assertFalse(queued(self.t))
        self.assertTrue(busy(self.t))

    def test_connected(self) -> None:
        """
        C{connected} is true while the connection is open and false once it
        was lost: busy then.
        """
        self.assertTrue(self.t.connected)
        self.t.connectionLost(Failure(ConnectionDone()))
        self.assertFalse(self.t.connected)
        self.assertTrue(busy(self.t))

    def test__writeDisconnecting(self) -> None:
        """
        C{_writeDisconnecting} is set by C{loseWriteConnection}, before
        the sending side is shut: busy.
        """
        self.t.loseWriteConnection()
        self.assertEqual((self.t._writeDisconnecting, self.t._writeDisconnected), (True, False))
        self.assertFalse(queued(self.t))
        self.assertTrue(busy(self.t))

    def test__writeDisconnected(self) -> None:
        """
        C{_writeDisconnected} is set once Twisted shut the sending side
        after C{loseWriteConnection} (its next C{doWrite}): busy.
        """
        self.t.loseWriteConnection()
        self.t.doWrite()
        self.assertTrue(self.t._writeDisconnected)
        self.assertEqual(self.peer.recv(10), b"")
        self.assertTrue(busy(self.t))

    def test__aborting(self) -> None:
        """
        C{_aborting} is set by C{abortConnection}, while the connection is
        still open: busy.
        """
        self.t.abortConnection()
        self.assertTrue(self.t._aborting)
        self.assertTrue(self.t.connected)
        self.assertTrue(busy(self.t))
        self.reactor.advance(0)

    def test_reactor(self) -> None:
        """
        C{reactor} is the reactor the transport was made on.
        """
        self.assertIs(self.t.reactor, self.reactor)
        self.assertIs(reactor_of(self.t), self.reactor)

    def test_every_attribute_has_its_test(self) -> None:
        """
        Each name in L{ATTRIBUTES} has its C{test_<name>} here.
        """
        missing = [name for name in ATTRIBUTES if not hasattr(self, f"test_{name}")]
        self.assertEqual(missing, [])


class FallbackTests(_Connected):
    """
    When L{raw_socket} refuses a transport, and so the public C{write}.
    """

    def test_not_tcp(self) -> None:
        """
        A transport that is not Twisted's TCP one gets no socket.
        """
        self.assertIsNone(raw_socket(StringTransport()))

    def test_attribute_missing(self) -> None:
        """
        A TCP transport lacking one of the attributes gets no socket.
        """
        del self.t._tempDataLen
        self.assertIsNone(raw_socket(self.t))

    def test_twisted_outside_the_range(self) -> None:
        """
        A Twisted outside L{TWISTED_RANGE} gets no socket; the range's
        first release is in it, its end is not.
        """
        low, high = TWISTED_RANGE
        self.assertIs(raw_socket(self.t, low), self.sock)
        self.assertIsNone(raw_socket(self.t, high))
        self.assertIsNone(raw_socket(self.t, (low[0] - 1, 12)))


class RangeTests(SynchronousTestCase):
    """
    The Twisted installed, the adapter's range, and setup.cfg's bound.
    """

    def test_installed_twisted_in_range(self) -> None:
        """
        The Twisted these tests run on lies in L{TWISTED_RANGE}: a CI that
        installs one outside setup.cfg's bound fails here.
        """
        release = transportpeek.installed_twisted()
        self.assertTrue(transportpeek.twisted_in_range(), f"Twisted {release} is outside {TWISTED_RANGE}")

    def test_installed_release(self) -> None:
        """
        The installed release read as C{twisted.version} has it.
        """
        from twisted import version

        self.assertEqual(transportpeek.installed_twisted(), (version.major, version.minor))

    def test_setup_cfg_bound_is_the_range(self) -> None:
        """
        setup.cfg requires Twisted from the range's first release up to,
        not including, its end.
        """
        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "setup.cfg")
        requires = cfg["options"]["install_requires"]
        m = re.search(r"^twisted\[tls\]>=(\d+)\.(\d+)(?:\.\d+)?,<(\d+)(?:\.(\d+))?$", requires, re.M)
        assert m is not None, requires
        low = (int(m[1]), int(m[2]))
        high = (int(m[3]), int(m[4] or 0))
        self.assertEqual((low, high), TWISTED_RANGE)
