"""
Real-process tests for L{llmgw.agent.supervisor}:
a shard is its whole process group, re-adoption finds a shard whose record
is damaged, and each crash class comes from a real exit. Bounded, loopback,
small Python scripts from L{llmgw.testing.procs}; every process they start
is KILLed in cleanup whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from llmgw.agent.client import reported_shard
from llmgw.agent.shard import Shard
from llmgw.agent.state import ShardSpec, StateDir
from llmgw.agent.supervisor import Supervisor
from llmgw.testing.procs import (
    CRASH_SCRIPTS,
    PARENT_WITH_CHILD,
    free_port,
    process_alive,
    wait_until,
)

TIMEOUT = 20.0


class RealShardCase(TestCase):
    """
    A supervisor on the real reactor with a state directory; no tests.
    """

    timeout = 60

    def setUp(self) -> None:
        self.state = StateDir(self.mktemp())
        self.sup = self.supervisor()
        self.states: list[tuple[str, str]] = []
        self.sup.add_listener(lambda s: self.states.append((s.shard_id, s.state)))
        self.pids: list[int] = []
        self.addCleanup(self.kill_everything)

    def supervisor(self) -> Supervisor:
        sup = Supervisor(reactor, reactor.spawnProcess, self.state, gpu_indices=[0, 1],
                         python=sys.executable, poll_interval=0.1)
        sup.startService()
        self.addCleanup(sup.stopService)
        return sup

    def kill_everything(self) -> None:
        for sup in getattr(self, "sups", [self.sup]):
            for shard in sup.shards.values():
                for pgid in shard.pgids:
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except OSError:
                        pass
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def spec(self, shard_id: str, script: str, *args: str, gpus: tuple[int, ...] = (0,),
             grace: int = 1) -> ShardSpec:
        return ShardSpec(shard_id=shard_id, replica_id="rep-1", model="m", profile="p",
                         argv=["{python}", "-c", script, *args], gpu_indices=list(gpus),
                         port=free_port(), stop_grace_s=grace)

    def child_pid(self, pidfile: Path) -> int:
        pid = int(pidfile.read_text())
        self.pids.append(pid)
        return pid


class RealShards(RealShardCase):
    @defer.inlineCallbacks
    def test_main_dies_leaving_children(self) -> Any:
        """
        A main process that exits leaving a child that ignores TERM: the
        shard is stopping while the child lives, its GPU is refused to
        another shard, the child is KILLed after the grace, and only then is
        the shard failed and its GPU free.
        """
        pidfile = Path(self.mktemp())
        shard = self.sup.start(self.spec("s1", PARENT_WITH_CHILD, str(pidfile), "ignore", "exit"))
        yield wait_until(reactor, lambda: shard.state != "starting", TIMEOUT, "main exit")
        child = self.child_pid(pidfile)
        self.assertEqual(shard.state, "stopping")
        self.assertTrue(process_alive(child))
        refused = self.sup.start(self.spec("s2", "pass", gpus=(0,)))
        self.assertEqual((refused.state, refused.error), ("failed", "GPU 0 is in use by shard s1"))
        yield wait_until(reactor, lambda: shard.state == "failed", TIMEOUT, "group empty")
        self.assertFalse(process_alive(child))
        self.assertEqual([st for sid, st in self.states if sid == "s1"],
                         ["starting", "stopping", "failed"])
        self.assertIn("exit code 1", shard.error)
        again = self.sup.start(self.spec("s3", "import time; time.sleep(30)", gpus=(0,)))
        self.assertEqual(again.state, "starting")
        self.sup.stop("s3")
        yield wait_until(reactor, lambda: again.state == "stopped", TIMEOUT, "s3 stopped")

    @defer.inlineCallbacks
    def test_kill_survives_main_exit(self) -> Any:
        """
        A stop whose main process exits on TERM while its child ignores TERM:
        the shard is stopping after the main exit, the child is KILLed after
        the grace, and the shard is stopped once the group is empty.
        """
        pidfile = Path(self.mktemp())
        shard = self.sup.start(self.spec("s1", PARENT_WITH_CHILD, str(pidfile), "ignore", "wait"))
        yield wait_until(reactor, pidfile.exists, TIMEOUT, "child started")
        child = self.child_pid(pidfile)
        self.sup.stop("s1")
        yield wait_until(reactor, lambda: shard.main_ended, TIMEOUT, "main exit")
        self.assertEqual(shard.state, "stopping")
        self.assertTrue(process_alive(child))
        yield wait_until(reactor, lambda: shard.state == "stopped", TIMEOUT, "group empty")
        self.assertFalse(process_alive(child))

    @defer.inlineCallbacks
    def test_crash_with_children(self) -> Any:
        """
        A main process that SEGVs leaving a child that obeys TERM: the child
        is TERMed at once, and the failure is an engine crash.
        """
        pidfile = Path(self.mktemp())
        shard = self.sup.start(self.spec("s1", PARENT_WITH_CHILD, str(pidfile), "obey", "segv",
                                         grace=30))
        yield wait_until(reactor, lambda: shard.state == "failed", TIMEOUT, "failed")
        self.assertFalse(process_alive(self.child_pid(pidfile)))
        self.assertEqual((shard.signal, shard.crash_class), (signal.SIGSEGV, "engine_crash"))

    @defer.inlineCallbacks
    def test_truncated_record(self) -> Any:
        """
        After an agent restart, a running shard whose record is truncated is
        still found (by the marker in its environment), reported as record
        lost with what can be recovered, and a stop ends its whole group.
        """
        pidfile = Path(self.mktemp())
        shard = self.sup.start(self.spec("s1", PARENT_WITH_CHILD, str(pidfile), "obey", "wait",
                                         gpus=(1,)))
        yield wait_until(reactor, pidfile.exists, TIMEOUT, "child started")
        child = self.child_pid(pidfile)
        self.pids.append(shard.pid or 0)
        self.sup.stopService()
        record = self.state.shards / "s1.json"
        record.write_bytes(record.read_bytes()[:40])
        again = self.supervisor()
        self.sups = [self.sup, again]
        yield again.recover()
        self.flushLoggedErrors()
        (found,) = again.held_shards()
        self.assertEqual((found.shard_id, found.record_lost, found.pid, found.spec.replica_id,
                          found.spec.model, found.spec.gpu_indices, found.spec.port),
                         ("s1", True, shard.pid, "rep-1", "m", (1,), shard.spec.port))
        self.assertEqual(found.pgids, {shard.pid})
        wire = reported_shard("node-1", found).to_message()
        self.assertEqual((wire.shard_id, wire.profile, wire.record_lost, wire.pgid),
                         ("s1", "", True, shard.pid))
        again.stop("s1")
        yield wait_until(reactor, lambda: found.state == "stopped", TIMEOUT, "stopped")
        self.assertFalse(process_alive(child))
        self.assertFalse(process_alive(shard.pid or 0))

    @defer.inlineCallbacks
    def test_crash_classes(self) -> Any:
        """
        Each crash class from a real process that ends that way: a usage
        error (exit 2), a CUDA OOM traceback, a taken port, SIGSEGV, a
        traceback, a KILL nobody asked for, and an unexplained exit.
        """
        taken = socket.socket()
        self.addCleanup(taken.close)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        expected = {"config": "config", "oom": "oom", "port_in_use": "port_in_use",
                    "engine_crash": "engine_crash", "traceback": "engine_crash",
                    "killed": "killed", "unknown": "unknown"}
        shards: dict[str, Shard] = {}
        for name, script in CRASH_SCRIPTS.items():
            shards[name] = self.sup.start(self.spec(name.replace("_", "-"), script, port, gpus=()))
        yield wait_until(reactor, lambda: all(s.state == "failed" for s in shards.values()),
                         TIMEOUT, "every script failed")
        got = {name: s.crash_class for name, s in shards.items()}
        self.assertEqual(got, expected)


class LocalShutdownTests(RealShardCase):
    @defer.inlineCallbacks
    def test_stop_shards_waits_for_groups(self) -> Any:
        """
        The local fleet's shutdown (L{LocalFleet.stop_shards}) returns only
        once every shard's process group is empty: a child that ignores TERM
        is dead by then, KILLed after the grace.
        """
        from types import SimpleNamespace

        from twisted.logger import Logger

        from llmgw.local import LocalFleet

        pidfile = Path(self.mktemp())
        shard = self.sup.start(self.spec("s1", PARENT_WITH_CHILD, str(pidfile), "ignore", "wait"))
        yield wait_until(reactor, pidfile.exists, TIMEOUT, "child started")
        child = self.child_pid(pidfile)
        fleet = SimpleNamespace(agents=[SimpleNamespace(supervisor=self.sup)], reactor=reactor,
                                log=Logger())
        yield LocalFleet.stop_shards(fleet)  # type: ignore[arg-type]
        self.assertEqual(shard.state, "stopped")
        self.assertFalse(process_alive(child))
        self.assertFalse(process_alive(shard.pid or 0))
