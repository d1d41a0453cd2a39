"""
What `twistd llmgw control` says at start-up about traps in its
configuration: an embedded gateway other machines reach but that serves no
names they use, and an open-file limit too small for what it may hold.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

import llmgw.control.service as service
from llmgw.control.service import ControlPlane, Options, makeService


def control(*args: str) -> ControlPlane:
    o = Options()
    o.parseOptions(["--insecure", "--agents", "127.0.0.1:0", "--admin", "off", *args])
    return makeService(o, reactor=MemoryReactorClock())


def warnings_of_start(case: SynchronousTestCase, cp: ControlPlane) -> list[str]:
    """
    Start and stop C{cp}; the warnings it logged, formatted.
    """
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        cp.startService()
    finally:
        globalLogPublisher.removeObserver(events.append)
        cp.stopService()
    return [formatEvent(e) for e in events if getattr(e.get("log_level"), "name", "") == "warn"]


class StartupWarningTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.asked: list[list[Any]] = []

        def problem(needs: Any) -> str:
            self.asked.append(list(needs))
            return "the open-file limit is too small"

        self.patch(service, "fd_limit_problem", problem)

    def test_exposed_gateway_without_names(self) -> None:
        """
        An embedded gateway on 0.0.0.0 with no C{--gateway-hosts} warns
        once that other machines' requests get 421, naming the option; one
        with names listed does not.
        """
        warned = warnings_of_start(self, control("--gateway", "0.0.0.0:8000"))
        [line] = [w for w in warned if "421" in w]
        self.assertIn("--gateway-hosts", line)
        named = warnings_of_start(self, control("--gateway", "0.0.0.0:8000", "--gateway-hosts", "gw.example"))
        self.assertEqual([w for w in named if "421" in w], [])

    def test_one_open_file_check(self) -> None:
        """
        The open-file limit is checked once for the whole process: the
        agent port's connections under its C{--max-connections}, and the
        embedded gateway's client and upstream connections under its
        C{--gateway-max-connections}; the one warning is logged once.
        """
        warned = warnings_of_start(self, control("--max-connections", "100"))
        [needs] = self.asked
        self.assertEqual([(n.count, n.option) for n in needs],
                         [(100, "--max-connections"), (20_000, "--gateway-max-connections")])
        self.assertIn("agent port", needs[0].what)
        self.assertEqual(warned.count("the open-file limit is too small"), 1)

    def test_gateway_cap(self) -> None:
        """
        C{--gateway-max-connections} caps the embedded gateway's clients, and
        the check counts two files for each.
        """
        cp = control("--gateway-max-connections", "50")
        self.assertEqual(cp.gateway.site.max_connections, 50)
        warnings_of_start(self, cp)
        [needs] = self.asked
        self.assertEqual(needs[1].count, 100)

    def test_without_gateway(self) -> None:
        """
        With C{--gateway off} only the agent port counts.
        """
        warnings_of_start(self, control("--gateway", "off"))
        [needs] = self.asked
        self.assertEqual([n.option for n in needs], ["--max-connections"])
