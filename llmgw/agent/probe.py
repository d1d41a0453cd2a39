"""
The health probe a shard is judged by: one HTTP GET that must answer 200
in time. L{llmgw.agent.health} decides what the answers mean.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.web.client import Agent, HTTPConnectionPool, readBody


class _QuietPool(HTTPConnectionPool):
    # Not a "Starting factory" log line per probe.
    class _factory(HTTPConnectionPool._factory):  # type: ignore[valid-type,misc]
        noisy = False


class HttpProber:
    """
    Health probes over HTTP: a GET that must answer 200 within C{timeout}
    seconds, connection included, on a new connection each time.
    """

    def __init__(self, reactor: Any, timeout: float = 5.0):
        self.reactor = reactor
        self.timeout = timeout
        self.agent = Agent(reactor, connectTimeout=timeout,
                           pool=_QuietPool(reactor, persistent=False))

    def probe(self, url: str) -> defer.Deferred[Any]:
        """
        GET C{url}: fires once the whole answer is read if it was a 200;
        fails with C{ValueError("HTTP <code>")} for another code, with
        L{defer.TimeoutError} when no answer came in time, and with the
        connection's error when there is none.
        """
        d: defer.Deferred[Any] = self.agent.request(b"GET", url.encode())

        def check(response: Any) -> Any:
            body = readBody(response)

            def code(_: Any) -> None:
                if response.code != 200:
                    raise ValueError(f"HTTP {response.code}")

            return body.addCallback(code)

        d.addCallback(check)
        d.addTimeout(self.timeout, self.reactor)
        return d
