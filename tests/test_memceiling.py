"""
The memory ceiling (llmgw.memceiling) and the gateway's shedding under it:
resident memory read on a clock, never per request; shedding from the
high-water mark until under the low one, logged when it starts and stops;
new requests refused with 503 on their head, before their body is read;
requests already admitted carry on; options for the standalone and the
embedded gateway, refused where the process's memory cannot be read; and
freed memory returned to the system after a large burst (llmgw.memtrim).
"""

from __future__ import annotations

import sys
from unittest import mock

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python import usage
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.gateway.proxy import GatewayConfig
from llmgw.gateway.service import GatewayService
from llmgw.gateway.service import Options as GatewayOptions
from llmgw.gateway.service import makeService as gateway_make_service
from llmgw.memceiling import POLL_S, MemoryCeiling, MemoryCeilingError, check_readable, read_rss
from llmgw.memtrim import GrowthTrimmer, Trimmer, growth_trimmer, malloc_trim
from llmgw.routing import RoutingTable
from tests.test_gateway_admission import KEYS, OK, Gw
from tests.test_gateway_resource import LogCapture, error_of, parse, post

MIB = 1024 * 1024


class FakeRSS:
    """
    An RSS reader that says what the test sets, and counts its reads.
    """

    def __init__(self, rss: int = 0):
        self.rss = rss
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        if isinstance(self.rss, Exception):
            raise self.rss
        return self.rss


class CeilingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.rss = FakeRSS(100 * MIB)
        self.ceiling = MemoryCeiling(self.clock, 1000 * MIB, self.rss)
        self.ceiling.startService()
        self.addCleanup(self.ceiling.stopService)

    def at(self, rss: int) -> bool:
        self.rss.rss = rss
        self.clock.advance(POLL_S)
        return self.ceiling.shedding

    def test_hysteresis(self) -> None:
        """
        Shedding starts once the RSS reaches 90% of the ceiling and stops
        only under 80%: between the two marks it stays as it was.
        """
        self.assertEqual(
            [self.at(m * MIB) for m in (899, 900, 850, 801, 799, 850, 899, 950)],
            [False, True, True, True, False, False, False, True],
        )

    def test_polled_on_the_clock(self) -> None:
        """
        The RSS is read at start and then once each interval of the
        injected clock, not otherwise; reading stops with the service.
        """
        self.assertEqual(self.rss.reads, 1)
        self.clock.pump([POLL_S / 2] * 20)
        self.assertEqual(self.rss.reads, 11)
        self.ceiling.stopService()
        self.clock.pump([POLL_S] * 10)
        self.assertEqual(self.rss.reads, 11)

    def test_logged_when_it_starts_and_stops(self) -> None:
        """
        One line when shedding starts (naming the ceiling and its option),
        one when it stops (with the count refused meanwhile), none per
        poll or per request in between.
        """
        logs = LogCapture(self)
        self.at(950 * MIB)
        for _ in range(3):
            self.ceiling.refused()
            self.at(960 * MIB)
        self.at(700 * MIB)
        self.at(710 * MIB)
        lines = [line for line in logs.text().splitlines() if "resident memory" in line]
        self.assertEqual(len(lines), 2, lines)
        self.assertIn("ceiling of 1000 MiB (--memory-limit)", lines[0])
        self.assertIn("(3 refused meanwhile)", lines[1])

    def test_failed_read(self) -> None:
        """
        A read that fails is logged once (until one works), changes
        nothing, and the polling goes on.
        """
        self.at(950 * MIB)
        self.rss.rss = OSError("gone")  # type: ignore[assignment]
        self.clock.advance(POLL_S * 3)
        self.assertTrue(self.ceiling.shedding)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertFalse(self.at(10 * MIB))

    def test_metrics(self) -> None:
        """
        /metrics tells whether the ceiling sheds, its limit and the
        requests it refused.
        """
        registry = CollectorRegistry()
        self.ceiling.register(registry)
        self.at(950 * MIB)
        self.ceiling.refused()
        self.assertEqual(registry.get_sample_value("llmgw_gateway_memory_shedding"), 1)
        self.assertEqual(registry.get_sample_value("llmgw_gateway_memory_shed_requests_total"), 1)
        self.assertEqual(registry.get_sample_value("llmgw_gateway_memory_limit_bytes"), 1000 * MIB)

    def test_bad_marks(self) -> None:
        """
        Marks out of order are refused when the ceiling is made.
        """
        self.assertRaises(ValueError, MemoryCeiling, self.clock, MIB, self.rss, high=0.8, low=0.9)


