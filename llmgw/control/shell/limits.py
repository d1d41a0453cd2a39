"""
Limits on the agent port (DESIGN §5, §12): how many connections, from where,
and how fast one agent may send.

L{ConnectionLimiter} wraps the listening factory below TLS, so a socket over
a cap is closed at accept, before a TLS object exists or a TLS byte is sent:
a flood of idle sockets costs an accept and a close each, never a handshake.
The sockets it admits still meet the agent service's handshake and Register
deadlines, which is what clears a flood that stays under the caps.

It is also the agent port's admission gate. A registration storm (every
agent of a fleet dialling at once, after a control-plane restart) offers more
TLS handshakes than one process can do; accepted all at once, each waits its
turn behind all the others, the 10 s handshake deadline (which starts at
accept) expires for the ones not served yet, their agents dial again, and the
port does ever more handshakes that count for nothing. So the limiter counts
the connections I{registering}, from their first byte (the ClientHello) to
their C{Register} or their close, and while C{max_registering} are, it stops
accepting: the listening socket is not read, the kernel's listen backlog
holds the connections still to come (their TCP handshake done, no deadline
of ours running), and accepting resumes once the count is down to
C{resume_registering}. Sockets that send nothing are not counted: they cost no
CPU, and they must not be able to hold the gate shut against real agents
(the handshake deadline clears them). Nor can peers that send a byte and
stall: while the gate is shut, a connection that has been registering for
C{registering_hold} seconds (3; a healthy one takes a fraction of a second
even in a storm) stops being counted, though its own deadlines still run.
Stallers can then slow the port down to C{max_registering} admissions per
hold, never stop it.

L{MessageRate} is a per-agent token bucket. An agent over its rate is not
disconnected and its messages are not queued in memory: the control plane
stops reading its socket until the bucket refills, and TCP flow control makes
the agent wait.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

from llmgw.oslimits import raise_fd_limit

#: Defaults sized for a fleet of 10,000 nodes: one stream each, plus room for
#: a reconnect storm in which old streams linger until their silence timeout.
DEFAULT_MAX_CONNECTIONS = 15_000
#: One agent per address is normal; NAT gateways and one-machine fleets
#: (``llmgw local``, benchmarks on loopback) put many behind one address.
DEFAULT_MAX_PER_ADDRESS = 64
#: Messages per second per agent, sustained; and the burst allowed above it.
#: An agent sends a heartbeat every 5 s and a status per shard transition, so
#: even a node restarting 16 shards at once stays far below.
DEFAULT_MESSAGE_RATE = 20.0
DEFAULT_MESSAGE_BURST = 200
#: Connections between their first byte and their Register at which the
#: agent port stops accepting (see the module docstring); it accepts again
#: when half of them are done. 128 keeps about a tenth of a second of
#: handshakes queued in the process on a 2-core machine, enough to keep it
#: busy, and far inside the 10 s handshake deadline.
DEFAULT_MAX_REGISTERING = 128
#: Seconds after which a connection still registering while the gate is
#: shut stops being counted (see the module docstring).
DEFAULT_REGISTERING_HOLD = 3.0
#: Refusals are logged at most this often (a flood must not flood the log).
REFUSAL_LOG_INTERVAL = 10.0
#: Open files the control plane needs beyond its agent connections (logs,
#: the admin API, the gateway's upstream connections).
FD_HEADROOM = 1024


@dataclass(frozen=True)
class LimitsConfig:
    """
    The agent port's limits. 0 means no limit.
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_per_address: int = DEFAULT_MAX_PER_ADDRESS
    message_rate: float = DEFAULT_MESSAGE_RATE
    message_burst: int = DEFAULT_MESSAGE_BURST
    max_registering: int = DEFAULT_MAX_REGISTERING


def _host(addr: IAddress | Any) -> str:
    return str(getattr(addr, "host", addr))


#: A connection's place in the admission gate: silent since accept, counted
#: as registering, or done with the gate (registered or closed).
_SILENT, _REGISTERING, _SETTLED = 0, 1, 2


