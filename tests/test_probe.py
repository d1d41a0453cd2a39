"""
Tests for L{llmgw.agent.probe}: the HTTP health probe, on a memory reactor.
"""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.probe import HttpProber


class HttpProberTests(SynchronousTestCase):
    """
    L{HttpProber} with no server answering.
    """

    def test_no_answer_in_time(self) -> None:
        """
        A probe connects to the URL's host and port, and has failed once its
        timeout passed with no answer.
        """
        reactor = MemoryReactorClock()
        d = HttpProber(reactor, timeout=2).probe("http://127.0.0.1:8001/health")
        ((host, port, _, _, _),) = reactor.tcpClients
        self.assertEqual((host, port), ("127.0.0.1", 8001))
        reactor.advance(1.9)
        self.assertNoResult(d)
        reactor.advance(0.1)
        self.failureResultOf(d)
