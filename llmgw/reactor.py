"""
The reactor the gateway's own process runs on: Twisted's epoll reactor, less
the log context it builds around every event.

For each ready descriptor, L{twisted.internet.epollreactor.EPollReactor}
calls C{log.callWithLogger}: it asks the descriptor for its log prefix,
copies the legacy logging context into a new dictionary with it, pushes
that, calls the handler, pops it. The context only labels events written
with the legacy C{twisted.python.log} API while the handler runs (llmgw
logs with C{twisted.logger}, which does not read it), and it costs a
proxied request about as much CPU as parsing its head: each request is
two such events, a read from the client and one from the replica.

L{LeanEPollReactor} dispatches each event with the same handling as the
epoll reactor (C{_doReadOrWrite}: reads, writes, disconnection; a plain
read, the usual event, handled inline) and the same last resort: an
exception that escapes it is logged, with the descriptor's log prefix as
its system, and the loop goes on with the next event. Nothing else
differs; it is a subclass, and every other method is Twisted's own.

The operator picks it like any of Twisted's reactors, C{twistd --reactor
llmgw-epoll} (the dropin C{twisted/plugins/llmgw_reactors.py} names this
module, whose L{install} twistd calls); C{twistd llmgw gateway} runs on it
when no C{--reactor} was given (L{llmgw.tap.DEFAULT_REACTORS}), every
other process on twistd's default. An application embedding llmgw's
services runs them on whatever reactor it has. Linux only (epoll):
elsewhere this module does not import.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from select import EPOLLIN as _IN
from typing import Any

from twisted.internet.epollreactor import EPollReactor
from twisted.internet.posixbase import _NO_FILEDESC
from twisted.python import log


class LeanEPollReactor(EPollReactor):  # type: ignore[misc]
    """
    An epoll reactor that dispatches events without a log context
    per event (see the module's docstring).
    """

    def __init__(self) -> None:
        self._after: list[Callable[[], object]] = []
        super().__init__()

    def afterEvents(self, f: Callable[[], object]) -> None:
        """
        Call C{f} once the events of this poll have all been handled
        (when called from outside the handling of events, from a timer
        say: before the reactor next waits). Each call is one call of
        C{f}, in order; an exception from one is logged and the rest
        still run.
        """
        self._after.append(f)

    def _run_after(self) -> None:
        calls = self._after
        self._after = []
        for f in calls:
            try:
                f()
            except KeyboardInterrupt:
                raise
            except BaseException:
                log.err(None, "Unhandled error in a call after events")

    def doPoll(self, timeout: float | None) -> None:
        if self._after:
            # Asked for since the last poll: by timers, or threads'
            # calls. Done before waiting, which could be for long; and
            # then no wait at all (they may have set a timer, or stopped
            # the reactor): the loop works it out again after this poll.
            self._run_after()
            timeout = 0
        if timeout is None:
            timeout = -1  # wait until something is ready
        try:
            events = self._poller.poll(timeout, len(self._selectables))
        except OSError as err:
            if err.errno == errno.EINTR:
                return
            raise
        selectables = self._selectables
        dispatch = self._doReadOrWrite
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                # Removed by an earlier event's handler in this batch.
                continue
            try:
                if event == _IN:
                    # The common case, handled as _doReadOrWrite does
                    # (a read, and nothing else to look at), inline.
                    in_read = False
                    why: BaseException | None
                    try:
                        if selectable.fileno() == -1:
                            why = _NO_FILEDESC
                        else:
                            why = selectable.doRead()
                            in_read = True
                    except BaseException:
                        why = sys.exc_info()[1]
                        log.err(None, system=_prefix(selectable))
                    if why:
                        self._disconnectSelectable(selectable, why, in_read)
                else:
                    dispatch(selectable, fd, event)
            except KeyboardInterrupt:
                raise
            except BaseException:
                log.err(None, "Unhandled error dispatching an event", system=_prefix(selectable))
        if self._after:
            self._run_after()

    doIteration = doPoll


def _prefix(selectable: Any) -> str:
    try:
        return str(selectable.logPrefix())
    except BaseException:
        return "(buggy logPrefix method)"


def install() -> Any:
    """
    Install a L{LeanEPollReactor} as the global reactor and return it.

    @raise twisted.internet.error.ReactorAlreadyInstalledError: when a
        reactor is installed already.
    """
    from twisted.internet.main import installReactor

    reactor = LeanEPollReactor()
    installReactor(reactor)
    return reactor