class _Counted(ProtocolWrapper):
    """
    Passes everything through; tells the limiter when the connection sends
    its first byte, registers, and ends.
    """

    host = ""
    factory: ConnectionLimiter
    _gate = _SILENT

    def dataReceived(self, data: bytes) -> None:
        if self._gate == _SILENT:
            self._gate = _REGISTERING
            self.factory.registering_started(self)
        self.wrappedProtocol.dataReceived(data)

    def settle(self) -> None:
        """
        The connection is done with the admission gate: it registered, or
        it closed. Only the first call counts.
        """
        if self._gate == _REGISTERING:
            self.factory.registering_ended(self)
        self._gate = _SETTLED

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        try:
            super().connectionLost(reason)
        finally:
            self.settle()
            self.factory.release(self)


def connection_registered(transport: Any) -> None:
    """
    Tell the L{ConnectionLimiter} under C{transport} (a protocol's
    transport: the TLS layer, or the limiter's wrapper itself without TLS)
    that this connection has registered and leaves the admission gate. A
    transport with no limiter under it is left alone; a second call for the
    same connection does nothing.
    """
    for _ in range(4):
        if transport is None:
            return
        if isinstance(transport, _Counted):
            transport.settle()
            return
        transport = getattr(transport, "transport", None)


class ConnectionLimiter(WrappingFactory):
    """
    Wraps a server factory and refuses a connection at accept when its
    source address holds C{max_per_address} connections already, or the
    port holds C{max_connections} (0: no such cap). C{name} names the
    listener in the refusals' log lines.

    A refused connection gets no protocol: C{buildProtocol} returns C{None},
    on which Twisted closes the socket at once.

    While C{max_registering} connections are between their first byte and
    their C{Register} (0: no gate), the listening port given to
    L{attach_port} is not read; it is read again once C{resume_registering}
    (by default half) are left, counting no connection longer than
    C{registering_hold} seconds. Twisted accepts in batches, so the count can
    pass C{max_registering} by what one batch had already accepted; at
    each resume the batch is cut to the room left.
    """

    protocol = _Counted
    log = Logger()
    noisy = False

    def __init__(
        self,
        wrapped: Any,
        clock: IReactorTime,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_address: int = DEFAULT_MAX_PER_ADDRESS,
        max_registering: int = DEFAULT_MAX_REGISTERING,
        resume_registering: int | None = None,
        registering_hold: float = DEFAULT_REGISTERING_HOLD,
        name: str = "the agent port",
    ):
        super().__init__(wrapped)
        #: The listener, as refusals are logged (C{"the admin API"}).
        self.name = name
        self.clock = clock
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.max_registering = max_registering
        self.resume_registering = (
            max_registering // 2 if resume_registering is None else resume_registering
        )
        self.registering_hold = registering_hold
        #: Connections between their first byte and their Register, by when
        #: they sent it (oldest first), and the most there have been at once.
        self._window: OrderedDict[_Counted, float] = OrderedDict()
        self.registering_peak = 0
        #: Connections no longer counted after C{registering_hold}.
        self.registering_expired = 0
        self._expiry: IDelayedCall | None = None
        #: Whether the gate holds new connections in the listen backlog.
        self.paused = False
        #: How often the gate closed, and for how long in all (seconds).
        self.pauses = 0
        self.paused_seconds = 0.0
        self._paused_at = 0.0
        self._last_pause_log = -REFUSAL_LOG_INTERVAL
        self._unlogged_pauses = 0
        #: The listening port the gate stops and starts (L{attach_port}).
        self.port: Any = None
        self.total = 0
        self.per_address: collections.Counter[str] = collections.Counter()
        #: Refusals by cause (C{"per_address"}, C{"total"}), for metrics.
        self.refused: collections.Counter[str] = collections.Counter()
        self._last_log = -REFUSAL_LOG_INTERVAL
        self._unlogged = 0

    def startFactory(self) -> None:
        super().startFactory()
        if self.max_connections:
            # As far as the hard limit allows; the control plane's start-up
            # check warns, once, when that is not enough for all it holds.
            raise_fd_limit(self.max_connections + FD_HEADROOM)

    def buildProtocol(self, addr: IAddress) -> _Counted | None:  # type: ignore[override]
        host = _host(addr)
        cause = None
        if self.max_per_address and self.per_address[host] >= self.max_per_address:
            cause = "per_address"
        elif self.max_connections and self.total >= self.max_connections:
            cause = "total"
        if cause is not None:
            self._refuse(host, cause)
            return None
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:
            return None
        proto = self.protocol(self, inner)  # type: ignore[arg-type]
        proto.host = host
        self.total += 1
        self.per_address[host] += 1
        return proto

    # -- the admission gate -------------------------------------------------

    def attach_port(self, port: Any) -> None:
        """
        Gate C{port} (a listening C{tcp.Port}: what C{listenTCP} returned),
        or nothing, for C{None}: the listener is stopping.
        """
        self.port = port
        if port is None:
            self._cancel_expiry()
        elif self.paused:
            self._stop_reading()
            self._schedule_expiry()

    def _port_alive(self) -> Any:
        port = self.port
        if port is None or getattr(port, "disconnecting", False):
            return None
        if not getattr(port, "connected", True):
            return None
        return port

    def _stop_reading(self) -> None:
        port = self._port_alive()
        if port is not None and hasattr(port, "stopReading"):
            port.stopReading()

    @property
    def registering(self) -> int:
        """
        Connections counted between their first byte and their Register.
        """
        return len(self._window)

    def registering_started(self, proto: _Counted) -> None:
        """
        C{proto}'s connection sent its first byte.
        """
        self._window[proto] = self.clock.seconds()
        count = len(self._window)
        if count > self.registering_peak:
            self.registering_peak = count
        if self.max_registering and not self.paused and count >= self.max_registering:
            self._pause()

    def registering_ended(self, proto: _Counted) -> None:
        """
        C{proto}'s connection registered or closed.
        """
        if self._window.pop(proto, None) is None:
            return  # no longer counted: it outstayed the hold
        if self.paused and len(self._window) <= self.resume_registering:
            self._resume()

    def _schedule_expiry(self) -> None:
        if self._expiry is not None or not self._window or self.registering_hold <= 0:
            return
        oldest = next(iter(self._window.values()))
        wait = max(0.0, oldest + self.registering_hold - self.clock.seconds())
        self._expiry = self.clock.callLater(wait, self._expire)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None and self._expiry.active():
            self._expiry.cancel()
        self._expiry = None

    def _expire(self) -> None:
        """
        The gate is shut: stop counting connections registering for longer
        than the hold, and open it if that leaves few enough.
        """
        self._expiry = None
        cutoff = self.clock.seconds() - self.registering_hold
        expired = 0
        while self._window:
            proto, since = next(iter(self._window.items()))
            if since > cutoff:
                break
            del self._window[proto]
            expired += 1
        if expired:
            self.registering_expired += expired
            self.log.info(
                "{count} agent connections spent {hold}s between TLS and Register while "
                "new ones waited; they are no longer counted (slow or stalling peers; "
                "their deadlines still run)",
                count=expired,
                hold=self.registering_hold,
            )
        if len(self._window) <= self.resume_registering:
            self._resume()
        else:
            self._schedule_expiry()

    def _pause(self) -> None:
        self.paused = True
        self.pauses += 1
        self._paused_at = self.clock.seconds()
        self._stop_reading()
        if self.port is not None:
            self._schedule_expiry()
        self._unlogged_pauses += 1
        if self._paused_at - self._last_pause_log >= REFUSAL_LOG_INTERVAL:
            self.log.info(
                "{count} agent connections are between TLS and Register: new ones wait in "
                "the listen backlog until {resume} are left ({pauses} such pauses since the "
                "last message)",
                count=self.registering,
                resume=self.resume_registering,
                pauses=self._unlogged_pauses,
            )
            self._last_pause_log = self._paused_at
            self._unlogged_pauses = 0

    def _resume(self) -> None:
        self.paused = False
        self._cancel_expiry()
        self.paused_seconds += self.clock.seconds() - self._paused_at
        port = self._port_alive()
        if port is None or not hasattr(port, "startReading"):
            return
        # Twisted accepts up to numberAccepts sockets per read of the port;
        # let the next read take no more than the gate has room for.
        room = max(1, self.max_registering - self.registering)
        if getattr(port, "numberAccepts", 0) > room:
            port.numberAccepts = room
        port.startReading()

    # -- caps -----------------------------------------------------------------

    def release(self, proto: _Counted) -> None:
        self.total -= 1
        left = self.per_address[proto.host] - 1
        if left > 0:
            self.per_address[proto.host] = left
        else:
            del self.per_address[proto.host]

    def connections_from(self, host: str) -> int:
        return self.per_address.get(host, 0)

    def _refuse(self, host: str, cause: str) -> None:
        self.refused[cause] += 1
        self._unlogged += 1
        now = self.clock.seconds()
        if now - self._last_log < REFUSAL_LOG_INTERVAL:
            return
        if cause == "per_address":
            why = f"{host} already holds {self.max_per_address} connections (the per-address cap)"
        else:
            why = f"{self.name} holds its maximum of {self.max_connections} connections"
        self.log.warn(
            "{name}: refusing connections before TLS: {why}; {count} refused since the last "
            "such message",
            name=self.name,
            why=why,
            peer=host,
            cause=cause,
            count=self._unlogged,
        )
        self._last_log = now
        self._unlogged = 0


