"""
Limits on the agent port (DESIGN §5, §12): how many connections, from where,
and how fast one agent may send.

L{ConnectionLimiter} wraps the listening factory below TLS, so a socket over
a cap is closed at accept, before a TLS object exists or a TLS byte is sent:
a flood of idle sockets costs an accept and a close each, never a handshake.
The sockets it admits still meet the agent service's handshake and Register
deadlines, which is what clears a flood that stays under the caps.

L{MessageRate} is a per-agent token bucket. An agent over its rate is not
disconnected and its messages are not queued in memory: the control plane
stops reading its socket until the bucket refills, and TCP flow control makes
the agent wait.
"""

from __future__ import annotations

import collections
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

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


def _host(addr: IAddress | Any) -> str:
    return str(getattr(addr, "host", addr))


class _Counted(ProtocolWrapper):
    """
    Passes everything through; tells the limiter when the connection ends.
    """

    host = ""

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        try:
            super().connectionLost(reason)
        finally:
            self.factory.release(self)


class ConnectionLimiter(WrappingFactory):
    """
    Wraps a server factory and refuses a connection at accept when its
    source address holds C{max_per_address} connections already, or the
    port holds C{max_connections}.

    A refused connection gets no protocol: C{buildProtocol} returns C{None},
    on which Twisted closes the socket at once.
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
    ):
        super().__init__(wrapped)
        self.clock = clock
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.total = 0
        self.per_address: collections.Counter[str] = collections.Counter()
        #: Refusals by cause (C{"per_address"}, C{"total"}), for metrics.
        self.refused: collections.Counter[str] = collections.Counter()
        self._last_log = -REFUSAL_LOG_INTERVAL
        self._unlogged = 0

    def startFactory(self) -> None:
        super().startFactory()
        if self.max_connections:
            problem = ensure_fd_limit(self.max_connections + FD_HEADROOM)
            if problem:
                self.log.warn("{problem}", problem=problem)

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
            why = f"the agent port holds its maximum of {self.max_connections} connections"
        self.log.warn(
            "refusing connections before TLS: {why}; {count} refused since the last "
            "such message",
            why=why,
            peer=host,
            cause=cause,
            count=self._unlogged,
        )
        self._last_log = now
        self._unlogged = 0


def ensure_fd_limit(needed: int) -> str | None:
    """
    Raise this process's soft open-file limit towards C{needed} (never past
    the hard limit). Returns what is still wrong, or C{None}.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft >= needed:
        return None
    return (
        f"the open-file limit is {soft}, below the {needed} that --max-connections "
        f"needs with headroom; connections past it fail at accept: raise it "
        f"(ulimit -n, systemd LimitNOFILE=) or lower --max-connections"
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
    "DEFAULT_MESSAGE_BURST",
    "DEFAULT_MESSAGE_RATE",
    "ConnectionLimiter",
    "LimitsConfig",
    "MessageRate",
    "pause_reading",
    "resume_reading",
]
