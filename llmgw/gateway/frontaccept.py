"""
The gateway front's caps at accept: how many client connections at once, in
all and from one address (L{CappedFactory}, which L{llmgw.gateway.front}'s
factory builds on). A connection past a cap is closed before a byte of it is
read, and the refusals are logged at most every L{REFUSAL_LOG_INTERVAL}
seconds, with the latest address.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from mypy_extensions import mypyc_attr
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger

from llmgw.oslimits import raise_fd_limit

#: Default cap on client connections at once; past it a new connection is
#: closed at accept.
MAX_CONNECTIONS: Final = 10_000
#: Open files needed beyond one per client connection: each proxied request
#: holds an upstream connection too, plus logs and listeners.
FD_HEADROOM: Final = 1024
#: Refused connections are logged at most this often.
REFUSAL_LOG_INTERVAL: Final = 10.0


# Compiled (setup.py), it may still be subclassed by uncompiled code.
@mypyc_attr(allow_interpreted_subclasses=True)
class CappedFactory(ServerFactory):
    """
    Counts client connections, open now (C{connections}) and refused at
    accept (C{refused_connections}). At most C{max_connections} are open at
    once, and C{max_per_address} from one address (0: no cap). Starting
    the factory raises the process's open-file limit to what the cap needs
    (one file per client and one per upstream connection, plus
    L{FD_HEADROOM}) as far as the hard limit allows.

    A subclass's C{buildProtocol} calls L{admit} first, remembers
    L{counted_host} on its protocol, and calls L{connection_ended} and
    L{address_released} when the connection closes.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.CappedFactory")
    noisy = False

    def __init__(self, reactor: Any, max_connections: int = MAX_CONNECTIONS, max_per_address: int = 0):
        self.reactor = reactor
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        #: Client connections open now, and refused at a cap so far.
        self.connections = 0
        self.refused_connections = 0
        #: Client connections open now by address, under a per-address cap.
        self.per_address: dict[str, int] = {}
        self._last_refusal_log = -REFUSAL_LOG_INTERVAL
        self._unlogged_refusals = 0

    def startFactory(self) -> None:
        if self.max_connections:
            raise_fd_limit(2 * self.max_connections + FD_HEADROOM)

    def counted_host(self, addr: Any) -> str | None:
        """
        The address L{admit} counted C{addr}'s connection under, if any.
        """
        if not self.max_per_address:
            return None
        host: str | None = getattr(addr, "host", None)
        return host

    def admit(self, addr: Any) -> bool:
        """
        Whether a connection from C{addr} may open; if so, it is counted.
        """
        if self.max_connections and self.connections >= self.max_connections:
            self._refuse_connection(addr, "")
            return False
        host = self.counted_host(addr)
        if host is not None:
            held = self.per_address.get(host, 0)
            if held >= self.max_per_address:
                self._refuse_connection(addr, host)
                return False
            self.per_address[host] = held + 1
        self.connections += 1
        return True

    def connection_ended(self) -> None:
        """
        A client connection built by this factory has closed.
        """
        self.connections -= 1

    def address_released(self, host: str) -> None:
        """
        A connection counted against C{host}'s per-address cap has closed.
        """
        held = self.per_address.get(host, 0) - 1
        if held > 0:
            self.per_address[host] = held
        else:
            self.per_address.pop(host, None)

    def _refuse_connection(self, addr: Any, per_address: str) -> None:
        """
        Count, and log at most every L{REFUSAL_LOG_INTERVAL} seconds, a
        connection refused at accept: at the per-address cap when
        C{per_address} (the address) is not empty, else at the total cap.
        """
        self.refused_connections += 1
        self._unlogged_refusals += 1
        now = self.reactor.seconds()
        if now - self._last_refusal_log < REFUSAL_LOG_INTERVAL:
            return
        if per_address:
            self.log.warn(
                "refusing client connections at accept: {peer} holds the maximum of {cap} "
                "from one address (--max-connections-per-address); {count} refused since the "
                "last such message",
                cap=self.max_per_address, count=self._unlogged_refusals, peer=per_address,
            )
        else:
            self.log.warn(
                "refusing client connections at accept: the gateway holds its maximum of "
                "{cap} (--max-connections); {count} refused since the last such message, "
                "the latest from {peer}",
                cap=self.max_connections, count=self._unlogged_refusals, peer=getattr(addr, "host", addr),
            )
        self._last_refusal_log = now
        self._unlogged_refusals = 0