def backlog_problem(backlog: int, somaxconn: str = "/proc/sys/net/core/somaxconn") -> str | None:
    """
    What is wrong with a listen backlog of C{backlog}: the kernel silently
    caps it at C{net.core.somaxconn}. C{None} when it fits, or when the
    kernel does not say.
    """
    try:
        with open(somaxconn) as f:
            cap = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if cap >= backlog:
        return None
    return (
        f"the agent port's listen backlog of {backlog} is capped by the kernel at "
        f"net.core.somaxconn = {cap}: in a registration storm, connections past it are "
        f"dropped and their agents retry later; raise it (sysctl -w net.core.somaxconn="
        f"{backlog}) or lower --backlog"
    )


class MessageRate:
    """
    A token bucket for one agent's messages: C{rate} per second, C{burst}
    at most. When it runs dry it calls C{pause()} and, once a token is back,
    C{resume()}.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        rate: float,
        burst: int,
        pause: Callable[[], None],
        resume: Callable[[], None],
        who: Callable[[], str] | None = None,
    ):
        self.clock = clock
        self._who = who
        self.rate = rate
        self.burst = max(1, burst)
        self._pause = pause
        self._resume = resume
        self._tokens = float(self.burst)
        self._stamp = clock.seconds()
        self._wake: IDelayedCall | None = None
        #: How many times reading was paused, for logs and metrics.
        self.pauses = 0

    @property
    def paused(self) -> bool:
        return self._wake is not None

    def taken(self) -> None:
        """
        One message arrived. Pauses the reader when that empties the bucket.
        """
        now = self.clock.seconds()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= 1
        if self._tokens < 1 and self._wake is None:
            self.pauses += 1
            wait = (1 - self._tokens) / self.rate
            if self.pauses == 1 or self.pauses % 1000 == 0:
                self.log.warn(
                    "{peer} sends over its rate of {rate} messages/s (burst {burst}): "
                    "not reading it for {wait:.2f}s ({pauses} pauses so far)",
                    peer=self._who() if self._who else "an agent",
                    rate=self.rate, burst=self.burst, wait=wait, pauses=self.pauses,
                )
            self._pause()
            self._wake = self.clock.callLater(wait, self._refilled)

    def _refilled(self) -> None:
        self._wake = None
        self._resume()

    def stop(self) -> None:
        """
        The connection is gone: forget the pending resume.
        """
        if self._wake is not None and self._wake.active():
            self._wake.cancel()
        self._wake = None


def pause_reading(proto: Any) -> None:
    """
    Stop reading from C{proto}'s peer: C{IntNStringReceiver} stops handing
    out frames it already holds, and the transport stops reading the socket
    (through TLS, down to TCP), so nothing more is buffered.
    """
    proto.paused = True
    if proto.transport is not None:
        proto.transport.pauseProducing()


def resume_reading(proto: Any) -> None:
    """
    Undo L{pause_reading}, delivering the frames held back.
    """
    proto.paused = False
    transport = proto.transport
    if transport is None or getattr(transport, "disconnected", False):
        return
    transport.resumeProducing()
    proto.dataReceived(b"")


__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_PER_ADDRESS",
    "DEFAULT_MAX_REGISTERING",
    "DEFAULT_MESSAGE_BURST",
    "DEFAULT_MESSAGE_RATE",
    "ConnectionLimiter",
    "LimitsConfig",
    "backlog_problem",
    "MessageRate",
    "connection_registered",
    "pause_reading",
    "resume_reading",
]
