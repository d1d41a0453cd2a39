"""
Tests for L{llmgw.wslog}: autobahn's debug dumps (each watch client's
configuration, handshake and frames) stay out of the log unless txaio's
level asks for them.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from txaio import tx

from llmgw.wslog import WebSocketLogger
from tests.test_watch import WatchTestCase


class LoggerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.log = WebSocketLogger(observer=self.events.append)
        self.addCleanup(tx.set_global_log_level, tx.get_global_log_level())

    def test_debug_dropped_by_default(self) -> None:
        """
        At txaio's default level a debug event is dropped; info and above
        are logged.
        """
        tx.set_global_log_level("info")
        self.log.debug("dump {x}", x=1)
        self.log.info("opened")
        self.log.warn("dropped")
        self.assertEqual([e["log_level"] for e in self.events], [LogLevel.info, LogLevel.warn])

    def test_debug_when_asked(self) -> None:
        """
        With txaio's global level at debug, debug events are logged.
        """
        tx.set_global_log_level("debug")
        self.log.debug("dump {x}", x=1)
        self.assertEqual([e["log_level"] for e in self.events], [LogLevel.debug])


class WatchStreamTests(WatchTestCase):
    def test_no_debug_from_a_watch_client(self) -> None:
        """
        A watch client connecting, upgrading and reading its snapshot puts
        no debug event into the log (autobahn logs dozens through the
        protocol's logger).
        """
        self.addCleanup(tx.set_global_log_level, tx.get_global_log_level())
        tx.set_global_log_level("info")
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        try:
            client = self.connect()
        finally:
            globalLogPublisher.removeObserver(events.append)
        self.assertIn(b" 101 ", client.status)
        self.assertEqual([e for e in events if e.get("log_level") == LogLevel.debug], [])
