"""
What a decision returns (DESIGN §6.7): the commands to send to agents and
the events to log, in the order they were decided.

Decisions append to an L{Outcome}; the reconciler's shell logs its events
and queues its commands, which go out only after the handler that caused
them has returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmgw.control.core.commands import Command


@dataclass(frozen=True, slots=True)
class Notice:
    """
    An event decided, to be logged by the shell (L{llmgw.control.state.events}).
    """

    kind: str
    level: str
    fields: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    commands: list[Command] = field(default_factory=list)
    events: list[Notice] = field(default_factory=list)
    #: The cordoned or draining nodes changed: the shell keeps them in the
    #: state file.
    nodes_changed: bool = False

    def send(self, cmd: Command) -> None:
        self.commands.append(cmd)

    def event(self, kind: str, *, level: str = "info", **fields: Any) -> None:
        self.events.append(Notice(kind, level, fields))
