"""
The reconciler's outbox (DESIGN §6.7): commands decided while handling an
input are sent only after that handler has returned, in the same reactor
turn (C{callLater(0)}), never re-entrantly from inside the agent service's
own message handling; and then the models whose routes changed are
projected from the fleet state into the published routing table, so that
the inputs of one reactor turn share one publication.

A command its node could not be sent is an input like any other
(L{reports.refused}); what that decides goes through the shell's
C{apply}, and its commands are sent in the same flush.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.control.core import reports, swapping
from llmgw.control.core.commands import Command, Start
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.routing import RoutingTable


class Outbox:
    """
    @param send: sends one command; returns why it was refused, or C{None}.
    @param apply: takes the outcome of a refusal (logs its events and
        queues its commands here).
    @ivar held: while true (a pass is under way) nothing is scheduled; the
        pass flushes at its end.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, ctx: Context, table: RoutingTable,
                 send: Callable[[Command], str | None], apply: Callable[[Outcome], None]):
        self._clock = clock
        self._ctx = ctx
        self._table = table
        self._send = send
        self._apply = apply
        self._queue: list[Command] = []
        self._room: dict[str, float] = {}
        self._call: IDelayedCall | None = None
        self.held = False

    def extend(self, commands: Iterable[Command]) -> None:
        self._queue.extend(commands)

    def settle(self) -> None:
        """
        End of an input: flush once the caller has returned, if there is
        anything to send or publish.
        """
        if self.held or self._call is not None:
            return
        if self._queue or self._ctx.state.routes_dirty:
            self._call = self._clock.callLater(0, self.flush)

    def flush(self) -> None:
        """
        Send the queued commands (a start made obsolete meanwhile is not
        sent), then publish the routes that changed.
        """
        self.cancel()
        now = self._clock.seconds()
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                for cmd in batch:
                    self._one(cmd, now)
        finally:
            st = self._ctx.state
            for model in sorted(st.take_routes_dirty()):
                self._table.publish_model(model, st.routes(model))
            room = self._ctx.room
            if room or self._room:
                # The gateways keep requests longer while room is made for
                # their model: they learn it with the queue limits (set
                # again while any is, over a catalog publication of them).
                self._room = dict(room)
                self._table.set_queue_limits(swapping.queue_limits(self._ctx.catalog, room))

    def _one(self, cmd: Command, now: float) -> None:
        # One command's failure is its own: the rest of the batch still goes.
        try:
            if isinstance(cmd, Start) and reports.obsolete(self._ctx, cmd):
                return
            why = self._send(cmd)
        except Exception as e:
            self.log.failure("sending {command} failed", command=cmd)
            why = f"sending it failed: {type(e).__name__}: {e}"
        if why is None:
            return
        out = Outcome()
        try:
            reports.refused(self._ctx, cmd, why, now, out)
        except Exception:
            self.log.failure("handling the refusal of {command} failed", command=cmd)
        self._apply(out)

    def cancel(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
