"""
End to end: the local fleet started as a user starts it (a real process),
used through the gateway with the official C{openai} client, a shard killed
and replaced, and a SIGTERM that leaves no process behind.

Bounded: every wait has a deadline, and cleanup kills whatever is left even
when an assertion fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.state import StateDir
from llmgw.local import demo_catalog
from llmgw.testing.ports import free_port, port_block, wait_bound, with_ports
from llmgw.testing.procs import processes_marked

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0




def llmgw_command() -> list[str]:
    """
    The console script beside this interpreter when installed, else the
    same entry point through the interpreter.
    """
    script = Path(sys.executable).parent / "llmgw"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "llmgw.ctl.main"]


def processes_mentioning(text: str) -> list[int]:
    """
    Pids of live processes whose command line contains C{text}.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


class LocalFleetHarness:
    """
    A real C{llmgw local} fleet in its own process for an end-to-end test
    (mixed into a L{SynchronousTestCase}): started by L{start_fleet},
    killed with every process it started at cleanup.
    """

    dir: Path
    fleet: subprocess.Popen[bytes]

    def start_fleet(self, *extra: str) -> None:
        """
        Start the fleet on ports of its own: the gateway's and admin's free
        at the time (picked again if another process took one before the
        fleet bound it), shards in a block of test ports rather than the
        demo catalog's, so a developer's own C{llmgw local} may run alongside.
        """
        case: Any = self
        self.dir = Path(case.mktemp()).resolve()
        self.dir.mkdir(parents=True)
        args = list(extra)
        if "--catalog" in args:
            catalog = Path(args[args.index("--catalog") + 1])
        else:
            catalog = demo_catalog(self.dir)
            args += ["--catalog", str(catalog)]
        catalog.write_text(with_ports(catalog.read_text(), *port_block(case)))
        self.log = open(self.dir / "fleet.log", "w+b")  # noqa: SIM115
        case.addCleanup(self.log.close)
        case.addCleanup(self.kill_everything)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        for _ in range(3):
            self.gateway_port, self.admin_port = free_port(), free_port()
            self.log.truncate(0)
            self.fleet = subprocess.Popen(
                [*llmgw_command(), "local", "--gateway", f"127.0.0.1:{self.gateway_port}",
                 "--admin", f"127.0.0.1:{self.admin_port}", "--heartbeat", "1", *args],
                cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            if wait_bound(self.fleet, [self.admin_port, self.gateway_port], self.output, DEADLINE):
                break

    def kill_everything(self) -> None:
        if self.fleet.poll() is None:
            os.killpg(self.fleet.pid, signal.SIGKILL)
            self.fleet.wait(10)
        # Shards (and their children) carry their agent's state directory in
        # their environment, not in their command lines.
        for pid in processes_mentioning(str(self.dir)) + processes_marked(str(self.dir)):
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace")
        # The admin API's access log is the test's own polling.
        return "\n".join(line for line in text.splitlines() if '"GET /api/v1/' not in line)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = DEADLINE) -> Any:
        case: Any = self
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except OSError:
                value = None
            if value:
                return value
            if self.fleet.poll() is not None:
                case.fail(f"the fleet exited ({self.fleet.returncode}) while waiting for "
                          f"{what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                case.fail(f"timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.2)


class LocalFleetEndToEndTests(LocalFleetHarness, SynchronousTestCase):
    def setUp(self) -> None:
        self.start_fleet()

    def admin(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    def ready_replicas(self) -> dict[str, dict[str, Any]]:
        replicas = self.admin("/api/v1/replicas")["replicas"]
        return {r["id"]: r for r in replicas if r["state"] == "ready"}

    def shard_pids(self) -> dict[str, int]:
        pids = {}
        for state in (self.dir / "local-state").glob("agent-*"):
            for record in StateDir(state).load_all():
                pids[record.spec.replica_id] = record.pid
        return pids

    def test_local_fleet(self) -> None:
        """
        The fleet comes up with two ready replicas and says so; a chat
        completion and a streamed one go through the gateway; a killed shard
        is replaced and its replica ready again; SIGTERM stops everything,
        with no warning that a shard stopped unasked.
        """
        from openai import OpenAI

        self.wait("the ready message", lambda: "fleet is ready" in self.output())
        self.assertIn(f"curl -s http://127.0.0.1:{self.gateway_port}/v1/chat/completions",
                      self.output())
        ready = self.wait("two ready replicas", lambda: len(self.ready_replicas()) == 2 and
                          self.ready_replicas())
        nodes = {r["shards"][0]["node"] for r in ready.values()}
        self.assertEqual(nodes, {"local-1", "local-2"})

        client = OpenAI(base_url=f"http://127.0.0.1:{self.gateway_port}/v1", api_key="none",
                        timeout=10, max_retries=0)
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello"}])
        self.assertTrue(reply.choices[0].message.content)
        chunks = list(client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello"}], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertGreater(len(chunks), 2)
        self.assertTrue(text)

        victim = sorted(ready)[0]
        pids = self.shard_pids()
        self.assertIn(victim, pids)
        os.killpg(pids[victim], signal.SIGKILL)
        replaced = self.wait(
            "the killed replica replaced and ready",
            lambda: (lambda r: len(r) == 2 and victim not in r and r)(self.ready_replicas()),
        )
        self.assertNotIn(victim, replaced)
        events = self.admin("/api/v1/events")["events"]
        self.assertTrue(any(e.get("replica") == victim and "fail" in e["kind"] for e in events),
                        events)
        again = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "again"}])
        self.assertTrue(again.choices[0].message.content)

        shard_pids = list(self.shard_pids().values())
        self.fleet.send_signal(signal.SIGTERM)
        try:
            self.fleet.wait(30)
        except subprocess.TimeoutExpired:
            self.fail(f"the fleet did not stop on SIGTERM:\n{self.output()[-4000:]}")
        # Its own stop is not news: no shard "stopped without being told to".
        self.assertNotIn("stopped without being told to", self.output())
        self.assertEqual(processes_mentioning(str(self.dir)), [])
        self.assertEqual(processes_marked(str(self.dir)), [])
        for pid in shard_pids:
            self.assertFalse(Path(f"/proc/{pid}").exists() and
                             processes_mentioning(str(self.dir)), pid)
