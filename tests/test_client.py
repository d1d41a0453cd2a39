"""
Tests for L{llmgw.client.FleetClient} against a real control plane (the
reconciler and admin API as C{twistd llmgw control} builds them, with a
catalog and no agents) on loopback: every method under Twisted here, and
under asyncio in a subprocess (txaio's framework is chosen per process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import txaio
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import ProcessProtocol
from twisted.trial.unittest import TestCase

from llmgw.client import FleetClient, FleetError
from llmgw.control import service as control_service

reactor: Any = global_reactor
txaio.use_twisted()

CATALOG = """
[profiles.fake-1gpu]
shards = 1
gpus_per_shard = 1
gpu_memory_mb = 1000
command = ["{python}", "-m", "llmgw.testing.fakemodel", "--port", "{port}", "--model", "{model}"]
startup_timeout_s = 60
drain_timeout_s = 10
stop_grace_s = 5

[[deployments]]
model = "demo"
profile = "fake-1gpu"
replicas = 0
"""


def control_plane(case: TestCase) -> Any:
    """
    A started control plane on loopback ports; stopped at cleanup.
    """
    d = Path(case.mktemp())
    d.mkdir()
    (d / "catalog.toml").write_text(CATALOG)
    o = control_service.Options()
    o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--gateway", "off",
                    "--catalog", str(d / "catalog.toml")])
    cp = control_service.makeService(o, reactor=reactor)
    cp.startService()
    case.addCleanup(cp.stopService)
    return cp


class _Output(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(reason.value.exitCode)


class TwistedClientTests(TestCase):
    def setUp(self) -> None:
        self.cp = control_plane(self)
        self.url = f"http://127.0.0.1:{self.cp.admin_listener.address()[1]}"
        self.client = FleetClient(self.url, timeout=10)
        self.addCleanup(self.client.close)

    @inlineCallbacks
    def test_reads(self) -> None:
        """
        Under Twisted the reads answer with Deferreds of what the REST
        endpoints show: no nodes, the catalog's deployment, no replicas, a
        list of events.
        """
        self.assertIsInstance(self.client.nodes(), Deferred)
        self.assertEqual((yield self.client.nodes()), [])
        deployments = yield self.client.deployments()
        self.assertEqual([d["model"] for d in deployments], ["demo"])
        self.assertEqual((yield self.client.replicas()), [])
        self.assertIsInstance((yield self.client.events(0)), list)
        status = yield self.client.status()
        self.assertIn("deployments", status)

    @inlineCallbacks
    def test_commands(self) -> None:
        """
        scale reaches the reconciler; cordon and drain of an unknown node
        fail with the API's 404 as a FleetError; reload re-reads the
        catalog.
        """
        answer = yield self.client.scale("demo", 2)
        self.assertEqual(answer["replicas"], 2)
        self.assertEqual(self.cp.reconciler.deployments()[0]["desired"], 2)
        for action in (self.client.cordon, self.client.drain, self.client.uncordon):
            with self.assertRaises(FleetError) as caught:
                yield action("nobody")
            self.assertEqual(caught.exception.status, 404)
        answer = yield self.client.reload()
        self.assertTrue(answer["ok"])

    @inlineCallbacks
    def test_watch_and_resume(self) -> None:
        """
        watch() calls back with a snapshot, then the deployment change a
        scale makes; after the socket drops the client reconnects and
        resumes from the revision it held (no second snapshot).
        """
        got: list[dict[str, Any]] = []
        waiters: list[tuple[Any, Deferred[None]]] = []

        def on_message(m: dict[str, Any]) -> None:
            got.append(m)
            for check, d in list(waiters):
                if check(m):
                    waiters.remove((check, d))
                    d.callback(None)

        def until(check: Any) -> Deferred[None]:
            d: Deferred[None] = Deferred()
            waiters.append((check, d))
            return d.addTimeout(10, reactor)

        snapshot = until(lambda m: m["type"] == "snapshot")
        self.client.watch(on_message)
        yield snapshot
        scaled = until(lambda m: m["type"] == "deployment" and m["deployment"]["desired"] == 3)
        yield self.client.scale("demo", 3)
        yield scaled
        held = self.client.revision
        for socket in list(self.cp.admin_listener.watch.clients):
            socket.dropConnection(abort=True)
        rescaled = until(lambda m: m["type"] == "deployment" and m["deployment"]["desired"] == 1)
        yield self.client.scale("demo", 1).addErrback(lambda f: self.client.scale("demo", 1))
        yield rescaled
        self.assertEqual([m["type"] for m in got].count("snapshot"), 1)
        self.assertGreater(self.client.revision, held)

    @inlineCallbacks
    def test_async_for(self) -> None:
        """
        C{async for} over the client yields the stream's messages under
        Twisted too.
        """
        from twisted.internet.defer import ensureDeferred

        async def first_change() -> dict[str, Any]:
            stream = self.client.__aiter__()
            await self.client.scale("demo", 4)
            async for m in stream:
                if m["type"] == "deployment":
                    return m
            raise AssertionError("the stream ended")

        m = yield ensureDeferred(first_change()).addTimeout(10, reactor)
        self.assertEqual(m["deployment"]["desired"], 4)

    @inlineCallbacks
    def test_unreachable(self) -> None:
        """
        A read against a port nobody listens on fails with a FleetError
        (status 0) instead of hanging.
        """
        port = self.cp.admin_listener.address()[1]
        yield self.cp.admin_listener.stopService()
        client = FleetClient(f"http://127.0.0.1:{port}", timeout=5)
        with self.assertRaises(FleetError) as caught:
            yield client.nodes()
        self.assertEqual(caught.exception.status, 0)

    @inlineCallbacks
    def test_asyncio(self) -> None:
        """
        The same client under asyncio (a subprocess that chose asyncio):
        every read, scale, cordon and drain refused with 404, reload, and
        the stream's deployment change after a scale.
        """
        root = Path(__file__).resolve().parent.parent
        out = _Output()
        env = dict(os.environ, PYTHONPATH=str(root))
        reactor.spawnProcess(out, sys.executable, [sys.executable, "-m", "tests.client_asyncio", self.url],
                             env=env, path=str(root))
        code = yield out.ended
        self.assertEqual(code, 0, out.err.decode(errors="replace")[-2000:])
        result = json.loads(out.out)
        self.assertEqual(result["framework"], "asyncio")
        self.assertEqual(result["nodes"], [])
        self.assertEqual([d["model"] for d in result["deployments"]], ["demo"])
        self.assertEqual(result["replicas"], [])
        self.assertIsInstance(result["events"], list)
        self.assertEqual(result["scale"]["replicas"], 0)
        self.assertEqual(result["cordon_error"][0], 404)
        self.assertEqual(result["drain_error"][0], 404)
        self.assertTrue(result["reload"]["ok"])
        self.assertEqual(result["watched_deployment"]["desired"], 1)
        self.assertEqual(self.cp.reconciler.deployments()[0]["desired"], 1)


class _Lines(_Output):
    def __init__(self, on_line: Any) -> None:
        super().__init__()
        self.on_line = on_line

    def outReceived(self, data: bytes) -> None:
        before = self.out.count(b"\n")
        super().outReceived(data)
        for _ in range(self.out.count(b"\n") - before):
            self.on_line()


class CtlWatchTests(TestCase):
    @inlineCallbacks
    def test_ctl_watch_prints_the_stream(self) -> None:
        """
        C{llmgw ctl watch --count 2} prints the snapshot, then the line for
        the deployment change a scale makes, and exits 0.
        """
        cp = control_plane(self)
        url = f"http://127.0.0.1:{cp.admin_listener.address()[1]}"
        root = Path(__file__).resolve().parent.parent
        out = _Lines(lambda: cp.reconciler.scale("demo", 5))
        reactor.spawnProcess(out, sys.executable,
                             [sys.executable, "-m", "llmgw.ctl.main", "ctl", "watch", "--admin-url", url, "--count", "2"],
                             env=dict(os.environ, PYTHONPATH=str(root)), path=str(root))
        code = yield out.ended.addTimeout(30, reactor)
        self.assertEqual(code, 0, out.err.decode(errors="replace")[-2000:])
        lines = out.out.decode().splitlines()
        self.assertIn("snapshot", lines[0])
        self.assertIn("1 deployments", lines[0])
        self.assertRegex(lines[1], r"^#\d+ deployment demo: desired 5, ready 0$")


class RenderTests(TestCase):
    def test_lines(self) -> None:
        """
        Each kind of message reads as one line naming what changed; names
        with control characters are escaped.
        """
        from llmgw.ctl.watch import render_message

        self.assertEqual(
            render_message({"type": "routes", "revision": 4, "models": {"a": [
                {"replica": "r1", "address": "h:1", "draining": True}], "b": []}, "known": ["a"]}),
            "#4 routes a: r1@h:1 (draining); b: no routes; declared: a",
        )
        self.assertEqual(
            render_message({"type": "node", "revision": 5, "id": "n\x1b1", "node": {
                "state": "ready", "cordoned": True, "gpus": [{"memory_used_mb": 10}], "shards": ["s"]}}),
            "#5 node n\\x1b1: ready, cordoned, 1 GPUs, 10 MB used, 1 shards",
        )
        self.assertEqual(render_message({"type": "replica", "revision": 6, "id": "r", "removed": True}),
                         "#6 replica r removed")
        self.assertEqual(render_message({"type": "reset", "revision": 7, "reason": "too old"}), "#7 reset: too old")
        line = render_message({"type": "event", "revision": 8, "event": {
            "time": 0, "kind": "shard_failed", "node": "n1", "reason": "exit 1"}})
        self.assertRegex(line, r"^#8 event \d\d:\d\d:\d\d shard_failed n1: exit 1$")


class FollowsLeaderTests(TestCase):
    """
    Against an HA control plane: a member that does not lead sends the
    client to the leader, for the socket's upgrade and for each request,
    and the client follows, bounded.
    """

    def setUp(self) -> None:
        from tests.test_admin_ha import FakeHA

        self.FakeHA = FakeHA
        self.leader = control_plane(self)
        self.member = control_plane(self)
        self.leader_url = f"http://127.0.0.1:{self.leader.admin_listener.address()[1]}"
        self.member_url = f"http://127.0.0.1:{self.member.admin_listener.address()[1]}"

    def client(self, url: str) -> FleetClient:
        client = FleetClient(url, timeout=10)
        self.addCleanup(client.close)
        return client

    def desired(self, cp: Any) -> int:
        return int(cp.reconciler.deployments()[0]["desired"])

    @inlineCallbacks
    def test_write_to_a_standby_reaches_the_leader(self) -> None:
        """
        A scale sent through a member that does not lead (it answers the
        socket's upgrade with 307) is done by the leader it names, not by
        that member; the client says where it went.
        """
        self.member.ha = self.FakeHA(leader_id="cp-2", leader_admin_url=self.leader_url)
        client = self.client(self.member_url)
        answer = yield client.scale("demo", 3)
        self.assertEqual(answer["replicas"], 3)
        self.assertEqual((self.desired(self.leader), self.desired(self.member)), (3, 0))
        self.assertEqual(client.redirected_to, self.leader_url)

    @inlineCallbacks
    def test_member_that_stops_leading(self) -> None:
        """
        A member the client was talking to that stops leading answers the
        next write with 307 over the open socket; the write is sent again
        to the leader and done there.
        """
        client = self.client(self.member_url)
        yield client.nodes()
        self.member.ha = self.FakeHA(leader_id="cp-2", leader_admin_url=self.leader_url)
        answer = yield client.scale("demo", 2)
        self.assertEqual(answer["replicas"], 2)
        self.assertEqual((self.desired(self.leader), self.desired(self.member)), (2, 0))
        self.assertEqual(client.redirected_to, self.leader_url)

    @inlineCallbacks
    def test_members_naming_each_other_are_not_followed_forever(self) -> None:
        """
        Two members that each name the other are followed a bounded number
        of times; the request then fails with a FleetError instead of
        going round.
        """
        from llmgw.client import fleet

        self.member.ha = self.FakeHA(leader_id="cp-2", leader_admin_url=self.leader_url)
        self.leader.ha = self.FakeHA(member_id="cp-2", leader_id="cp-1", leader_admin_url=self.member_url)
        client = FleetClient(self.member_url, timeout=3)
        self.addCleanup(client.close)
        moves: list[str] = []
        move = client._move

        def counted(location: str, why: str) -> bool:
            moves.append(location)
            return move(location, why)

        client._move = counted  # type: ignore[method-assign]
        with self.assertRaises(FleetError):
            yield client.scale("demo", 2)
        self.assertEqual(len(moves), fleet.MAX_REDIRECTS + 1)
        self.assertEqual((self.desired(self.leader), self.desired(self.member)), (0, 0))
