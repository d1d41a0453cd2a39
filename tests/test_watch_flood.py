"""
Tests for the watch socket's bounds on requests (L{llmgw.control.admin.websocket}):
a token bucket per socket, a flood closed with 1008, and a socket not read
while its answers wait unwritten.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.websocket import (
    FLOOD_CLOSE_GRACE,
    FLOOD_REFUSALS,
    REQUEST_BURST,
    REQUEST_RATE,
    RequestBudget,
)
from tests.test_watch import WatchClient, WatchTestCase, parse_frames


def frame(message: Any) -> bytes:
    """
    C{message} as a masked client text frame.
    """
    payload = json.dumps(message).encode()
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def request(rid: int, path: str = "/api/v1/nodes") -> dict[str, Any]:
    return {"type": "request", "id": rid, "method": "GET", "path": path}


class RequestBudgetTests(SynchronousTestCase):
    def test_bucket(self) -> None:
        """
        A budget takes C{burst} requests at once, then one per C{1/rate}
        seconds, and refills to C{burst} at most.
        """
        budget = RequestBudget(3, 2.0, now=0.0)
        self.assertEqual([budget.take(0.0) for _ in range(4)], [True, True, True, False])
        self.assertTrue(budget.take(0.5))
        self.assertFalse(budget.take(0.5))
        self.assertEqual([budget.take(100.0) for _ in range(4)], [True, True, True, False])


class RateTests(WatchTestCase):
    def statuses(self, c: WatchClient) -> list[tuple[Any, int]]:
        return [(m["id"], m["status"]) for m in c.read() if m["type"] == "response"]

    def test_normal_rate_never_refused(self) -> None:
        """
        A client that sends at the rate, or a burst after a pause, is
        never refused.
        """
        c = self.connect()
        got = []
        for i in range(3 * int(REQUEST_RATE)):
            c.send(request(i))
            self.clock.advance(1 / REQUEST_RATE)
            got += self.statuses(c)
        self.clock.advance(REQUEST_BURST / REQUEST_RATE)
        for i in range(REQUEST_BURST):
            c.send(request(1000 + i))
        got += self.statuses(c)
        self.assertEqual({status for _, status in got}, {200})
        self.assertEqual(len(got), 3 * int(REQUEST_RATE) + REQUEST_BURST)

    def test_over_the_rate_refused(self) -> None:
        """
        Requests past the burst are answered 429 with their ids and a
        message saying why, logged once with who sent them; the socket
        stays open and serves again once the bucket refills.
        """
        c = self.connect()
        logged: list[dict[str, Any]] = []
        c.websocket.log = Logger(observer=logged.append)
        for i in range(REQUEST_BURST + 5):
            c.send(request(i))
        got = [m for m in c.read() if m["type"] == "response"]
        self.assertEqual([m["status"] for m in got], [200] * REQUEST_BURST + [429] * 5)
        self.assertEqual([m["id"] for m in got[-5:]], list(range(REQUEST_BURST, REQUEST_BURST + 5)))
        self.assertIn("requests a second on this socket", got[-1]["body"]["error"])
        self.assertEqual(len([e for e in logged if "faster than" in e["log_format"]]), 1)
        self.assertFalse(c.transport.disconnecting)
        self.clock.advance(1)
        c.send(request(99))
        self.assertEqual(self.statuses(c), [(99, 200)])

    def test_flood_closed(self) -> None:
        """
        20,000 requests sent at once cost at most a burst of answers and
        L{FLOOD_REFUSALS} refusals: then the socket is closed with 1008
        and the rest is not read. Another client is answered at once.
        """
        other = self.connect()
        c = self.connect()
        logged: list[dict[str, Any]] = []
        c.websocket.log = Logger(observer=logged.append)
        rendered = []
        resource = c.websocket.resource
        render = resource.render
        resource.render = lambda request: (rendered.append(request), render(request))[1]
        self.addCleanup(setattr, resource, "render", render)
        c.websocket.dataReceived(b"".join(frame(request(i)) for i in range(20_000)))
        self.assertEqual(len(rendered), REQUEST_BURST)
        frames, _ = parse_frames(c.transport.value())
        answers = [json.loads(p) for op, p in frames if op == 1]
        self.assertEqual([m["status"] for m in answers], [200] * REQUEST_BURST + [429] * FLOOD_REFUSALS)
        [(_, close)] = [(op, p) for op, p in frames if op == 8]
        self.assertEqual(int.from_bytes(close[:2], "big"), 1008)
        self.assertIn(b"requests a second", close)
        self.assertLess(len(c.transport.value()), 64 * 1024)
        self.assertTrue(c.transport.disconnecting)
        self.assertTrue(any("closing" in e["log_format"] for e in logged))
        other.send(request(1))
        self.assertEqual(self.statuses(other), [(1, 200)])

    def test_flood_close_bounded(self) -> None:
        """
        A flooding socket whose close frame cannot go out (its peer reads
        nothing) is aborted after L{FLOOD_CLOSE_GRACE} seconds; one that
        closes in time leaves no timer behind.
        """
        flood = b"".join(frame(request(i)) for i in range(REQUEST_BURST + FLOOD_REFUSALS + 1))
        stuck, gone = self.connect(), self.connect()
        aborted: list[bool] = []
        stuck.transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
        stuck.websocket.dataReceived(flood)
        gone.websocket.dataReceived(flood)
        gone.disconnect()
        self.clock.advance(FLOOD_CLOSE_GRACE)
        self.assertEqual(aborted, [True])
        self.assertFalse(any(c.active() and c.func == gone.transport.abortConnection
                             for c in self.clock.getDelayedCalls()))


class UnreadTests(WatchTestCase):
    def test_not_read_while_answers_wait(self) -> None:
        """
        While a socket's answers wait unwritten (its transport paused us),
        the socket is not read; it is read again once they drain.
        """
        c = self.connect()
        self.assertEqual(c.transport.producerState, "producing")
        c.transport.producer.pauseProducing()
        self.assertEqual(c.transport.producerState, "paused")
        c.transport.producer.resumeProducing()
        self.assertEqual(c.transport.producerState, "producing")

    def test_flooded_socket_stays_unread(self) -> None:
        """
        A socket closed as a flood is not read again, even when its
        transport drains.
        """
        c = self.connect()
        c.websocket.dataReceived(b"".join(frame(request(i)) for i in range(REQUEST_BURST + FLOOD_REFUSALS + 1)))
        self.assertTrue(c.websocket.flooded)
        c.websocket.resumed()
        self.assertNotEqual(c.transport.producerState, "producing")
