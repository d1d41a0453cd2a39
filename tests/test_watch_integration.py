"""
The watch stream on real loopback sockets: roles over mutual TLS with
certificates made by llmgw's CA at test time, and the standalone gateway's
follower taking its routes from the stream (and falling back to the
long-poll without one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred, DeferredQueue, inlineCallbacks
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.trial.unittest import TestCase

from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.follower import FollowerTable
from llmgw.gateway.follower_service import FollowerService
from llmgw.routing import Route, RoutingTable
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, ServerTLS, TLSFiles, server_files

reactor: Any = global_reactor


def until(check: Any, timeout: float = 10.0) -> Deferred[float]:
    """
    Fires with the time at which C{check()} first held (checked every
    millisecond), or fails after C{timeout} seconds.
    """
    from twisted.internet.task import LoopingCall

    done: Deferred[float] = Deferred()

    def poll() -> None:
        if check():
            loop.stop()
            done.callback(reactor.seconds())

    loop = LoopingCall(poll)
    loop.start(0.001)
    done.addTimeout(timeout, reactor)
    return done


class _Collect(WebSocketClientProtocol):
    queue: DeferredQueue[Any]
    closed: Deferred[Any]

    def onMessage(self, payload: bytes, isBinary: bool) -> None:  # noqa: N803
        self.queue.put(json.loads(payload))

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:  # noqa: N803
        if not self.closed.called:
            self.closed.callback(reason)


def open_watch(url: str, tls: ClientTLSPolicy | None, port: int) -> tuple[DeferredQueue[Any], Deferred[Any]]:
    """
    Dial the watch stream at C{url}: the queue of its messages, and a
    Deferred that fires with the close reason.
    """
    queue: DeferredQueue[Any] = DeferredQueue()
    closed: Deferred[Any] = Deferred()
    factory = WebSocketClientFactory(url, reactor=reactor)

    def build(addr: Any) -> Any:
        p: Any = _Collect()
        p.factory = factory
        p.queue, p.closed = queue, closed
        return p

    factory.buildProtocol = build  # type: ignore[method-assign]
    endpoint: Any = HostnameEndpoint(reactor, "127.0.0.1", port)
    if tls is not None:
        endpoint = wrapClientTLS(tls.creatorForNetloc(b"127.0.0.1", port), endpoint)
    endpoint.connect(factory).addErrback(lambda f: closed.called or closed.callback(f.getErrorMessage()))
    return queue, closed


class _TLSCase(TestCase):
    """
    A real admin listener on 127.0.0.1 behind mutual TLS, with a viewer's
    and a gateway's certificates.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        make = make_pki(self.dir, ["node-a"])
        make.issue_admin("alice", "viewer")
        make.issue_admin("gw-1", "gateway")
        self.fleet = sample_fleet()
        self.svc = admin_service(reactor, "127.0.0.1", 0, self.fleet, make_registry(),
                                 tls=ServerTLS(server_files(self.dir)))
        self.svc.startService()
        self.addCleanup(self.svc.stopService)
        self.port = self.svc.address()[1]
        self.url = f"wss://127.0.0.1:{self.port}/api/v1/watch"

    def policy(self, stem: str) -> ClientTLSPolicy:
        d = self.dir
        return ClientTLSPolicy(TLSFiles.load(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}.key"))



class WatchRolesTests(_TLSCase):
    """
    The stream behind the admin API's mutual TLS: each role's view.
    """

    @inlineCallbacks
    def test_viewer_and_gateway_views(self) -> None:
        """
        A viewer's snapshot holds the nodes and its stream the fleet's
        changes; the gateway role's snapshot holds only the routes, and a
        node's certificate is refused the upgrade.
        """
        viewer, vclosed = open_watch(self.url, self.policy("admin-alice"), self.port)
        gateway, gclosed = open_watch(self.url, self.policy("admin-gw-1"), self.port)
        vsnap = yield viewer.get()
        gsnap = yield gateway.get()
        self.assertEqual([n["id"] for n in vsnap["nodes"]], ["gpu-1", "gpu-2"])
        self.assertEqual(gsnap["type"], "snapshot")
        self.assertNotIn("nodes", gsnap)
        self.assertEqual([r["replica"] for r in gsnap["routes"]["routes"]], ["r1"])
        self.fleet.routing_table.publish([Route("r9", "llama-8b", "10.0.0.9:1")], ["llama-8b"])
        self.assertEqual((yield gateway.get())["models"]["llama-8b"][0]["replica"], "r9")
        self.assertEqual((yield viewer.get())["type"], "routes")
        _, nclosed = open_watch(self.url, self.policy("agent-node-a"), self.port)
        reason = yield nclosed
        self.assertIn("403", str(reason))
        self.svc.watch.stop()
        yield vclosed
        yield gclosed


class FollowerWatchTests(TestCase):
    """
    A standalone gateway's follower against a real admin listener on
    loopback without TLS.
    """

    def start(self, watch: bool = True) -> None:
        self.fleet = sample_fleet()
        self.table_cp = self.fleet.routing_table
        # The fake's table runs on its own Clock; real time here.
        from llmgw.routing import RoutingTable

        self.fleet.routing_table = RoutingTable(reactor)
        self.fleet.publish_routes()
        self.svc = admin_service(reactor, "127.0.0.1", 0, self.fleet, make_registry())
        if not watch:
            self.svc.factory.resource.watch_factory = None
        self.svc.startService()
        self.addCleanup(self.svc.stopService)
        url = f"http://127.0.0.1:{self.svc.address()[1]}"
        self.table = FollowerTable(reactor, url)
        self.follower = FollowerService(self.table, watch=True, retry=0.2)
        self.follower.startService()
        self.addCleanup(self.follower.stopService)

    def until(self, check: Any, timeout: float = 10.0) -> Deferred[float]:
        return until(check, timeout)

    @inlineCallbacks
    def test_change_reaches_gateway_over_the_stream(self) -> None:
        """
        Once the stream is open the follower stops long-polling, and each
        route change reaches its table over that one stream: no long-poll
        is started and the stream is not reopened (counted, not timed).
        """
        self.start()
        yield self.until(lambda: self.follower.watching is not None and self.table.loaded)
        self.assertIsNone(self.follower._reading)
        stream = self.follower.watching
        for i in range(5):
            self.fleet.routing_table.publish_model("llama-8b", [Route(f"w{i}", "llama-8b", "10.0.0.7:1")])
            yield self.until(lambda i=i: any(r.replica_id == f"w{i}" for r in self.table.routes("llama-8b")))
            self.assertIsNone(self.follower._reading)
            self.assertIs(self.follower.watching, stream)
        self.assertEqual(self.follower.watch_failures, 0)
        self.assertEqual(self.table.snapshot.revision, self.fleet.routing_table.revision)

    @inlineCallbacks
    def test_falls_back_to_long_poll(self) -> None:
        """
        Against an admin API without the stream (the upgrade is refused)
        the follower reads the long-poll, and still gets every change.
        """
        self.start(watch=False)
        yield self.until(lambda: self.table.loaded and self.follower.watch_failures > 0)
        self.assertIsNone(self.follower.watching)
        self.fleet.routing_table.publish_model("llama-8b", [Route("lp", "llama-8b", "10.0.0.7:1")])
        yield self.until(lambda: any(r.replica_id == "lp" for r in self.table.routes("llama-8b")))

    @inlineCallbacks
    def test_stream_lost_then_resumed(self) -> None:
        """
        When the stream drops, the follower long-polls meanwhile, dials the
        stream again and resumes from the revision it held.
        """
        self.start()
        yield self.until(lambda: self.follower.watching is not None)
        held = self.table.watch_revision
        self.svc.watch.stop()  # drops every client
        self.svc.watch.start()
        yield self.until(lambda: self.follower.watching is None)
        self.fleet.routing_table.publish_model("llama-8b", [Route("gap", "llama-8b", "10.0.0.7:1")])
        yield self.until(lambda: self.follower.watching is not None)
        yield self.until(lambda: any(r.replica_id == "gap" for r in self.table.routes("llama-8b")))
        self.assertGreater(self.table.watch_revision, held)


class ClientTLSTests(_TLSCase):
    @inlineCallbacks
    def test_client_over_mutual_tls(self) -> None:
        """
        L{FleetClient} over https:// presents its admin certificate: a
        viewer reads the nodes, and its cordon is the API's 403 naming the
        role, which reaches nothing.
        """
        import txaio

        from llmgw.client import FleetClient, FleetError

        txaio.use_twisted()
        d = self.dir
        client = FleetClient(f"https://127.0.0.1:{self.port}", ca=str(d / "ca.pem"),
                             cert=str(d / "admin-alice.pem"), key=str(d / "admin-alice.key"), timeout=10)
        self.addCleanup(client.close)
        nodes = yield client.nodes()
        self.assertEqual([n["id"] for n in nodes], ["gpu-1", "gpu-2"])
        with self.assertRaises(FleetError) as caught:
            yield client.cordon("gpu-1")
        self.assertEqual(caught.exception.status, 403)
        self.assertIn("role viewer", caught.exception.reason)
        self.assertEqual(self.fleet.calls, [])
        who = yield client._request("GET", "/api/v1/whoami")
        self.assertEqual(who, {"name": "alice", "role": "viewer", "tls": True})


class FollowerTLSTests(_TLSCase):
    @inlineCallbacks
    def test_gateway_follows_over_wss(self) -> None:
        """
        A standalone gateway behind mutual TLS follows the stream over
        wss:// with its gateway certificate, and gets a change.
        """
        self.fleet.routing_table = RoutingTable(reactor)
        self.fleet.publish_routes()
        self.svc.watch.table = self.fleet.routing_table
        self.svc.watch.stop()
        self.svc.watch.start()
        table = FollowerTable(reactor, f"https://127.0.0.1:{self.port}", tls=self.policy("admin-gw-1"))
        follower = FollowerService(table, watch=True, retry=0.2)
        follower.startService()
        self.addCleanup(follower.stopService)
        yield until(lambda: follower.watching is not None and table.loaded)
        self.fleet.routing_table.publish_model("llama-8b", [Route("tls1", "llama-8b", "10.0.0.7:1")])
        yield until(lambda: any(r.replica_id == "tls1" for r in table.routes("llama-8b")))
