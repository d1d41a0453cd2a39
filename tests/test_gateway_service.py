"""
``twistd llmgw gateway``: options, the embeddable service, and a standalone
gateway that keeps serving after its control plane is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw import tap
from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.service import GatewayService, Options, StandaloneGateway, makeService
from llmgw.routing import Route, RoutingSnapshot, RoutingTable
from llmgw.testing.fleet import sample_fleet
from tests.gateway_helpers import FakeReplica, Harness

ADMIN_SCRIPT = r"""
import json, sys
from twisted.internet import reactor
from llmgw.control.admin.site import admin_site
from llmgw.control.shell.metrics import make_registry
from llmgw.routing import Route, RoutingTable
from llmgw.testing.fleet import sample_fleet
table = RoutingTable(reactor)
table.publish([Route(**r) for r in json.loads(sys.argv[1])], json.loads(sys.argv[2]))
fleet = sample_fleet()
fleet.routing_table = table
port = reactor.listenTCP(0, admin_site(fleet, make_registry(), reactor=reactor), interface="127.0.0.1")
print(port.getHost().port, flush=True)
reactor.run()
"""


class OptionsTests(SynchronousTestCase):
    def test_defaults(self) -> None:
        """
        By default the gateway listens on loopback port 8000, follows the
        control plane's admin API on loopback, and serves metrics on loopback.
        """
        o = Options()
        o.parseOptions([])
        self.assertEqual((o["listen_host"], o["listen_port"]), ("127.0.0.1", 8000))
        self.assertEqual(o["admin-url"], "http://127.0.0.1:7480")
        self.assertEqual(o["metrics_address"], ("127.0.0.1", 7481))
        self.assertIsNone(o["keyring"])
        self.assertEqual(o.config().max_tries, 3)
        c = o.config()
        self.assertEqual(
            (c.head_timeout, c.request_timeout, c.body_timeout, c.keep_alive_timeout), (10.0, 30.0, 60.0, 120.0)
        )
        self.assertEqual((c.queue_depth, c.queue_timeout_s), (1000, 60.0))
        self.assertEqual(c.max_per_address, 0)

    def test_client_bounds(self) -> None:
        """
        --request-timeout bounds a whole request and
        --max-connections-per-address caps one address's connections, on
        the gateway's front.
        """
        o = Options()
        o.parseOptions(["--request-timeout", "45", "--max-connections-per-address", "8"])
        c = o.config()
        self.assertEqual((c.request_timeout, c.max_per_address), (45.0, 8))
        site = GatewayService(Clock(), RoutingSnapshot([]), config=c).site
        self.assertEqual((site.request_timeout, site.max_per_address), (45.0, 8))

    def test_queue_options(self) -> None:
        """
        --queue-depth and --queue-timeout set the admission queue's defaults
        (0 turns it off); a negative depth is refused.
        """
        o = Options()
        o.parseOptions(["--queue-depth", "0", "--queue-timeout", "2.5"])
        self.assertEqual((o.config().queue_depth, o.config().queue_timeout_s), (0, 2.5))
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--queue-depth", "-1"])

    def test_client_timeouts(self) -> None:
        """
        C{--head-timeout}, C{--body-timeout} and C{--keep-alive-timeout}
        reach the gateway's front, which times a slow head out with them.
        """
        o = Options()
        o.parseOptions(["--head-timeout", "5", "--body-timeout", "7.5", "--keep-alive-timeout", "9"])
        clock = Clock()
        svc = GatewayService(clock, RoutingSnapshot(), config=o.config())
        site = svc.site
        self.assertEqual((site.head_timeout, site.body_timeout, site.keep_alive_timeout), (5, 7.5, 9))
        proto = site.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(b"POST /v1/chat/completions HTTP/1.1\r\n")
        clock.advance(5)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertTrue(transport.disconnecting)
        # What is left is the linger that aborts a client that never reads.
        proto.connectionLost(None)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_connection_cap(self) -> None:
        """
        C{--max-connections} (10,000 by default, 0 for none) caps the
        standalone gateway's client connections: past it a connection is
        closed at accept.
        """
        o = Options()
        o.parseOptions([])
        self.assertEqual(o["max-connections"], 10_000)
        o = Options()
        o.parseOptions(["--max-connections", "1", "--metrics", "off"])
        svc = makeService(o, reactor=Clock())
        site = svc.front.site
        self.assertEqual(site.max_connections, 1)
        self.assertIsNotNone(site.buildProtocol(None))
        self.assertIsNone(site.buildProtocol(None))
        self.flushLoggedErrors()
        for bad in ("-1", "many"):
            e = self.assertRaises(usage.UsageError, Options().parseOptions, ["--max-connections", bad])
            self.assertIn("--max-connections", str(e))

    def test_values_checked(self) -> None:
        """
        Bad addresses, URLs, numbers and keys files are refused with the
        option named.
        """
        for argv, name in [
            (["--gateway", "[::1"], "--gateway"),
            (["--admin-url", "cp:7480"], "--admin-url"),
            (["--connect-timeout", "soon"], "--connect-timeout"),
            (["--head-timeout", "0"], "--head-timeout"),
            (["--body-timeout", "-1"], "--body-timeout"),
            (["--keep-alive-timeout", "never"], "--keep-alive-timeout"),
            (["--max-tries", "0"], "--max-tries"),
            (["--api-keys", "/nonexistent/keys"], "--api-keys"),
        ]:
            e = self.assertRaises(usage.UsageError, Options().parseOptions, argv)
            self.assertIn(name, str(e))

    def test_keys_and_metrics_off(self) -> None:
        """
        A keys file is loaded at start; C{--metrics off} serves no metrics.
        """
        p = Path(self.mktemp())
        p.write_text("sk-test-key-1\n")
        os.chmod(p, 0o600)
        o = Options()
        o.parseOptions(["--api-keys", str(p), "--metrics", "off", "--gateway", "0.0.0.0:9000"])
        self.assertEqual(len(o["keyring"]), 1)
        self.assertEqual(o.warnings, [])
        self.assertIsNone(o["metrics_address"])
        self.assertEqual(o["listen_host"], "0.0.0.0")

    def test_old_keys_option_warns(self) -> None:
        """
        C{--keys}, the old name of C{--api-keys} (the control plane's name
        for it), still loads the keys, with a warning logged when the
        service is made.
        """
        p = Path(self.mktemp())
        p.write_text("sk-test-key-1\n")
        os.chmod(p, 0o600)
        o = Options()
        o.parseOptions(["--keys", str(p), "--metrics", "off", "--gateway", "0"])
        self.assertEqual(len(o["keyring"]), 1)
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        makeService(o, reactor=MemoryReactorClock())
        self.assertEqual([e["problem"] for e in events if "problem" in e], o.warnings)
        self.assertIn("--api-keys", o.warnings[0])

    def test_typed_values(self) -> None:
        """
        Numbers are coerced by the options themselves: given and default
        values alike are numbers in the gateway's config.
        """
        o = Options()
        o.parseOptions(["--max-tries", "5", "--cooldown", "2.5"])
        c = o.config()
        self.assertEqual((c.max_tries, c.cooldown, c.connect_timeout), (5, 2.5, 5.0))
        self.assertIsInstance(o["poll-interval"], float)

    def test_gateway_hosts(self) -> None:
        """
        The standalone gateway serves loopback names and the address it
        binds; C{--gateway-hosts} adds names (a wildcard bind needs them)
        and refuses a malformed one. A request naming another host is 421.
        """
        o = Options()
        o.parseOptions(["--gateway", "0.0.0.0:9000", "--metrics", "off", "--gateway-hosts", "gw.example,.lb.example"])
        self.assertEqual(o["gateway-hosts"], ["gw.example", ".lb.example"])
        from llmgw.gateway.service import makeService

        svc = makeService(o, Clock())
        hosts = svc.front.gateway.hosts
        for host in (b"gw.example:9000", b"a.lb.example", b"localhost:9000"):
            self.assertTrue(hosts.allows(host), host)
        self.assertFalse(hosts.allows(b"10.0.0.3:9000"))
        bound = GatewayService(Clock(), RoutingSnapshot(), host="10.0.0.3", port=9000)
        self.assertTrue(bound.gateway.hosts.allows(b"10.0.0.3:9000"))
        self.assertFalse(bound.gateway.hosts.allows(b"gw.example"))
        proto = bound.site.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(b"GET /v1/models HTTP/1.1\r\nHost: gw.example\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 421 "), transport.value()[:100])
        e = self.assertRaises(usage.UsageError, Options().parseOptions, ["--gateway-hosts", "gw example"])
        self.assertIn("--gateway-hosts", str(e))

    def test_tap(self) -> None:
        """
        C{twistd llmgw gateway} builds a standalone gateway.
        """
        o = tap.Options()
        o.parseOptions(["gateway", "--gateway", "0", "--metrics", "off"])
        svc = tap.makeService(o, reactor=reactor)
        self.assertIsInstance(svc, StandaloneGateway)


class EmbeddedTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_embedded_service(self) -> Any:
        """
        L{GatewayService} serves a routing table on its own listener while
        running, reports in-flight counts, and closes its listener on stop.
        """
        h = Harness(self)  # for its replica, table and client
        h.replica("r1")
        svc = GatewayService(reactor, h, "127.0.0.1", 0)
        svc.startService()
        host, port = svc.listener.address()
        response = yield h.http.post(
            f"http://{host}:{port}/v1/chat/completions",
            data=json.dumps({"model": "demo"}).encode(),
        )
        self.assertEqual(response.code, 200)
        yield response.content()
        self.assertEqual(svc.in_flight("r1"), 0)
        yield h.pool.closeCachedConnections()
        yield svc.stopService()
        self.assertIsNone(svc.listener.port)


class BuildTests(SynchronousTestCase):
    def test_start_says_which_build(self) -> None:
        """
        The gateway's start-up line says whether its per-request modules
        are compiled (mypyc, setup.py's C{LLMGW_COMPILE=1}) or pure Python,
        as they were loaded here (CI runs these tests both ways; with
        C{LLMGW_EXPECT_COMPILED=1} the compiled build must be the one loaded).
        """
        from llmgw.gateway import front, upstream
        from llmgw.gateway.service import hot_path_build

        loaded = {m.__file__.rsplit(".", 1)[-1] for m in (front, upstream)}  # type: ignore[union-attr]
        self.assertEqual(len(loaded), 1, "one build, not a mix")
        expected = "compiled" if os.environ.get("LLMGW_EXPECT_COMPILED") == "1" else None
        build = hot_path_build()
        self.assertEqual(build, "pure Python" if loaded == {"py"} else "compiled")
        if expected is not None:
            self.assertEqual(build, expected)
        events: list[dict[str, Any]] = []
        svc = GatewayService(MemoryReactorClock(), RoutingSnapshot([], []), "127.0.0.1", 0)
        observer = events.append
        globalLogPublisher.addObserver(observer)
        try:
            svc.startService()
        finally:
            globalLogPublisher.removeObserver(observer)
            svc.stopService()
        (line,) = [formatEvent(e) for e in events if "gateway listening on" in formatEvent(e)]
        self.assertIn(f"hot path {build}", line)

    def test_loggers_named_after_their_class(self) -> None:
        """
        The loggers of the per-request classes are named after their class,
        compiled or not (compiled, a Logger on a class is not a descriptor:
        unnamed, it would take the name of whatever frame it found), read
        through an instance or the class.
        """
        from prometheus_client import CollectorRegistry

        from llmgw.gateway import admission, front, metrics, proxy, resource, upstream

        clock = MemoryReactorClock()
        gateway = proxy.Gateway(clock, RoutingSnapshot([], []))
        pool = upstream.UpstreamPool(clock)
        instances = [
            gateway, pool, upstream.UpstreamConnection(pool, "127.0.0.1:1"),
            front.FrontFactory(lambda request: None, clock, 1000), metrics.GatewayMetrics(CollectorRegistry(), dict),
            resource.GatewayResource(gateway), gateway.admission,
        ]
        for obj in instances:
            cls = type(obj)
            self.assertEqual(obj.log.namespace, f"{cls.__module__}.{cls.__name__}")
            self.assertEqual(cls.log.namespace, f"{cls.__module__}.{cls.__name__}")
        for cls in (front.HTTPFront, proxy.ProxyCall, admission.Admission):
            self.assertEqual(cls.log.namespace, f"{cls.__module__}.{cls.__name__}")
        from llmgw.gateway import wire

        self.assertEqual(wire.log.namespace, "llmgw.gateway.wire")

    def test_per_request_classes_native_when_compiled(self) -> None:
        """
        The per-request classes declare their interfaces in both builds;
        compiled, each is a native class (mypyc compiles a class with a
        decorator it does not know, such as C{@implementer}, as a plain
        Python class, whose every attribute read is a dictionary lookup).
        """
        from twisted.internet.interfaces import IPushProducer

        from llmgw.gateway import admission, front, proxy, router
        from llmgw.routing import IDemand, IInFlight

        self.assertTrue(IPushProducer.implementedBy(front.HTTPFront))
        self.assertTrue(IPushProducer.implementedBy(proxy.ProxyCall))
        self.assertTrue(IInFlight.implementedBy(proxy.Gateway))
        self.assertTrue(IDemand.implementedBy(proxy.Gateway))
        self.assertTrue(IInFlight.implementedBy(router.Router))
        self.assertTrue(IDemand.implementedBy(admission.Admission))
        gateway = proxy.Gateway(MemoryReactorClock(), RoutingSnapshot([], []))
        self.assertTrue(IDemand.providedBy(gateway.admission))
        self.assertTrue(IInFlight.providedBy(gateway.router))
        if os.environ.get("LLMGW_EXPECT_COMPILED") != "1":
            return
        classes = (front.HTTPFront, front.FrontRequest, proxy.ProxyCall, proxy.Gateway, router.Router,
                   admission.Admission)
        # mypyc marks its native classes with the attributes they hold.
        self.assertEqual([c.__name__ for c in classes if not hasattr(c, "__mypyc_attrs__")], [])


class _Admin(ProcessProtocol):
    def __init__(self) -> None:
        self.port: Deferred[int] = Deferred()
        self.ended: Deferred[None] = Deferred()
        self.out = b""

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.port.called:
            self.port.callback(int(self.out.split(b"\n")[0]))

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(None)
        if not self.port.called:
            self.port.errback(reason)


class StandaloneTests(TestCase):
    timeout = 20

    @inlineCallbacks
    def test_keeps_serving_after_control_plane_killed(self) -> Any:
        """
        A standalone gateway follows a control plane's routes (the admin API
        in a real process); when that process is killed the gateway keeps routing to
        the replicas it last knew, and its metrics say the control plane is
        unreachable.
        """
        replica = FakeReplica("r1")
        replica.listen()
        self.addCleanup(replica.stop)
        routes = [{"replica_id": "r1", "model": "demo", "address": replica.address()}]
        admin = _Admin()
        proc = reactor.spawnProcess(
            admin,
            sys.executable,
            [sys.executable, "-c", ADMIN_SCRIPT, json.dumps(routes), json.dumps(["demo"])],
            env={"PYTHONPATH": os.pathsep.join(sys.path)},
        )

        def kill() -> Any:
            if admin.ended.called:
                return None
            proc.signalProcess(signal.SIGKILL)
            return admin.ended

        self.addCleanup(kill)
        admin_port = yield admin.port
        gw = StandaloneGateway(
            reactor, f"http://127.0.0.1:{admin_port}", "127.0.0.1", 0, poll_interval=0.1,
        )
        h = Harness(self)
        gw.startService()
        self.addCleanup(gw.stopService)
        host, port = gw.front.listener.address()
        url = f"http://{host}:{port}/v1/chat/completions"

        @inlineCallbacks
        def chat() -> Any:
            response = yield h.http.post(url, data=json.dumps({"model": "demo"}).encode())
            body = yield response.json()
            return response.code, body

        while not gw.table.loaded:
            yield deferLater(reactor, 0.05, lambda: None)
        code, body = yield chat()
        self.assertEqual((code, body["choices"][0]["message"]["content"]), (200, "r1"))

        yield kill()
        failures = gw.registry.get_sample_value("llmgw_gateway_control_poll_failures_total")
        while gw.registry.get_sample_value("llmgw_gateway_control_poll_failures_total") < failures + 2:
            yield deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(gw.registry.get_sample_value("llmgw_gateway_control_plane_reachable"), 0)
        for _ in range(3):
            code, body = yield chat()
            self.assertEqual((code, body["choices"][0]["message"]["content"]), (200, "r1"))
        yield h.pool.closeCachedConnections()


class SameRulesTests(TestCase):
    timeout = 20

    @inlineCallbacks
    def test_draining_gets_nothing_new_embedded_or_standalone(self) -> Any:
        """
        An embedded gateway (routing by the published table itself) and a
        standalone one (following it through the admin API's
        C{/api/v1/routes} on loopback) send no new request to a draining
        replica, and both follow when the draining mark moves.
        """
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        for r in (r1, r2):
            r.listen()
            self.addCleanup(r.stop)
        table = RoutingTable(reactor)
        table.publish(
            [Route("r1", "demo", r1.address(), draining=True), Route("r2", "demo", r2.address())], ["demo"]
        )
        fleet: Any = sample_fleet()
        fleet.routing_table = table
        admin = admin_service(reactor, "127.0.0.1", 0, fleet, make_registry())
        admin.startService()
        self.addCleanup(admin.stopService)
        embedded = GatewayService(reactor, table, "127.0.0.1", 0)
        embedded.startService()
        self.addCleanup(embedded.stopService)
        admin_host, admin_port = admin.address()
        standalone = StandaloneGateway(
            reactor, f"http://{admin_host}:{admin_port}", "127.0.0.1", 0, poll_interval=0.1
        )
        standalone.startService()

        @inlineCallbacks
        def stop_standalone() -> Any:
            yield standalone.stopService()
            # The control plane's side of the held long-poll goes too.
            while table.waiting():
                yield deferLater(reactor, 0.01, lambda: None)

        self.addCleanup(stop_standalone)
        h = Harness(self)
        fronts = [embedded.listener.address(), standalone.front.listener.address()]

        @inlineCallbacks
        def answered_by(address: tuple[str, int]) -> Any:
            names = set()
            for _ in range(4):
                response = yield h.http.post(
                    f"http://{address[0]}:{address[1]}/v1/chat/completions",
                    data=json.dumps({"model": "demo"}).encode(),
                )
                body = yield response.json()
                names.add(body["choices"][0]["message"]["content"])
            return names

        while standalone.table.snapshot.revision != table.revision:
            yield deferLater(reactor, 0.02, lambda: None)
        for address in fronts:
            self.assertEqual((yield answered_by(address)), {"r2"})
        table.publish(
            [Route("r1", "demo", r1.address()), Route("r2", "demo", r2.address(), draining=True)], ["demo"]
        )
        while standalone.table.snapshot.revision != table.revision:
            yield deferLater(reactor, 0.02, lambda: None)
        for address in fronts:
            self.assertEqual((yield answered_by(address)), {"r1"})
        yield h.pool.closeCachedConnections()


class CollectorTests(SynchronousTestCase):
    def test_tuned_only_in_its_own_process(self) -> None:
        """
        As twistd builds it (no reactor given), the standalone gateway
        takes its start-up heap out of the collector's scans and keeps
        Python's thresholds; an embedder's gateway leaves the collector
        alone.
        """
        from llmgw.collector import CollectorTuning

        o = Options()
        o.parseOptions(["--metrics", "off", "--gateway", "0"])
        own = makeService(o)
        collector = own.getServiceNamed("collector")
        self.assertIsInstance(collector, CollectorTuning)
        self.assertIsNone(collector.threshold)
        embedded = makeService(o, reactor=MemoryReactorClock())
        self.assertNotIn("collector", [s.name for s in embedded])


class StartupWarningTests(SynchronousTestCase):
    """
    What a gateway says at start-up about traps in its configuration.
    """

    def start(self, svc: Any) -> list[str]:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        try:
            svc.startService()
        finally:
            globalLogPublisher.removeObserver(events.append)
            svc.stopService()
        return [formatEvent(e) for e in events if e.get("log_level") is not None
                and e["log_level"].name == "warn"]

    def test_exposed_without_names(self) -> None:
        """
        A gateway on every address with no C{--gateway-hosts} warns once
        that other machines' requests get 421 and what to add; one with
        names listed, or on loopback, says nothing of the sort.
        """
        exposed = GatewayService(MemoryReactorClock(), RoutingSnapshot([], []), "0.0.0.0", 8000)
        [line] = [w for w in self.start(exposed) if "421" in w]
        self.assertIn("--gateway-hosts", line)
        named = GatewayService(MemoryReactorClock(), RoutingSnapshot([], []), "0.0.0.0", 8000,
                               hosts=["gw.example"])
        self.assertEqual([w for w in self.start(named) if "421" in w], [])
        local = GatewayService(MemoryReactorClock(), RoutingSnapshot([], []), "127.0.0.1", 8000)
        self.assertEqual([w for w in self.start(local) if "421" in w], [])

    def test_open_file_check_names_its_option(self) -> None:
        """
        The standalone gateway checks the open-file limit once at start-up
        for its client connections and their upstream ones, naming its own
        C{--max-connections}; the warning, when there is one, is logged.
        """
        import llmgw.gateway.service as service

        asked: list[Any] = []

        def problem(needs: Any) -> str:
            asked.append(list(needs))
            return "the open-file limit is too small"

        self.patch(service, "fd_limit_problem", problem)
        gw = StandaloneGateway(MemoryReactorClock(), "http://127.0.0.1:7480", "127.0.0.1", 0,
                               max_connections=500)
        warnings = self.start(gw)
        [[need]] = asked
        self.assertEqual((need.count, need.option), (1000, "--max-connections"))
        self.assertIn("the open-file limit is too small", warnings)
