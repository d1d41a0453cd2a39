"""
The logger of llmgw's WebSocket protocols.

Autobahn logs each connection's configuration, handshake, frames and
timers through its protocol's C{log} at debug level. Its own loggers are
txaio's, which drop debug events at txaio's default level (info); a
protocol that sets C{log} to a plain C{twisted.logger.Logger} for its own
messages would send every one of those dumps to twistd's log file.
L{WebSocketLogger} is that Logger, dropping debug events unless txaio's
global level asks for them (C{txaio.set_global_log_level("debug")}), as
autobahn's own loggers do.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger
from txaio import tx

#: txaio's levels at which debug events are kept.
_VERBOSE = frozenset({"debug", "trace"})


class WebSocketLogger(Logger):
    """
    A C{Logger} whose C{debug} events are dropped unless txaio's global log
    level is C{debug} or C{trace}; every other level is logged as usual.
    """

    def debug(self, format: str | None = None, **kwargs: Any) -> None:
        if tx.get_global_log_level() in _VERBOSE:
            super().debug(format, **kwargs)


__all__ = ["WebSocketLogger"]
