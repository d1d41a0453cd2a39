"""
Tests for the pure parts of C{bench/abuse.py}: how its figures are made
from what it recorded, the bars' judgement, and the adversarial bodies and
frames its attacks send.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from bench.abuse_attacks import big_bodies, ws_frame
from bench.abuse_summary import judge, latency_summary, refused, resource_summary


def sample(stream: str, due: float, ms: float, status: int | str = 200) -> tuple[str, float, float, int | str]:
    return (stream, due, due + ms / 1000, status)


def resources(before_kb: int, peak_kb: int) -> dict[str, Any]:
    return resource_summary([(0.5, before_kb, 10), (1.5, peak_kb, 20), (2.5, before_kb, 11)],
                            (0, 1), (1, 2), (2, 3))


class SummaryTests(SynchronousTestCase):
    def test_refused(self) -> None:
        """
        Only a 2xx answer counts as served: an HTTP error, and a request
        that got no answer at all, are refusals.
        """
        self.assertFalse(refused(200))
        self.assertFalse(refused(204))
        for status in (401, 408, 429, 503, 101, "error:ConnectionResetError", "error:TimeoutError"):
            self.assertTrue(refused(status), status)

    def test_latency_by_due_time(self) -> None:
        """
        A request belongs to the window its due time falls in (not when
        it was answered), per stream, with its latency from the due time;
        refusals and statuses are counted.
        """
        samples = [sample("chat", 0.1 * i, 1.0 + i) for i in range(10)]
        samples.append(sample("chat", 0.95, 5000.0, "error:TimeoutError"))
        samples.append(sample("models", 1.5, 3.0, 401))
        first = latency_summary(samples, 0.0, 1.0)
        self.assertEqual(list(first), ["chat"])
        self.assertEqual(first["chat"]["n"], 11)
        self.assertEqual(first["chat"]["p50_ms"], 6.0)
        self.assertEqual(first["chat"]["p99_ms"], 5000.0)
        self.assertEqual(first["chat"]["refused"], 1)
        self.assertEqual(first["chat"]["statuses"], {"200": 10, "error:TimeoutError": 1})
        second = latency_summary(samples, 1.0, 2.0)
        self.assertEqual(second["models"]["refused"], 1)

    def test_resources(self) -> None:
        """
        RSS and descriptors: before is the baseline window's last sample,
        the peak is the attack window's highest, after is the last sample
        of the after window; samples without a descriptor count are
        skipped for descriptors only.
        """
        samples = [(0.1, 100 * 1024, 30), (0.9, 110 * 1024, None), (1.2, 300 * 1024, 900),
                   (1.8, 200 * 1024, None), (2.2, 150 * 1024, 40), (2.9, 120 * 1024, None)]
        out = resource_summary(samples, (0, 1), (1, 2), (2, 3))
        self.assertEqual(out["rss_mib"], {"before": 110.0, "peak_during": 300.0, "after": 120.0})
        self.assertEqual(out["fds"], {"before": 30, "peak_during": 900, "after": 40})


class JudgeTests(SynchronousTestCase):
    def attack(self, **p99: float | None) -> dict[str, Any]:
        return {name: {"p99_ms": v, "refused": 0} for name, v in p99.items()}

    def test_all_bars_met(self) -> None:
        """
        Every stream's p99 under 50 ms, RSS within baseline + 100 MiB and
        no refusal: every bar and the whole pass, with the values shown.
        """
        bars = judge(self.attack(chat=12.0, models=3.0), resources(100 * 1024, 150 * 1024))
        self.assertTrue(bars["passed"])
        self.assertEqual(bars["p99_under_50ms"]["value_ms"], 12.0)
        self.assertEqual(bars["rss_under_baseline_plus_100mib"]["growth_mib"], 50.0)

    def test_each_bar_fails_alone(self) -> None:
        """
        A p99 of 50 ms or more on any stream, a growth of 100 MiB or more,
        or a single refusal each fails its bar and the whole.
        """
        slow = judge(self.attack(chat=12.0, admin=50.0), resources(100 * 1024, 101 * 1024))
        self.assertFalse(slow["p99_under_50ms"]["passed"])
        self.assertTrue(slow["rss_under_baseline_plus_100mib"]["passed"])
        self.assertFalse(slow["passed"])
        grown = judge(self.attack(chat=1.0), resources(100 * 1024, 200 * 1024))
        self.assertFalse(grown["rss_under_baseline_plus_100mib"]["passed"])
        self.assertFalse(grown["passed"])
        one_refused = self.attack(chat=1.0)
        one_refused["chat"]["refused"] = 1
        bars = judge(one_refused, resources(100 * 1024, 100 * 1024))
        self.assertFalse(bars["no_legitimate_request_refused"]["passed"])
        self.assertFalse(bars["passed"])

    def test_nothing_measured_fails(self) -> None:
        """
        No well-behaved sample during the attack, or no RSS sample, fails
        rather than passing for want of evidence.
        """
        self.assertFalse(judge({}, resources(100 * 1024, 100 * 1024))["passed"])
        self.assertFalse(judge(self.attack(chat=None), resources(100 * 1024, 100 * 1024))["passed"])
        empty = resource_summary([], (0, 1), (1, 2), (2, 3))
        self.assertFalse(judge(self.attack(chat=1.0), empty)["passed"])


class AttackPartsTests(SynchronousTestCase):
    def test_big_bodies(self) -> None:
        """
        Each adversarial body fits the limit, with C{model} its last key;
        the flat ones are valid JSON, the deep one is balanced brackets.
        """
        bodies = big_bodies(64 * 1024, "bench")
        self.assertEqual(set(bodies), {"many_keys", "deep", "many_messages"})
        for name, body in bodies.items():
            self.assertLessEqual(len(body), 64 * 1024, name)
            self.assertGreater(len(body), 60 * 1024, name)
            self.assertTrue(body.endswith(b'"model": "bench"}'), name)
        keys = json.loads(bodies["many_keys"])
        self.assertEqual(list(keys)[-1], "model")
        self.assertGreater(len(keys["x"]), 5000)
        self.assertGreater(len(json.loads(bodies["many_messages"])["messages"]), 1000)
        deep = bodies["deep"]
        self.assertEqual(deep.count(b"["), deep.count(b"]"))
        self.assertIn(b"[" * 10000, deep)

    def test_ws_frame(self) -> None:
        """
        A masked text frame with the 7-bit length up to 125 bytes and the
        16-bit one above.
        """
        self.assertEqual(ws_frame(b"hi"), b"\x81\x82\0\0\0\0hi")
        long = ws_frame(b"x" * 300)
        self.assertEqual(long[:4], b"\x81\xfe\x01\x2c")
        self.assertEqual(len(long), 4 + 4 + 300)
