"""
What the reconciler decides to tell agents, as data.

Decisions return these; the reconciler's shell queues them and sends them
through the dispatcher (the agent service) only after the handler that
caused them has returned, so nothing dispatches into the agent service
from inside its own message handling.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.control.interfaces import IDispatcher, NotConnected, NotKeepingUp, ShardCommand


@dataclass(frozen=True, slots=True)
class Start:
    command: ShardCommand
    #: The first send of a new shard: a refusal tears its replica down. A
    #: re-send that is refused waits for the next try instead.
    first: bool = True

    @property
    def node_id(self) -> str:
        return self.command.node_id

    @property
    def shard_id(self) -> str:
        return self.command.shard_id


@dataclass(frozen=True, slots=True)
class Stop:
    node_id: str
    shard_id: str


@dataclass(frozen=True, slots=True)
class Drain:
    node_id: str
    shard_id: str


Command = Start | Stop | Drain


def send(dispatcher: IDispatcher | None, cmd: Command) -> str | None:
    """
    Send C{cmd}; returns why the dispatcher refused it, or C{None}.
    """
    if dispatcher is None:
        return "no dispatcher attached"
    try:
        if isinstance(cmd, Start):
            dispatcher.start_shard(cmd.command)
        elif isinstance(cmd, Stop):
            dispatcher.stop_shard(cmd.node_id, cmd.shard_id)
        else:
            dispatcher.drain_shard(cmd.node_id, cmd.shard_id)
    except (NotConnected, NotKeepingUp) as e:
        return str(e) or type(e).__name__
    return None
