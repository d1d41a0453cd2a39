"""
Listen and dial addresses (C{[HOST:]PORT}, IPv6 as C{[addr]:port}) and a
service that listens on one.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from twisted.application.service import Service
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure


class AddressError(ValueError):
    pass


def parse_address(spec: str, default_host: str, default_port: int | None = None) -> tuple[str, int]:
    """
    Split C{spec} into a host and a port.

    C{"7443"} is a port on C{default_host}; C{"0.0.0.0:7443"},
    C{"[::1]:7443"} and C{"name:7443"} name both.

    @raise AddressError: the port is not a number in 0..65535, or an IPv6
        address is not bracketed.
    """
    spec = spec.strip()
    if not spec:
        if default_port is None:
            raise AddressError("empty address")
        return default_host, default_port
    host, port_s = default_host, spec
    if spec.startswith("["):
        end = spec.find("]")
        if end < 0:
            raise AddressError(f"{spec!r}: unclosed '[' around an IPv6 address")
        host = spec[1:end]
        rest = spec[end + 1 :]
        if not rest.startswith(":"):
            raise AddressError(f"{spec!r}: expected [ADDRESS]:PORT")
        port_s = rest[1:]
    elif ":" in spec:
        if spec.count(":") > 1:
            raise AddressError(f"{spec!r}: write an IPv6 address as [ADDRESS]:PORT")
        host, port_s = spec.rsplit(":", 1)
    try:
        port = int(port_s)
    except ValueError:
        raise AddressError(f"{spec!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise AddressError(f"{spec!r}: port {port} is out of range")
    if not host:
        host = default_host
    return host, port


def is_loopback(host: str) -> bool:
    """
    Whether C{host} is a loopback address (or C{localhost}).
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def server_endpoint(reactor: Any, host: str, port: int, backlog: int = 1024) -> Any:
    """
    A TCP server endpoint on C{host}:C{port}.
    """
    if is_ipv6(host):
        return TCP6ServerEndpoint(reactor, port, backlog=backlog, interface=host)
    return TCP4ServerEndpoint(reactor, port, backlog=backlog, interface=host)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


class ListenRefused(SystemExit):
    """
    A listener could not bind its address (in use, not this machine's, not
    permitted). Its message is one line naming the address and the option
    that changes it; being a C{SystemExit}, it ends twistd with that line
    and status 1, not a traceback.
    """

    def __init__(self, what: str, address: str, option: str | None, reason: str):
        self.what, self.address, self.option, self.reason = what, address, option, reason
        super().__init__(self.message())

    def message(self) -> str:
        hint = f"; choose another with {self.option} [HOST:]PORT" if self.option else ""
        return f"cannot listen on {self.address} for {self.what}: {self.reason}{hint}"

    def renamed(self, option: str | None) -> ListenRefused:
        """
        The same refusal naming C{option} (a wrapper's name for it).
        """
        return ListenRefused(self.what, self.address, option, self.reason)

    def __str__(self) -> str:
        return self.message()


def _listen_reason(e: CannotListenError) -> str:
    err = e.socketError
    strerror = getattr(err, "strerror", None)
    if strerror:
        return str(strerror).lower()
    return str(err)


class ListenerService(Service):
    """
    Listens on an endpoint while running and keeps the C{IListeningPort}
    (C{port}) so callers can read the bound address.

    A synchronous endpoint's failure to listen is raised from
    C{startService}: a L{ListenRefused} naming C{what} listens there and the
    C{option} that moves it, when the address cannot be bound; else the
    endpoint's own error.
    """

    def __init__(self, endpoint: Any, factory: Any, what: str = "this service", option: str | None = None):
        self.endpoint = endpoint
        self.factory = factory
        self.what = what
        self.option = option
        self.port: Any = None

    def startService(self) -> None:
        super().startService()
        result: list[Any] = []
        self.endpoint.listen(self.factory).addBoth(result.append)
        if not result:
            raise RuntimeError("the listening endpoint did not answer synchronously")
        if isinstance(result[0], Failure):
            self.running = False
            err = result[0].value
            if isinstance(err, CannotListenError):
                address = format_address(err.interface or "0.0.0.0", err.port)
                raise ListenRefused(self.what, address, self.option, _listen_reason(err)) from None
            result[0].raiseException()
        self.port = result[0]

    def stopService(self) -> Any:
        super().stopService()
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None

    def address(self) -> tuple[str, int]:
        addr = self.port.getHost()
        return addr.host, addr.port
