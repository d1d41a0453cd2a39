"""
Tests for L{llmgw.ctl.fleet}: C{llmgw ctl status|nodes|deployments|replicas|events|
cordon|uncordon|drain|scale|retry|reload} against the admin API, in process
(through L{StubTreq}) and once over a real loopback socket.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet import reactor as global_reactor
from twisted.internet import threads
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.site import admin_site
from llmgw.control.shell.metrics import make_registry
from llmgw.control.state.interfaces import AdminError
from llmgw.ctl import fleet as ctl
from llmgw.ctl.main import build_parser
from llmgw.testing.fleet import FakeFleet, sample_fleet

NOW = 1_700_000_100.0


def stub_http(resource: Any, calls: list[tuple[str, str, Any]]) -> ctl.HTTPFunction:
    """
    An L{ctl.HTTPFunction} that answers from C{resource} in process, as
    the admin API would over the network, recording each request.
    """
    stub: Any = StubTreq(resource)

    def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        calls.append((method, url, json.loads(body) if body else None))
        got: list[Any] = []
        d = stub.request(method, url, data=body, headers={"Content-Type": ["application/json"]})
        d.addCallback(lambda r: stub.content(r).addCallback(lambda c: (r.code, c)))
        d.addBoth(got.append)
        stub.flush()
        assert got, "the stub answered nothing"
        if not isinstance(got[0], tuple):
            got[0].raiseException()
        return got[0]  # type: ignore[no-any-return]

    return http


def canned(status: int, body: bytes) -> ctl.HTTPFunction:
    def http(method: str, url: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
        return status, body

    return http


def unreachable(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    raise ctl.Unreachable("[Errno 111] Connection refused")


class CtlTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = sample_fleet()
        self.calls: list[tuple[str, str, Any]] = []
        self.http = stub_http(AdminResource(self.fleet, make_registry()), self.calls)

    def ctl(self, *argv: str, http: ctl.HTTPFunction | None = None) -> tuple[int, str, str]:
        """
        Run C{llmgw ctl ARGV}; return the exit code, stdout and stderr.
        """
        args = build_parser().parse_args(["ctl", *argv])
        out, err = io.StringIO(), io.StringIO()
        code = args.func(args, out=out, err=err, http=http or self.http, now=NOW)
        return code, out.getvalue(), err.getvalue()

    def assertUsageError(self, *argv: str) -> None:
        with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["ctl", *argv])
        self.assertEqual(cm.exception.code, ctl.EXIT_USAGE)


class ViewTests(CtlTestCase):
    def test_nodes_table(self) -> None:
        """
        C{ctl nodes} prints one row per node with its state, scheduling,
        free memory and how long ago it was heard from.
        """
        self.fleet.node_views["gpu-1"]["cordoned"] = True
        self.fleet.node_views["gpu-2"]["gpus"][1]["problems"] = ["xid 79"]
        code, out, err = self.ctl("nodes")
        self.assertEqual((code, err), (0, ""))
        lines = out.splitlines()
        self.assertTrue(lines[0].startswith("NODE"))
        self.assertEqual(len(lines), 3)
        self.assertIn("gpu-1", lines[1])
        self.assertIn("cordoned", lines[1])
        self.assertIn("156/156 GiB", lines[1])
        self.assertIn("100s ago", lines[1])
        self.assertIn("suspect", lines[2])
        self.assertIn("gpu1: xid 79", lines[2])
        self.assertEqual(self.calls, [("GET", "http://127.0.0.1:7480/api/v1/nodes", None)])

    def test_nodes_json(self) -> None:
        """
        C{--json} prints the API's answer unchanged (the API adds each
        node's stray processes, none here).
        """
        code, out, _ = self.ctl("nodes", "--json")
        self.assertEqual(code, 0)
        self.assertEqual(json.loads(out), {"nodes": [{**n, "stray_processes": []} for n in self.fleet.nodes()]})

    def test_replicas(self) -> None:
        """
        C{ctl replicas} shows each replica's state, leader address and
        shards; C{--model} keeps one model's.
        """
        self.fleet.add_replica("r9", "org/big", [("gpu-1", "10.0.0.1:8001"), ("gpu-2", "10.0.0.2:8001")],
                               state="starting")
        code, out, _ = self.ctl("replicas")
        self.assertEqual(code, 0)
        lines = out.splitlines()
        self.assertIn("10.0.0.1:8000", lines[1])
        self.assertIn("gpu-1/0:ready", lines[1])
        self.assertIn("gpu-1/0:starting gpu-2/1:starting", lines[2])
        code, out, _ = self.ctl("replicas", "--model", "demo", "--json")
        self.assertEqual([r["id"] for r in json.loads(out)["replicas"]], ["r1"])

    def test_status(self) -> None:
        """
        C{ctl status} prints the fleet summary and a row per deployment
        with its backoff and last failure, and warns loudly when
        replacements are frozen.
        """
        dep = self.fleet.deployment_views["demo"]
        dep["backoff_until"] = NOW + 40
        dep["last_failure"] = {"node": "gpu-2", "replica": "r2", "shard": "r2-s0", "exit_code": 1,
                               "signal": 0, "error": "", "last_output": "boom", "time": NOW - 30}
        code, out, _ = self.ctl("status")
        self.assertEqual(code, 0)
        self.assertIn("nodes", out)
        self.assertIn("ready=1 suspect=1", out)
        self.assertNotIn("FROZEN", out)
        demo = [line for line in out.splitlines() if line.startswith("demo")][0]
        self.assertIn("in 40s", demo)
        self.assertIn("30s ago on gpu-2: exit 1", demo)
        self.assertTrue([line for line in out.splitlines() if line.startswith("org/big")])
        self.fleet.frozen = True
        _, out, _ = self.ctl("status")
        self.assertIn("replacements are FROZEN: more than half the nodes are suspect", out)
        _, out, _ = self.ctl("status", "--json")
        answer = json.loads(out)
        self.assertTrue(answer["status"]["replacements_frozen"])
        self.assertEqual(len(answer["deployments"]), 2)

    def test_events(self) -> None:
        """
        C{ctl events} prints events oldest first; C{--since} takes seconds
        since 1970 or a duration ago, and C{--limit} keeps the last N.
        """
        code, out, _ = self.ctl("events")
        self.assertEqual(code, 0)
        lines = out.splitlines()
        self.assertEqual(len(lines), 3)
        self.assertIn("placed", lines[1])
        self.assertIn("exited with 1 (exit 1)", lines[2])
        _, out, _ = self.ctl("events", "--since", "150")
        self.assertEqual(len(out.splitlines()), 2)
        self.assertEqual(self.calls[-1][1], "http://127.0.0.1:7480/api/v1/events?since=150.0")
        self.ctl("events", "--since", "10m")
        self.assertEqual(self.calls[-1][1], f"http://127.0.0.1:7480/api/v1/events?since={NOW - 600!r}")
        _, out, _ = self.ctl("events", "--limit", "1", "--json")
        self.assertEqual([e["kind"] for e in json.loads(out)["events"]], ["shard_failed"])

    def test_empty(self) -> None:
        """
        An empty fleet prints a plain sentence, not an empty table.
        """
        self.http = stub_http(AdminResource(FakeFleet(), make_registry()), self.calls)
        self.assertEqual(self.ctl("nodes")[1], "no nodes\n")
        self.assertEqual(self.ctl("replicas")[1], "no replicas\n")
        self.assertEqual(self.ctl("events")[1], "no events\n")

    def test_terminal_escapes(self) -> None:
        """
        Control characters from the fleet (a model's output, a reason) are
        escaped, never sent raw to the terminal.
        """
        self.fleet.add_event(300.0, "shard_failed", "bad\x1b[2J\nthing", node="gpu-1")
        _, out, _ = self.ctl("events")
        self.assertNotIn("\x1b", out)
        self.assertIn("bad\\x1b[2J thing", out)


class ActionTests(CtlTestCase):
    def test_cordon_uncordon_drain(self) -> None:
        """
        C{ctl cordon|uncordon|drain NODE} POST to the node's action and
        say what was done.
        """
        self.assertEqual(self.ctl("cordon", "gpu-1"), (0, "node gpu-1 cordoned\n", ""))
        self.assertTrue(self.fleet.node_views["gpu-1"]["cordoned"])
        self.assertEqual(self.ctl("uncordon", "gpu-1")[0], 0)
        self.assertEqual(self.ctl("drain", "gpu-2"), (0, "node gpu-2 draining\n", ""))
        self.assertEqual(
            [c[:2] for c in self.calls],
            [("POST", "http://127.0.0.1:7480/api/v1/nodes/gpu-1/cordon"),
             ("POST", "http://127.0.0.1:7480/api/v1/nodes/gpu-1/uncordon"),
             ("POST", "http://127.0.0.1:7480/api/v1/nodes/gpu-2/drain")],
        )

    def test_refused(self) -> None:
        """
        A 4xx from the control plane exits 1 with its reason on stderr;
        with C{--json} the error object goes to stdout too.
        """
        code, out, err = self.ctl("cordon", "gpu-9")
        self.assertEqual((code, out), (ctl.EXIT_REFUSED, ""))
        self.assertIn("no node named 'gpu-9'", err)
        self.assertIn("HTTP 404", err)
        code, out, err = self.ctl("drain", "gpu-9", "--json")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertEqual(json.loads(out)["status"], 404)

    def test_scale(self) -> None:
        """
        C{ctl scale MODEL N} sets the desired count; a model name with a
        slash is escaped into one path segment.
        """
        self.assertEqual(self.ctl("scale", "demo", "4"), (0, "demo: desired replicas set to 4\n", ""))
        self.assertEqual(self.fleet.deployment_views["demo"]["desired"], 4)
        self.assertEqual(self.ctl("scale", "org/big", "0")[0], 0)
        self.assertEqual(self.calls[-1], ("POST", "http://127.0.0.1:7480/api/v1/deployments/org%2Fbig/scale",
                                          {"replicas": 0}))
        self.assertEqual(self.fleet.calls[-1], ("scale", "org/big", 0))
        code, _, err = self.ctl("scale", "nope", "1")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("nope", err)

    def test_reload(self) -> None:
        """
        C{ctl reload} prints what changed; a refused catalog exits 1 with
        the reason.
        """
        self.fleet.reload_result = {"added": ["x"], "removed": [], "changed": []}
        code, out, _ = self.ctl("reload")
        self.assertEqual(code, 0)
        self.assertIn("added=x", out)
        self.fleet.reload_result = AdminError("profiles.fake-1gpu.shards: must be at least 1")
        code, _, err = self.ctl("reload")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("profiles.fake-1gpu.shards", err)


class ExitCodeTests(CtlTestCase):
    def test_usage_errors(self) -> None:
        """
        Bad arguments exit 2 before anything is sent.
        """
        self.assertUsageError("scale", "demo", "-1")
        self.assertUsageError("scale", "demo", "two")
        self.assertUsageError("scale", "demo")
        self.assertUsageError("cordon", "Bad_Node")
        self.assertUsageError("nodes", "--admin-url", "ftp://host")
        self.assertUsageError("nodes", "--admin-url", "http://host:port")
        self.assertUsageError("nodes", "--timeout", "0")
        self.assertUsageError("events", "--since", "yesterday")
        self.assertUsageError("events", "--since=-5m")
        self.assertUsageError("frobnicate")
        self.assertEqual(self.calls, [])

    def test_unreachable(self) -> None:
        """
        No answer from the control plane exits 3 and says where it looked.
        """
        code, out, err = self.ctl("nodes", "--admin-url", "http://10.1.2.3:7480", http=unreachable)
        self.assertEqual((code, out), (ctl.EXIT_UNREACHABLE, ""))
        self.assertIn("cannot reach the control plane at http://10.1.2.3:7480", err)

    def test_server_failure(self) -> None:
        """
        A 5xx, an answer that is not JSON, or JSON of another shape exits 4.
        """
        code, _, err = self.ctl("nodes", http=canned(500, b'{"error": "internal error", "status": 500}'))
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("internal error", err)
        code, _, err = self.ctl("nodes", http=canned(200, b"<html>hello</html>"))
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("not JSON", err)
        code, _, err = self.ctl("nodes", http=canned(200, b'{"something": "else"}'))
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("unexpected answer", err)
        code, _, err = self.ctl("nodes", http=canned(404, b"Not Found"))
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("Not Found", err)


def closed_port() -> int:
    """
    A loopback port with nothing listening on it: outside the ephemeral
    range, where another test's port-0 listener could land.
    """
    from llmgw.testing.ports import free_port

    return free_port()


class LoopbackTests(TestCase):
    """
    The ctl's real HTTP client against the admin site on a loopback port.
    """

    timeout = 20

    @inlineCallbacks
    def test_real_http(self) -> Any:
        """
        Over a real socket the ctl reads replicas and its POSTs pass the
        API's JSON content-type check.
        """
        fleet = sample_fleet()
        reactor: Any = global_reactor
        port = reactor.listenTCP(0, admin_site(fleet, make_registry()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        url = f"http://127.0.0.1:{port.getHost().port}"

        def run(*argv: str) -> tuple[int, str, str]:
            args = build_parser().parse_args(["ctl", *argv, "--admin-url", url, "--timeout", "5"])
            out, err = io.StringIO(), io.StringIO()
            return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()

        code, out, err = yield threads.deferToThread(run, "replicas")
        self.assertEqual((code, err), (0, ""))
        self.assertIn("10.0.0.1:8000", out)
        code, out, err = yield threads.deferToThread(run, "cordon", "gpu-2")
        self.assertEqual((code, out, err), (0, "node gpu-2 cordoned\n", ""))
        self.assertTrue(fleet.node_views["gpu-2"]["cordoned"])
        code, _, err = yield threads.deferToThread(run, "scale", "nope", "1")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("HTTP 404", err)

    def test_nothing_listening(self) -> Deferred[None] | None:
        """
        A port with nothing listening exits 3.
        """
        args = build_parser().parse_args(
            ["ctl", "status", "--admin-url", f"http://127.0.0.1:{closed_port()}", "--timeout", "5"]
        )
        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(args.func(args, out=out, err=err), ctl.EXIT_UNREACHABLE)
        self.assertIn("cannot reach", err.getvalue())
        return None


class CrashClassTests(CtlTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.fleet.deployment_views["demo"].update(
            held={"reason": "the engine refused its arguments: unknown argument --bogus",
                  "crash_class": "config", "since": NOW - 90},
            last_failure={"node": "gpu-2", "replica": "r2", "shard": "r2-s0", "exit_code": 2,
                          "signal": 0, "error": "", "last_output": "error: unknown argument",
                          "time": NOW - 90, "crash_class": "config"},
        )

    def test_deployments_show_hold_and_class(self) -> None:
        """
        C{ctl deployments} shows a held deployment with how long, its class
        and reason, and the last failure with its class; one not held
        shows "-".
        """
        code, out, err = self.ctl("deployments")
        self.assertEqual((code, err), (0, ""))
        lines = out.splitlines()
        self.assertIn("HELD", lines[0])
        demo = [line for line in lines if line.startswith("demo")][0]
        self.assertIn("since 90s ago [config]: the engine refused its arguments: unknown argument --bogus", demo)
        self.assertIn("90s ago on gpu-2: [config] exit 2", demo)
        big = [line for line in lines if line.startswith("org/big")][0]
        self.assertNotIn("config", big)
        self.assertEqual(self.calls, [("GET", "http://127.0.0.1:7480/api/v1/deployments", None)])

    def test_status_warns_of_a_hold(self) -> None:
        """
        C{ctl status} warns of each held deployment with its class and the
        command that places it again, and its table shows the hold.
        """
        code, out, _ = self.ctl("status")
        self.assertEqual(code, 0)
        self.assertIn("WARNING        deployment demo is HELD after a config failure; "
                      "`llmgw ctl retry demo` places it again", out)
        self.assertIn("[config]: the engine refused", out)
        self.fleet.retry("demo")
        _, out, _ = self.ctl("status")
        self.assertNotIn("HELD after", out)

    def test_retry(self) -> None:
        """
        C{ctl retry MODEL} POSTs the retry (a slash in the name escaped),
        says what happened, and the hold is gone; an unknown model exits 1
        with the API's reason.
        """
        code, out, err = self.ctl("retry", "demo")
        self.assertEqual((code, out, err), (0, "demo: hold and backoff cleared; it is placed again\n", ""))
        self.assertIsNone(self.fleet.deployment_views["demo"]["held"])
        code, _, _ = self.ctl("retry", "org/big")
        self.assertEqual(code, 0)
        self.assertEqual(self.calls[1][:2], ("POST", "http://127.0.0.1:7480/api/v1/deployments/org%2Fbig/retry"))
        self.assertEqual(self.fleet.calls, [("retry", "demo"), ("retry", "org/big")])
        code, _, err = self.ctl("retry", "nope")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("nope", err)
        self.assertIn("HTTP 404", err)

    def test_events_show_class(self) -> None:
        """
        C{ctl events} shows a failure event's crash class after its reason.
        """
        self.fleet.add_event(300.0, "shard_failed", "exited with 2", node="gpu-2", replica="r3",
                             shard="r3-s0", exit_code=2, signal=0, crash_class="config")
        code, out, _ = self.ctl("events")
        self.assertEqual(code, 0)
        self.assertIn("exited with 2 (exit 2) [config]", out.splitlines()[-1])
        self.assertNotIn("[", out.splitlines()[1])

    def test_nodes_show_strays(self) -> None:
        """
        C{ctl nodes} shows each node's stray processes (pid and the shard
        its marker names), at most five and a count of the rest.
        """
        self.fleet.node_views["gpu-1"]["stray_processes"] = [
            {"pid": 100 + i, "pgid": 100, "shard_id": f"r0-s{i}", "reason": "", "command": ""} for i in range(7)
        ]
        code, out, _ = self.ctl("nodes")
        self.assertEqual(code, 0)
        lines = out.splitlines()
        self.assertIn("STRAYS", lines[0])
        self.assertIn("100 (r0-s0), 101 (r0-s1), 102 (r0-s2), 103 (r0-s3), 104 (r0-s4) +2 more", lines[1])
        self.assertNotIn("(r0-", lines[2])


class FollowedAnswerTests(CtlTestCase):
    def test_published_answer_says_so(self) -> None:
        """
        An answer from a member that does not lead (it carries
        published_at) prints the same table, and says on stderr which leader
        published it and when; --json prints it unchanged.
        """
        answer = {"nodes": ctl_json_nodes(self), "published_at": 1_700_000_000.0, "published_by": "cp-2"}
        http = canned(200, json.dumps(answer).encode())
        code, out, err = self.ctl("nodes", http=http)
        self.assertEqual(code, 0)
        self.assertTrue(out.startswith("NODE"), out)
        self.assertIn("from what leader cp-2 published at 2023-11-14T22:13:20Z", err)
        code, out, err = self.ctl("nodes", "--json", http=http)
        self.assertEqual((code, err, json.loads(out)), (0, "", answer))


def ctl_json_nodes(case: CtlTestCase) -> Any:
    """The nodes the sample fleet's admin API answers."""
    code, out, _ = case.ctl("nodes", "--json")
    assert code == 0
    return json.loads(out)["nodes"]
