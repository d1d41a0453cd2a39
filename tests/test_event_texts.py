"""
How events read where people see them: C{llmgw ctl watch} and C{llmgw ctl
events}. No empty field after the kind of an event that names no node,
replica or shard (C{scaled}), and how a process ended said once.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.ctl.fleet import render_events
from llmgw.ctl.watch import render_message


class WatchLineTests(SynchronousTestCase):
    def test_event_without_where(self) -> None:
        """
        An event naming no node, replica or shard reads C{KIND: REASON},
        with no space before the colon.
        """
        line = render_message({"type": "event", "revision": 9, "event": {
            "time": 0, "kind": "scaled", "reason": "deployment demo from 1 to 2 replicas"}})
        self.assertRegex(line, r"^#9 event \d\d:\d\d:\d\d scaled: deployment demo from 1 to 2 replicas$")

    def test_event_with_where(self) -> None:
        """
        Node, replica and shard follow the kind, space-separated.
        """
        line = render_message({"type": "event", "revision": 3, "event": {
            "time": 0, "kind": "shard_failed", "node": "n1", "replica": "r1", "reason": "x"}})
        self.assertRegex(line, r"^#3 event \d\d:\d\d:\d\d shard_failed n1 r1: x$")


class EventsTableTests(SynchronousTestCase):
    def reason(self, **event: object) -> str:
        out = render_events([{"time": 0, "kind": "shard_failed", **event}])
        return out.splitlines()[1].split("  shard_failed", 1)[1]

    def test_signal_said_once(self) -> None:
        """
        A reason that says how the process ended (the agent's "killed by
        signal 9") is not followed by the signal again; a reason that does
        not gets it in parentheses.
        """
        said = self.reason(reason="exited without being asked to (killed by signal 9)", signal=9)
        self.assertEqual(said.count("signal 9"), 1, said)
        bare = self.reason(reason="the process failed", signal=9)
        self.assertIn("the process failed (signal 9)", bare)

    def test_exit_code_said_once(self) -> None:
        """
        Likewise an exit code the reason already gives.
        """
        said = self.reason(reason="exited without being asked to (exit code 3)", exit_code=3)
        self.assertNotIn("(exit 3)", said)
        bare = self.reason(reason="the process failed", exit_code=3)
        self.assertIn("the process failed (exit 3)", bare)