class RSSTests(SynchronousTestCase):
    def test_reads_this_process(self) -> None:
        """
        On Linux, L{read_rss} gives this process's resident memory, a
        plausible number of bytes.
        """
        if not sys.platform.startswith("linux"):
            raise SkipTest("/proc/self/statm is Linux's")
        self.assertTrue(MIB < read_rss() < 1 << 40)
        check_readable()

    def test_missing_proc(self) -> None:
        """
        Where the statm file cannot be read, the check says what is missing.
        """
        e = self.assertRaises(MemoryCeilingError, check_readable, self.mktemp())
        self.assertIn("works on Linux only", str(e))


class ShedTests(SynchronousTestCase):
    """
    A gateway under a ceiling, driven in memory.
    """

    def setUp(self) -> None:
        self.rss = FakeRSS(0)
        self.gw = Gw()
        self.ceiling = MemoryCeiling(self.gw.clock, 1000, self.rss)
        self.gw.site.resource.ceiling = self.ceiling
        self.ceiling.startService()
        self.addCleanup(self.ceiling.stopService)

    def shed(self, on: bool) -> None:
        self.rss.rss = 1000 if on else 0
        self.gw.clock.advance(POLL_S)

    def head_only(self, path: bytes = b"/v1/chat/completions", key: str | None = "alice") -> StringTransport:
        """
        A request whose head announces a body that is never sent.
        """
        proto = self.gw.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        auth = b"Authorization: Bearer " + KEYS[key].encode() + b"\r\n" if key else b""
        proto.dataReceived(post(b"x" * 1000, path=path, extra=auth)[:-1000])
        return client

    def test_refused_on_the_head(self) -> None:
        """
        While the ceiling sheds, a request is answered 503 C{overloaded}
        with C{Retry-After} as soon as its head is read, before any byte
        of its body arrives, and counted; once it stops, requests go on.
        """
        self.shed(True)
        status, headers, body = parse(self.head_only().value())
        err = error_of(body)
        self.assertEqual((status, err["code"], err["type"]), (503, "overloaded", "server_error"))
        self.assertEqual(dict(headers)[b"retry-after"], b"5")
        self.assertIn("short of memory", err["message"])
        self.assertEqual(self.ceiling.shed, 1)
        self.shed(False)
        self.assertEqual(self.head_only().value(), b"")

    def test_key_checked_first_and_health_answered(self) -> None:
        """
        A request without a key is told so (401), not to retry later; and
        C{/health} is answered while shedding.
        """
        self.shed(True)
        self.assertEqual(parse(self.head_only(key=None).value())[0], 401)
        proto = self.gw.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.assertEqual(parse(client.value())[0], 200)
        self.assertEqual(self.ceiling.shed, 0)

    def test_admitted_requests_carry_on(self) -> None:
        """
        A request already waiting in the admission queue when shedding
        starts is still sent on and answered.
        """
        client = self.gw.send()
        self.shed(True)
        self.gw.ready("r1")
        [(conn, _)] = self.gw.new_upstreams()
        conn.dataReceived(OK)
        self.assertEqual(parse(client.value())[:3:2], (200, b"ok"))


