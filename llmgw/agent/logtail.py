"""
A shard's log file read as it grows: its lines go to the agent's log, and
the last of them are the shard's "last output" when it fails.

A shard writes its stdout and stderr to a file in the state directory, not
to a pipe to the agent, so that it outlives the agent (a pipe whose reader
died would kill it with SIGPIPE on its next line); L{LogTail} is the
agent's side of that file.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

#: Lines of output kept per shard for its "last output".
RING_LINES = 100
#: Longest line kept; longer ones are cut.
LINE_MAX = 2000
#: Most bytes read from one shard's log per tail pass.
TAIL_CHUNK = 256 * 1024
#: A shard log over this size is truncated once read (its lines are already
#: in the agent's log); the shard appends, so it carries on at the new end.
LOG_MAX = 32 * 1024 * 1024
#: How much of an existing log a tail opened at its end still reads: what
#: the shard wrote while no agent watched.
ADOPTED_TAIL = 16 * 1024


class LogTail:
    """
    Reads a shard's log file as it grows, keeping the last L{RING_LINES}
    lines in L{lines}.

    @param from_end: start near the end of what the file already holds (the
        last L{ADOPTED_TAIL} bytes), for a shard the agent re-adopts.
    """

    def __init__(self, path: Path, from_end: bool = False):
        self.path = path
        self.lines: collections.deque[str] = collections.deque(maxlen=RING_LINES)
        self.offset = 0
        self._partial = b""
        if from_end:
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            self.offset = max(0, size - ADOPTED_TAIL)
            self.read()

    def read(self) -> list[str]:
        """
        New complete lines since the last call (at most L{TAIL_CHUNK} bytes);
        C{[]} when the file cannot be read. A file that shrank is read again
        from its start.
        """
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                data = f.read(TAIL_CHUNK)
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > LINE_MAX:
            parts.append(self._partial)
            self._partial = b""
        lines = [p.decode("utf-8", "replace").rstrip("\r")[:LINE_MAX] for p in parts]
        self.lines.extend(lines)
        if self.offset > LOG_MAX and not self._partial and len(data) < TAIL_CHUNK:
            try:
                os.truncate(self.path, 0)
                self.offset = 0
            except OSError:
                pass
        return lines

    def flush_partial(self) -> None:
        """
        Keep an unfinished last line as a line (the shard has ended).
        """
        if self._partial:
            self.lines.append(self._partial.decode("utf-8", "replace")[:LINE_MAX])
            self._partial = b""

    def last_output(self) -> str:
        """
        The lines kept, one string.
        """
        return "\n".join(self.lines)
