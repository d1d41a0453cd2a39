"""
Tests for L{llmgw.control.admin.watch}: the watch stream on the admin API, over
in-memory transports on a Clock, against a fake fleet with a real
L{RoutingTable}.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from treq.testing import StubTreq
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.site import admin_site
from llmgw.control.admin.watch import WatchHub
from llmgw.control.shell.metrics import make_registry
from llmgw.routing import Route, RoutingTable
from llmgw.testing.fleet import sample_fleet


def parse_frames(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """
    The complete server frames (opcode, payload) at the start of C{data},
    and what is left.
    """
    frames = []
    while len(data) >= 2:
        opcode = data[0] & 0x0F
        n = data[1] & 0x7F
        at = 2
        if n == 126:
            if len(data) < 4:
                break
            n, at = int.from_bytes(data[2:4], "big"), 4
        elif n == 127:
            if len(data) < 10:
                break
            n, at = int.from_bytes(data[2:10], "big"), 10
        if len(data) < at + n:
            break
        frames.append((opcode, data[at:at + n]))
        data = data[at + n:]
    return frames, data


class WatchClient:
    """
    One client of the watch stream on a L{StringTransport}: sends the
    upgrade and decodes the messages the server writes.
    """

    def __init__(self, site: Any, query: str = "", host: str = "127.0.0.1", port: int = 7480,
                 origin: bytes | None = None):
        self.transport = StringTransport(peerAddress=_addr(host, port))
        self.protocol = site.buildProtocol(None)
        self.protocol.makeConnection(self.transport)
        key = base64.b64encode(os.urandom(16))
        self.protocol.dataReceived(
            b"GET /api/v1/watch" + query.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:7480\r\n"
            b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: " + key
            + b"\r\nSec-WebSocket-Version: 13\r\n"
            + (b"Origin: " + origin + b"\r\n" if origin is not None else b"") + b"\r\n"
        )
        self.status = b""
        self._rest = b""
        self.messages: list[dict[str, Any]] = []

    @property
    def websocket(self) -> Any:
        """
        The protocol the connection was handed to by the upgrade.
        """
        return self.transport.protocol  # type: ignore[attr-defined]

    def disconnect(self) -> None:
        self.websocket.connectionLost(Failure(ConnectionDone()))

    def send(self, message: Any) -> None:
        """
        Send C{message} (JSON, or raw bytes) as a masked text frame.
        """
        payload = message if isinstance(message, bytes) else json.dumps(message).encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
        self.websocket.dataReceived(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def read(self) -> list[dict[str, Any]]:
        """
        Messages written since the last read.
        """
        data = self._rest + self.transport.value()
        self.transport.clear()
        if not self.status:
            head, sep, data = data.partition(b"\r\n\r\n")
            if not sep:
                self._rest = head
                return []
            self.status = head.split(b"\r\n")[0]
            if b" 101 " not in self.status:
                self.body = data
                return []
        frames, self._rest = parse_frames(data)
        new = [json.loads(p) for op, p in frames if op == 1]
        self.messages.extend(new)
        return new


def _addr(host: str, port: int) -> Any:
    from twisted.internet.address import IPv4Address

    return IPv4Address("TCP", host, port)


class WatchTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = MemoryReactorClock()
        self.clock.advance(1000)
        self.table = RoutingTable(self.clock)
        self.table.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha", "beta"])
        self.fleet: Any = sample_fleet()
        self.fleet.routing_table = self.table
        self.hub = WatchHub(self.fleet, self.clock, ring_size=50, max_buffer=4096, timeouts=False)
        self.hub.start()
        self.addCleanup(self.hub.stop)
        self.site = admin_site(self.fleet, make_registry(), reactor=self.clock, watch=self.hub)
        self.logged: list[dict[str, Any]] = []
        self.site.resource.log = Logger(observer=self.logged.append)

    def connect(self, query: str = "") -> WatchClient:
        client = WatchClient(self.site, query)
        client.read()
        return client

    def change(self, n: int) -> None:
        """
        Publish C{n} route changes to model alpha, and let the hub flush.
        """
        for i in range(n):
            self.table.publish_model("alpha", [Route(f"x{self.table.revision}-{i}", "alpha", "10.0.0.9:1")])
        self.clock.advance(1)


class StreamTests(WatchTestCase):
    def test_snapshot_then_changes(self) -> None:
        """
        A client without C{since} is sent a snapshot of the routes and the
        fleet's views, then one C{routes} message per change, each with a
        revision one higher than the last.
        """
        c = self.connect()
        self.assertIn(b" 101 ", c.status)
        [snap] = c.messages
        self.assertEqual(snap["type"], "snapshot")
        self.assertEqual(snap["routes"]["routes"][0]["replica"], "r1")
        self.assertEqual({n["id"] for n in snap["nodes"]}, {n["id"] for n in self.fleet.nodes()})
        self.change(2)
        msgs = c.read()
        self.assertEqual([m["type"] for m in msgs], ["routes", "routes"])
        self.assertEqual([m["revision"] for m in msgs], [snap["revision"] + 1, snap["revision"] + 2])
        self.assertEqual(list(msgs[1]["models"]), ["alpha"])
        self.assertEqual(msgs[1]["models"]["alpha"][0]["address"], "10.0.0.9:1")
        self.assertEqual(msgs[1]["routes_revision"], self.table.revision)

    def test_removed_model(self) -> None:
        """
        A model whose last route goes is sent with an empty list, and a
        change of the declared models carries C{known}.
        """
        c = self.connect()
        self.table.publish([], ["beta"])
        self.clock.advance(1)
        [m] = c.read()
        self.assertEqual(m["models"], {"alpha": []})
        self.assertEqual(m["known"], ["beta"])

    def test_resume_without_gap(self) -> None:
        """
        A client that reconnects with C{since} (and the epoch) within the
        resume grace gets exactly the messages after that revision, and no
        snapshot.
        """
        c = self.connect()
        snap = c.messages[0]
        self.change(2)
        c.read()
        last = c.messages[-1]["revision"]
        c.disconnect()
        self.change(3)
        self.clock.advance(self.hub.resume_grace - 2)
        again = self.connect(f"?since={last}&epoch={snap['epoch']}")
        self.assertEqual([m["type"] for m in again.messages], ["routes"] * 3)
        self.assertEqual([m["revision"] for m in again.messages], [last + 1, last + 2, last + 3])

    def test_too_old(self) -> None:
        """
        A revision older than the ring holds is answered with a C{reset}
        saying so, then a snapshot.
        """
        c = self.connect()
        first = c.messages[0]["revision"]
        self.change(60)
        old = self.connect(f"?since={first}")
        self.assertEqual([m["type"] for m in old.messages], ["reset", "snapshot"])
        self.assertIn("older than the oldest kept", old.messages[0]["reason"])
        self.assertEqual(old.messages[1]["revision"], self.hub.revision)

    def test_other_epoch(self) -> None:
        """
        A revision from another control plane process (another epoch, or a
        revision this one has not reached) is a reset.
        """
        a = self.connect("?since=1&epoch=abc")
        self.assertIn("another control plane", a.messages[0]["reason"])
        b = self.connect("?since=999999")
        self.assertEqual(b.messages[0]["type"], "reset")
        self.assertIn("newer than", b.messages[0]["reason"])

    def test_bad_since(self) -> None:
        """
        A malformed C{since} is a 400 that says what was wrong, logged.
        """
        c = self.connect("?since=-3")
        self.assertIn(b" 400 ", c.status)
        self.assertIn(b"is not a revision", c.body)
        self.assertTrue(any("refused" in e["log_format"] for e in self.logged))

    def test_cross_origin_refused(self) -> None:
        """
        A browser's upgrade from a page of another origin is refused (403,
        logged): the socket takes commands. A page of the API itself (the
        Origin names the Host) is let in.
        """
        evil = WatchClient(self.site, origin=b"https://evil.example")
        evil.read()
        self.assertIn(b" 403 ", evil.status)
        self.assertIn(b"origin https://evil.example is refused", evil.body)
        other_port = WatchClient(self.site, origin=b"http://127.0.0.1:9999")
        other_port.read()
        self.assertIn(b" 403 ", other_port.status)
        own = WatchClient(self.site, origin=b"http://127.0.0.1:7480")
        own.read()
        self.assertIn(b" 101 ", own.status)

    def test_plain_get(self) -> None:
        """
        A GET without the upgrade is told (426) that this is a WebSocket.
        """
        t = StringTransport()
        p = self.site.buildProtocol(None)
        p.makeConnection(t)
        p.dataReceived(b"GET /api/v1/watch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.assertIn(b" 426 ", t.value())
        self.assertIn(b"Upgrade: websocket", t.value())

    def test_coalesced_flush(self) -> None:
        """
        Changes within one flush interval reach a client in one write.
        """
        c = self.connect()
        writes: list[bytes] = []
        original = c.transport.write
        c.transport.write = lambda data: (writes.append(data), original(data))  # type: ignore[method-assign]
        for i in range(5):
            self.table.publish_model("alpha", [Route(f"y{i}", "alpha", "10.0.0.9:1")])
        self.clock.advance(1)
        self.assertEqual(len(writes), 1)
        self.assertEqual(len(c.read()), 5)


class FleetChangeTests(WatchTestCase):
    def test_node_and_replica_changes(self) -> None:
        """
        A changed node or replica view is sent within one views interval;
        a node's last_seen alone is no change; a removed replica is sent
        as removed; new events are sent once each.
        """
        c = self.connect()
        # Views are built afresh per call, as the reconciler's are.
        node = self.fleet.nodes()[0]["id"]
        views = self.fleet.node_views
        views[node] = dict(views[node], last_seen=12345.0)
        self.clock.advance(1)
        self.assertEqual(c.read(), [])
        views[node] = dict(views[node], cordoned=True)
        replica = self.fleet.replicas()[0]["id"]
        self.fleet.replica_views = [r for r in self.fleet.replica_views if r["id"] != replica]
        self.fleet.add_event(1001.0, "replica_lost", "gone", replica=replica)
        self.clock.advance(1)
        msgs = c.read()
        by_type = {m["type"]: m for m in msgs}
        self.assertTrue(by_type["node"]["node"]["cordoned"])
        self.assertEqual(by_type["replica"], dict(by_type["replica"], id=replica, removed=True))
        self.assertEqual(by_type["event"]["event"]["kind"], "replica_lost")
        self.clock.advance(1)
        self.assertEqual(c.read(), [])

    def test_views_diffed_only_while_watched(self) -> None:
        """
        Once the last client that reads the fleet has been gone for the
        resume grace, the views are no longer polled; a resume from before
        such a gap is a reset.
        """
        c = self.connect()
        rev = c.messages[0]["revision"]
        c.disconnect()
        self.clock.advance(self.hub.resume_grace)
        calls = []
        nodes = self.fleet.nodes
        self.fleet.nodes = lambda: calls.append(1) or nodes()
        self.clock.advance(5)
        self.assertEqual(calls, [])
        again = self.connect(f"?since={rev}")
        self.assertEqual(again.messages[0]["type"], "reset")


class SlowClientTests(WatchTestCase):
    def test_unread_client_dropped(self) -> None:
        """
        A client whose transport stays full (paused) is held up to the
        hub's max_buffer bytes, then aborted and logged; other clients go
        on getting every message.
        """
        slow, fast = self.connect(), self.connect()
        slow.transport.producer.pauseProducing()
        self.change(1)
        self.assertEqual(slow.read(), [])
        self.assertFalse(slow.transport.disconnecting)
        logged: list[dict[str, Any]] = []
        slow.websocket.log = Logger(observer=logged.append)
        for _ in range(40):
            self.table.publish_model("alpha", [Route("z" * 200 + str(self.table.revision), "alpha", "10.0.0.9:1")])
            self.clock.advance(1)
        self.assertTrue(slow.transport.disconnecting)
        self.assertEqual(self.hub.dropped, 1)
        self.assertIn("reads too slowly", logged[-1]["log_format"])
        self.assertNotIn(slow.websocket, self.hub.clients)
        self.assertEqual(len(fast.read()), 41)

    def test_paused_client_resumes(self) -> None:
        """
        A client paused for a while (under the limit) gets what was held,
        in order, when its transport resumes.
        """
        c = self.connect()
        c.transport.producer.pauseProducing()
        self.change(3)
        self.assertEqual(c.read(), [])
        c.transport.producer.resumeProducing()
        revs = [m["revision"] for m in c.read()]
        self.assertEqual(revs, sorted(revs))
        self.assertEqual(len(revs), 3)



class RoutesOnlyTests(WatchTestCase):
    def test_only_routes(self) -> None:
        """
        C{?only=routes} gets a snapshot of the routes alone and no fleet
        change, and does not start diffing the views.
        """
        c = self.connect("?only=routes")
        self.assertNotIn("nodes", c.messages[0])
        node = self.fleet.nodes()[0]["id"]
        self.fleet.node_views[node] = dict(self.fleet.node_views[node], cordoned=True)
        self.change(1)
        self.assertEqual([m["type"] for m in c.read()], ["routes"])
        self.assertIsNone(self.hub._views_loop)

    def test_bad_only(self) -> None:
        """
        Any other C{only} is a 400 that says what it may be.
        """
        c = self.connect("?only=nodes")
        self.assertIn(b" 400 ", c.status)
        self.assertIn(b"only=routes", c.body)


class SubscribeTests(SynchronousTestCase):
    def test_subscribe(self) -> None:
        """
        L{RoutingTable.subscribe} calls back after every change with the
        revision, the models whose routes changed and whether the declared
        models did; a callback that raises is logged and kept; nothing
        after unsubscribing; a publication that changes nothing calls no
        one.
        """
        table = RoutingTable(MemoryReactorClock())
        seen: list[tuple[int, frozenset[str], bool]] = []
        calls = []

        def broken(*args: Any) -> None:
            calls.append(args)
            raise RuntimeError("boom")

        table.subscribe(broken)
        unsubscribe = table.subscribe(lambda *a: seen.append(a))
        table.publish([Route("r1", "a", "h:1"), Route("r2", "b", "h:2")], ["a", "b"])
        table.publish([Route("r1", "a", "h:1"), Route("r3", "b", "h:3")], ["a", "b"])
        table.publish([Route("r1", "a", "h:1"), Route("r3", "b", "h:3")], ["a", "b"])
        table.publish_model("a", [])
        table.set_known(["b"])
        self.assertEqual(seen, [
            (1, frozenset({"a", "b"}), True),
            (2, frozenset({"b"}), False),
            (3, frozenset({"a"}), False),
            (4, frozenset(), True),
        ])
        unsubscribe()
        table.publish_model("b", [])
        self.assertEqual(len(seen), 4)
        self.assertEqual(len(calls), 5)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 5)


class FlushIntervalTests(WatchTestCase):
    def test_routes_followers_flushed_sooner(self) -> None:
        """
        After a quiet spell a change goes out at once; changes that follow
        within a flush interval wait for it, one write for all of them:
        20 ms for a routes-only client, 100 ms for a client of the whole
        stream.
        """
        full, routes = self.connect(), self.connect("?only=routes")
        self.clock.advance(1)
        full.read(), routes.read()
        self.table.publish_model("alpha", [Route("p", "alpha", "10.0.0.9:1")])
        self.clock.advance(0)
        self.assertEqual((len(full.read()), len(routes.read())), (1, 1))
        for i in range(3):
            self.table.publish_model("alpha", [Route(f"q{i}", "alpha", "10.0.0.9:1")])
        self.clock.advance(0)
        self.assertEqual((full.read(), routes.read()), ([], []))
        self.clock.advance(self.hub._routes_batch.interval)
        self.assertEqual(len(routes.read()), 3)
        self.assertEqual(full.read(), [])
        self.clock.advance(self.hub._fleet_batch.interval - self.hub._routes_batch.interval)
        self.assertEqual(len(full.read()), 3)


class SocketRequestTests(WatchTestCase):
    def ask(self, c: WatchClient, method: str, path: str, body: Any = None, rid: Any = 1) -> dict[str, Any]:
        message: dict[str, Any] = {"type": "request", "id": rid, "method": method, "path": path}
        if body is not None:
            message["body"] = body
        c.send(message)
        self.clock.advance(0)
        [answer] = [m for m in c.read() if m["type"] == "response"]
        return answer

    def test_reads_as_rest(self) -> None:
        """
        A read over the socket is answered by the admin API's own handler:
        the same body as the REST endpoint, with the request's id.
        """
        c = self.connect()
        answer = self.ask(c, "GET", "/api/v1/nodes", rid="a1")
        self.assertEqual((answer["id"], answer["status"]), ("a1", 200))
        rest = StubTreq(self.site.resource)
        response = self.successResultOf(rest.get("http://127.0.0.1:7480/api/v1/nodes"))
        self.assertEqual(answer["body"], json.loads(self.successResultOf(response.content())))
        answer = self.ask(c, "GET", "/api/v1/events?since=0")
        self.assertEqual(answer["status"], 200)
        self.assertIn("events", answer["body"])

    def test_commands(self) -> None:
        """
        A cordon and a scale over the socket reach the fleet and are logged
        with who asked; a bad body is the REST API's 400.
        """
        c = self.connect()
        node = self.fleet.nodes()[0]["id"]
        self.assertEqual(self.ask(c, "POST", f"/api/v1/nodes/{node}/cordon")["status"], 200)
        self.assertIn(("cordon", node), self.fleet.calls)
        model = self.fleet.deployments()[0]["model"]
        answer = self.ask(c, "POST", f"/api/v1/deployments/{model}/scale", {"replicas": 3})
        self.assertEqual(answer["body"], {"model": model, "replicas": 3, "ok": True})
        answer = self.ask(c, "POST", f"/api/v1/deployments/{model}/scale", {"replicas": -1})
        self.assertEqual(answer["status"], 400)
        self.assertIn("must not be negative", answer["body"]["error"])
        self.assertTrue(any("cordon" in str(e.get("action")) and e.get("client") for e in self.logged))

    def test_refusals(self) -> None:
        """
        An unknown path is the REST API's 404; a message that is no request
        a 400 naming what was wrong (with its id when it had one); the
        stream itself cannot be asked for over the stream.
        """
        c = self.connect()
        self.assertEqual(self.ask(c, "GET", "/api/v1/nope")["status"], 404)
        answer = self.ask(c, "PUT", "/api/v1/nodes", rid=7)
        self.assertEqual((answer["id"], answer["status"]), (7, 400))
        self.assertIn('"method"', answer["body"]["error"])
        c.send(b"not json")
        [bad] = c.read()
        self.assertEqual((bad["id"], bad["status"]), (None, 400))
        self.assertEqual(self.ask(c, "GET", "/api/v1/watch")["status"], 400)

    def test_malformed_json_refused(self) -> None:
        """
        A message nesting 30,000 levels, one with C{NaN}, and one with a
        key given twice are each answered with a 400 naming what was wrong
        (not a C{RecursionError} traceback: trial fails a test that logs
        one), logged with who sent it; the socket goes on serving requests.
        """
        events: list[dict[str, Any]] = []
        observer: Any = events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        c = self.connect()
        deep = b'{"type": "request", "id": 1, "method": "GET", "path": "/", "body": {"x": '
        deep += b"[" * 30_000 + b"]" * 30_000 + b"}}"
        cases = [
            (deep, "levels deep"),
            (b'{"type": "request", "id": NaN, "method": "GET", "path": "/"}', "NaN is not a JSON value"),
            (b'{"type": "request", "id": 1, "id": 2, "method": "GET", "path": "/"}', "more than once"),
        ]
        for payload, reason in cases:
            c.send(payload)
            [bad] = c.read()
            self.assertEqual((bad["id"], bad["status"]), (None, 400))
            self.assertIn(reason, bad["body"]["error"])
        refusals = [e for e in events if e.get("log_format", "").startswith("watch: refused a message")]
        self.assertEqual(len(refusals), len(cases))
        self.assertTrue(all(e["who"] not in ("", "?") for e in refusals))
        self.assertEqual(self.ask(c, "GET", "/api/v1/nodes")["status"], 200)
        # A body as deep as a REST body may be (64 levels) still goes through.
        nested: Any = []
        for _ in range(62):
            nested = [nested]
        answer = self.ask(c, "POST", "/api/v1/deployments/alpha/scale", {"replicas": nested})
        self.assertEqual(answer["status"], 400)
        self.assertNotIn("levels deep", answer["body"]["error"])

    def test_long_poll_cancelled_on_close(self) -> None:
        """
        A long-poll of the routes asked over the socket waits like the REST
        one, and its wait is dropped when the socket closes.
        """
        c = self.connect()
        c.send({"type": "request", "id": 1, "method": "GET",
                "path": f"/api/v1/routes?since={self.table.revision}"})
        self.assertEqual(self.table.waiting(), 1)
        c.disconnect()
        self.assertEqual(self.table.waiting(), 0)


class RevocationTests(WatchTestCase):
    def test_revoked_client_dropped(self) -> None:
        """
        A client whose certificate serial the CRL comes to list is dropped
        at the next check (every REVOCATION_CHECK_S seconds), logged;
        others stay.
        """
        from llmgw.control.admin.watch import REVOCATION_CHECK_S

        revoked: set[int] = set()
        self.hub.stop()
        self.hub.revoked = lambda: frozenset(revoked)
        self.hub.start()
        alice, bob = self.connect(), self.connect()
        alice.websocket.serial, bob.websocket.serial = 11, 12
        logged: list[dict[str, Any]] = []
        self.hub.log = Logger(observer=logged.append)
        self.clock.advance(REVOCATION_CHECK_S)
        self.assertFalse(alice.transport.disconnecting)
        revoked.add(11)
        self.clock.advance(REVOCATION_CHECK_S)
        self.assertTrue(alice.transport.disconnecting)
        self.assertFalse(bob.transport.disconnecting)
        self.assertEqual(self.hub.clients, {bob.websocket})
        self.assertIn("revoked", logged[-1]["log_format"])


class SignalAgeTests(WatchTestCase):
    def test_signal_age_alone_is_no_change(self) -> None:
        """
        A replica whose engine signals only grew older is not sent again;
        one whose queue changed is.
        """
        r = self.fleet.replica_views[0]
        shard = dict(r["shards"][0], signals={"waiting": 1.0, "age_s": 0.1})
        self.fleet.replica_views[0] = dict(r, shards=[shard])
        c = self.connect()
        self.clock.advance(1)
        c.read()
        self.fleet.replica_views[0] = dict(r, shards=[dict(shard, signals={"waiting": 1.0, "age_s": 0.6})])
        self.clock.advance(1)
        self.assertEqual(c.read(), [])
        self.fleet.replica_views[0] = dict(r, shards=[dict(shard, signals={"waiting": 4.0, "age_s": 0.2})])
        self.clock.advance(1)
        [m] = c.read()
        self.assertEqual(m["replica"]["shards"][0]["signals"]["waiting"], 4.0)


class FetchProgressTests(WatchTestCase):
    def test_fetching_state_and_progress_sent(self) -> None:
        """
        A replica whose shard is fetching is sent with its state and
        progress, and sent again as the progress moves.
        """
        r = self.fleet.replica_views[0]
        shard = dict(r["shards"][0], state="fetching", fetch={"done": 1, "total": 4, "rate": 1.0})
        c = self.connect()
        self.fleet.replica_views[0] = dict(r, state="fetching", shards=[shard])
        self.clock.advance(1)
        [m] = c.read()
        self.assertEqual((m["replica"]["state"], m["replica"]["shards"][0]["fetch"]),
                         ("fetching", {"done": 1, "total": 4, "rate": 1.0}))
        moved = dict(shard, fetch={"done": 3, "total": 4, "rate": 2.0})
        self.fleet.replica_views[0] = dict(r, state="fetching", shards=[moved])
        self.clock.advance(1)
        [m] = c.read()
        self.assertEqual(m["replica"]["shards"][0]["fetch"]["done"], 3)


class FollowerWatchTests(WatchTestCase):
    """The watch stream on an HA member that does not lead."""

    def follower(self, routes: bool) -> None:
        from tests.test_admin_ha import FakeControl, FakeHA

        self.site = admin_site(self.fleet, make_registry(), reactor=self.clock, watch=self.hub,
                               control=FakeControl(FakeHA(routes=routes)))

    def test_routes_only_served_from_the_followed_table(self) -> None:
        """
        A member holding the published table serves a routes-only watch
        itself (snapshot, then each change of its table); the whole stream
        is still redirected to the leader.
        """
        self.follower(routes=True)
        c = self.connect("?only=routes")
        self.assertIn(b" 101 ", c.status)
        self.assertEqual(c.messages[0]["type"], "snapshot")
        self.change(1)
        self.assertEqual([m["type"] for m in c.read()], ["routes"])
        whole = WatchClient(self.site, "")
        whole.read()
        self.assertIn(b" 307 ", whole.status)

    def test_redirected_before_a_table_is_held(self) -> None:
        """
        A member that holds no published table yet redirects even a
        routes-only watch to the leader.
        """
        self.follower(routes=False)
        c = self.connect("?only=routes")
        self.assertIn(b" 307 ", c.status)