class OptionsTests(SynchronousTestCase):
    def test_standalone(self) -> None:
        """
        C{--memory-limit} takes a size with a binary unit and becomes the
        gateway's ceiling, offered in its /metrics; C{--queue-bytes} and
        C{--queue-bytes-per-model} set the queue's budgets (64 MiB and 256
        MiB when not given); no ceiling by default.
        """
        from llmgw.gateway.service import makeService

        o = GatewayOptions()
        o.parseOptions(["--metrics", "off", "--gateway", "0"])
        c = o.config()
        self.assertEqual((c.queue_bytes_per_model, c.queue_bytes, o["memory-limit"]), (64 * MIB, 256 * MIB, 0))
        self.assertIsNone(makeService(o, MemoryReactorClock()).front.ceiling)
        o = GatewayOptions()
        o.parseOptions(["--metrics", "off", "--gateway", "0", "--memory-limit", "1.5GiB",
                        "--queue-bytes", "512MiB", "--queue-bytes-per-model", "1048576"])
        c = o.config()
        self.assertEqual((c.queue_bytes_per_model, c.queue_bytes), (MIB, 512 * MIB))
        svc = makeService(o, MemoryReactorClock())
        assert svc.front.ceiling is not None
        self.assertEqual(svc.front.ceiling.limit, 1536 * MIB)
        self.assertIn(b"llmgw_gateway_memory_limit_bytes", generate_latest(svc.registry))
        self.assertEqual(svc.front.gateway.admission.total_bytes, 512 * MIB)

    def test_bad_size(self) -> None:
        """
        A size that is not one is refused, naming the option.
        """
        e = self.assertRaises(usage.UsageError, GatewayOptions().parseOptions, ["--memory-limit", "2 gigs"])
        self.assertIn("--memory-limit: '2 gigs' is not a size", str(e))

    def test_refused_without_proc(self) -> None:
        """
        A ceiling where the process's memory cannot be read is refused at
        start-up with the reason, not ignored.
        """
        def missing() -> None:
            raise MemoryCeilingError("no /proc here")

        with mock.patch("llmgw.memceiling.check_readable", missing):
            e = self.assertRaises(usage.UsageError, GatewayOptions().parseOptions, ["--memory-limit", "1GiB"])
        self.assertIn("--memory-limit: no /proc here", str(e))

    def test_embedded(self) -> None:
        """
        The control plane's C{--gateway-memory-limit}, C{--gateway-queue-bytes}
        and C{--gateway-queue-bytes-per-model} reach its embedded gateway.
        """
        from llmgw.control.service import Options, makeService

        o = Options()
        o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "off",
                        "--gateway-memory-limit", "2GiB", "--gateway-queue-bytes", "100MiB",
                        "--gateway-queue-bytes-per-model", "10MiB"])
        cp = makeService(o, reactor=MemoryReactorClock())
        assert cp.gateway is not None and cp.gateway.ceiling is not None
        self.assertEqual(cp.gateway.ceiling.limit, 2048 * MIB)
        self.assertEqual(cp.gateway.ceiling.option, "--gateway-memory-limit")
        config = cp.gateway.gateway.config
        self.assertEqual((config.queue_bytes_per_model, config.queue_bytes), (10 * MIB, 100 * MIB))

    def test_service_runs_the_ceiling(self) -> None:
        """
        A GatewayService given a ceiling runs it as its child: polling
        starts and stops with the service.
        """
        clock = MemoryReactorClock()
        rss = FakeRSS(0)
        svc = GatewayService(clock, RoutingTable(clock), "127.0.0.1", 0, GatewayConfig(),
                             ceiling=MemoryCeiling(clock, 1000, rss))
        svc.startService()
        clock.advance(POLL_S)
        svc.stopService()
        clock.advance(POLL_S * 4)
        self.assertEqual(rss.reads, 2)


