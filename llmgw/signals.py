"""
SIGHUP handling shared by the control plane (catalog, TLS) and the agent
(its certificate).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.logger import Logger


def owns_signals(reactor: Any) -> bool:
    """
    Whether C{reactor} is the process's global reactor: only that one may
    install process-wide signal handlers (tests pass fakes).
    """
    return sys.modules.get("twisted.internet.reactor") is reactor


class SighupHandler:
    """
    Runs C{callback} on the reactor's next turn after each SIGHUP, between
    L{install} and L{uninstall}. A handler installed before this one still
    gets the signal, so several parts can each reload their own files.
    """

    log = Logger()

    def __init__(self, reactor: Any, callback: Callable[[], Any], what: str):
        self.reactor = reactor
        self.callback = callback
        self.what = what
        self._previous: Any = None
        self._installed = False

    def install(self) -> bool:
        """
        Install the handler; returns whether it could (there is no SIGHUP on
        some platforms, and only the main thread may install handlers).
        """
        if self._installed:
            return True
        if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
            self.log.warn("SIGHUP will not reload {what}: no SIGHUP here, or not the main thread",
                          what=self.what)
            return False
        self._previous = signal.getsignal(signal.SIGHUP)
        signal.signal(signal.SIGHUP, self._on_signal)
        self._installed = True
        return True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGHUP, self._previous)
            self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A signal may interrupt the reactor anywhere: work on its next turn.
        self.reactor.callFromThread(self._run)
        previous = self._previous
        if callable(previous):
            previous(signum, frame)

    def _run(self) -> None:
        self.log.info("SIGHUP: reloading {what}", what=self.what)
        try:
            self.callback()
        except Exception:
            self.log.failure("reloading {what} on SIGHUP failed", what=self.what)


class SighupService(Service):
    """
    A service that calls its L{reload} on each SIGHUP while it runs, beside
    any other part reloading its own files on the same signal; only when
    C{reactor} is the process's own (tests and embedders pass their own),
    unless C{handle_sighup} says otherwise.
    """

    def __init__(self, reactor: Any, what: str, handle_sighup: bool | None = None):
        self.handle_sighup = owns_signals(reactor) if handle_sighup is None else handle_sighup
        self._sighup = SighupHandler(reactor, self.reload, what)

    def startService(self) -> None:
        super().startService()
        if self.handle_sighup:
            self._sighup.install()

    def stopService(self) -> Any:
        super().stopService()
        self._sighup.uninstall()
        return None

    def reload(self) -> Any:
        """
        Re-read what this service looks after. Exceptions are logged by the
        signal handler; log refusals here with what was wrong.
        """
        raise NotImplementedError
