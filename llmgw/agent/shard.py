"""
One shard as the supervisor sees it (L{Shard}), the states it moves through,
and the named timers that run while it lives (L{ShardTimers}).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from llmgw.agent.logtail import LINE_MAX, RING_LINES, LogTail
from llmgw.agent.state import ShardSpec
from llmgw.models.cache import Progress
from llmgw.states import ShardState

FETCHING = ShardState.FETCHING
STARTING = ShardState.STARTING
READY = ShardState.READY
DRAINING = ShardState.DRAINING
STOPPING = ShardState.STOPPING
STOPPED = ShardState.STOPPED
FAILED = ShardState.FAILED
LIVE_STATES = (STARTING, READY, DRAINING)
#: States in which a shard holds its GPUs and port: its weights are being
#: fetched for it, or its group may have members.
HELD_STATES = (FETCHING, *LIVE_STATES, STOPPING)

#: The exit code reported when a re-adopted shard ended and its status is
#: unknowable (it was not this process's child).
UNKNOWN_EXIT = -1
#: Lines the launcher wrote before its output went to the log file.
STARTUP_LINES = 20


class Shard:
    """
    One shard the supervisor runs or ran. Read-only to everything but the
    supervisor and its collaborators.
    """

    def __init__(self, spec: ShardSpec, state: str = STARTING):
        self.spec = spec
        self.state = state
        self.error = ""
        self.exit_code = 0
        self.signal = 0
        self.pid: int | None = None
        self.start_time: int | None = None
        self.process: Any = None
        self.adopted = False
        #: Found by its environment marker, its record lost: its profile and
        #: command are unknown, so it is only ever stopped.
        self.record_lost = False
        #: Set once TERM has gone to its group (asked, or its main process ended).
        self.stopping = False
        #: Set when a stop is the supervisor's own doing (a timeout): the
        #: shard ends failed with this error instead of stopped.
        self.stop_error = ""
        #: The process groups that make up the shard (its main process's, and
        #: any other found carrying its marker at the agent's start).
        self.pgids: set[int] = set()
        #: Whether the main process has ended (the group may live on).
        self.main_ended = False
        #: The state it takes once its group is empty: stopped or failed.
        self.final_state = ""
        #: The class of its failure (L{llmgw.crash.CrashClass}), "" if none.
        self.crash_class = ""
        #: When the KILL went out (clock seconds), for "survives KILL".
        self.killed_at: float | None = None
        self.survivors_logged = False
        self.term_sent = False
        self.tail: LogTail | None = None
        self.probe_failures = 0
        self.last_probe_error = ""
        #: Its running timers by name (L{ShardTimers}).
        self.timers: dict[str, IDelayedCall] = {}
        #: While fetching: the Deferred of its weights' path (cancel drops it).
        self.fetch: Deferred[Any] | None = None
        #: The latest progress of its fetch, if it has one.
        self.progress: Progress | None = None
        #: The cache key its model is pinned under in the node's cache, "" if none.
        self.pinned = ""
        self._startup_output: collections.deque[str] = collections.deque(maxlen=STARTUP_LINES)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def live(self) -> bool:
        """
        Starting, ready or draining: its main process runs.
        """
        return self.state in LIVE_STATES

    @property
    def held(self) -> bool:
        """
        Fetching, live or stopping: its group may have members (or will),
        and its GPUs and port are not free.
        """
        return self.state in HELD_STATES

    def add_startup_output(self, text: str) -> None:
        """
        Keep what the launcher wrote before the log file took its output.
        """
        for line in text.splitlines():
            self._startup_output.append(line[:LINE_MAX])

    def last_output(self) -> str:
        """
        The last L{RING_LINES} lines the shard wrote, launcher's first.
        """
        lines = list(self._startup_output)
        if self.tail is not None:
            lines += list(self.tail.lines)
        return "\n".join(lines[-RING_LINES:])


class ShardTimers:
    """
    Named timers on a shard (C{shard.timers}), one per name, on C{clock}.
    Setting a name cancels the one it replaces.
    """

    def __init__(self, clock: Any):
        self.clock = clock

    def set(self, shard: Shard, name: str, seconds: float, fn: Callable[..., Any],
            *args: Any) -> None:
        self.cancel(shard, name)
        shard.timers[name] = self.clock.callLater(seconds, fn, *args)

    def fired(self, shard: Shard, name: str) -> None:
        """
        Forget C{name}: its call is running now.
        """
        shard.timers.pop(name, None)

    def cancel(self, shard: Shard, *names: str) -> None:
        for name in names:
            call = shard.timers.pop(name, None)
            if call is not None and call.active():
                call.cancel()

    def cancel_all(self, shard: Shard) -> None:
        self.cancel(shard, *list(shard.timers))