class TrimTests(SynchronousTestCase):
    """
    Freed memory returned to the system after a burst (llmgw.memtrim).
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.trims: list[float] = []
        self.trimmer = Trimmer(self.clock, lambda: self.trims.append(self.clock.seconds()),
                               threshold=100, min_interval=10)
        self.addCleanup(self.trimmer.close)

    def test_after_a_large_burst_only(self) -> None:
        """
        A drained burst under the threshold is not trimmed; one at or over
        it is, on the next reactor turn, not inside whoever drained it.
        """
        self.trimmer.drained(99)
        self.clock.advance(0)
        self.assertEqual(self.trims, [])
        self.trimmer.drained(100)
        self.assertEqual(self.trims, [])
        self.clock.advance(0)
        self.assertEqual(self.trims, [0])

    def test_at_most_once_an_interval(self) -> None:
        """
        Bursts draining in quick succession are trimmed once the interval
        since the last trim is up, once however many drained meanwhile.
        """
        self.trimmer.drained(500)
        self.clock.advance(0)
        self.clock.advance(3)
        self.trimmer.drained(500)
        self.trimmer.drained(500)
        self.clock.advance(6.9)
        self.assertEqual(self.trims, [0])
        self.clock.advance(0.1)
        self.assertEqual(self.trims, [0, 10])

    def test_told_by_the_queue(self) -> None:
        """
        The admission queue tells its trimmer the most bytes it held when
        all its queues have emptied, and not before; closing the queue
        cancels a trim not yet made.
        """
        gw = Gw()
        told: list[int] = []
        adm = gw.gateway.admission
        adm.trimmer = mock.Mock(drained=told.append)
        gw.send(n=1)
        gw.send(n=2)
        size = adm.queued_bytes
        gw.clock.advance(5)
        self.assertEqual(told, [])
        gw.ready("r1")
        self.assertEqual(told, [size])
        trimmer = Trimmer(self.clock, lambda: self.trims.append(0), threshold=1)
        adm.trimmer = trimmer
        trimmer.drained(5)
        adm.close()
        self.clock.advance(1)
        self.assertEqual(self.trims, [])

    def test_glibc(self) -> None:
        """
        On glibc, L{malloc_trim} finds the call and it runs.
        """
        trim = malloc_trim()
        if trim is None:
            raise SkipTest("no malloc_trim in this C library")
        trim()


class GrowthTrimmerTests(SynchronousTestCase):
    """
    L{GrowthTrimmer}: memory freed after any burst (a handshake flood, say)
    is handed back once, not trimmed every interval while it is in use.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.rss = [100 * MIB]
        self.trims = 0

        def trim() -> None:
            self.trims += 1
            # What a trim gives back: the process falls to 110 MiB.
            self.rss[0] = 110 * MIB

        self.trimmer = GrowthTrimmer(self.clock, trim, lambda: self.rss[0], interval=10.0, growth=32 * MIB)
        self.trimmer.startService()
        self.addCleanup(self.trimmer.stopService)

    def test_trims_after_growth(self) -> None:
        """
        Growth of 32 MiB or more over the floor is trimmed at the next look;
        less is not.
        """
        self.rss[0] = 120 * MIB
        self.clock.advance(10)
        self.assertEqual(self.trims, 0)
        self.rss[0] = 260 * MIB
        self.clock.advance(10)
        self.assertEqual(self.trims, 1)
        self.assertEqual(self.trimmer.floor, 110 * MIB)

    def test_memory_in_use_trimmed_once(self) -> None:
        """
        Memory that stays in use after a trim (the trim gave nothing back)
        raises the floor: no trim every interval.
        """
        self.trimmer.trim = lambda: None
        self.rss[0] = 300 * MIB
        for _ in range(5):
            self.clock.advance(10)
        self.assertEqual(self.trimmer.trims, 1)

    def test_floor_follows_lower_memory(self) -> None:
        """
        The floor is the lowest resident memory seen: growth is measured
        from it.
        """
        self.rss[0] = 80 * MIB
        self.clock.advance(10)
        self.rss[0] = 115 * MIB
        self.clock.advance(10)
        self.assertEqual(self.trims, 1)

    def test_stop(self) -> None:
        """
        Stopped, it reads nothing more.
        """
        self.trimmer.stopService()
        self.rss[0] = 900 * MIB
        self.clock.advance(100)
        self.assertEqual(self.trims, 0)


class GrowthTrimmerWiringTests(SynchronousTestCase):
    def test_own_process_services(self) -> None:
        """
        A gateway or control plane in a process of its own runs a growth
        trimmer where glibc and /proc are there; an embedded one (its
        reactor given) does not.
        """
        if growth_trimmer(Clock()) is None:
            raise SkipTest("no malloc_trim or no /proc here")
        o = GatewayOptions()
        o.parseOptions(["--admin-url", "http://127.0.0.1:1", "--gateway", "127.0.0.1:0"])
        embedded = gateway_make_service(o, MemoryReactorClock())
        self.assertNotIn("memtrim", [s.name for s in embedded])
        own = gateway_make_service(o)
        self.assertIn("memtrim", [s.name for s in own])
