"""
Tests for L{llmgw.agent.logtail}: reading a shard's log as it grows.
"""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.logtail import RING_LINES, LogTail


class LogTailTests(SynchronousTestCase):
    """
    A log file read as it grows.
    """

    def test_lines_and_partial(self) -> None:
        """
        The tail yields complete lines as they arrive and keeps a partial
        line until it is finished; the ring keeps the last lines only.
        """
        path = Path(self.mktemp())
        path.write_bytes(b"")
        tail = LogTail(path)
        with open(path, "ab") as f:
            f.write(b"one\ntw")
        self.assertEqual(tail.read(), ["one"])
        with open(path, "ab") as f:
            f.write(b"o\n" + b"".join(b"l%d\n" % i for i in range(200)))
        lines = tail.read()
        self.assertEqual(lines[0], "two")
        self.assertEqual(len(tail.lines), RING_LINES)
        self.assertEqual(tail.lines[-1], "l199")

    def test_truncated_file(self) -> None:
        """
        A log that shrank (truncated) is read again from its start.
        """
        path = Path(self.mktemp())
        path.write_bytes(b"a long first line\n")
        tail = LogTail(path)
        tail.read()
        path.write_bytes(b"new\n")
        self.assertEqual(tail.read(), ["new"])
