"""
The streaming proxy: one L{ProxyCall} per request, and the L{Gateway} that
holds what calls share (routing table, router, connection pool, metrics).

A call sends the client's body (a streamed completion's asks for usage:
L{llmgw.gateway.usage.ask_for_usage}) to the leader shard of the replica the
router picks, with L{llmgw.gateway.forwarding}'s head, and is the client's
streaming producer: a slow reader pauses the replica's connection, a client
gone aborts it (which cancels the generation). A connection failure before
any byte reached the client is retried: on a fresh connection when a kept-alive
one was closed, else on another replica, up to C{max_tries}. Timeouts:
connect, first byte, and idle between bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from prometheus_client import CollectorRegistry
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import TimeoutError as ConnectTimeout
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import classImplements

from llmgw.gateway import errors, forwarding
from llmgw.gateway.admission import (
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_BYTES_PER_MODEL,
    gateway_admission,
)
from llmgw.gateway.errors import send_error
from llmgw.gateway.forwarding import FORWARDED_HEADERS, connection_options, forwarded_head
from llmgw.gateway.front import (
    BODY_TIMEOUT,
    HEAD_TIMEOUT,
    KEEP_ALIVE_TIMEOUT,
    REQUEST_TIMEOUT,
    FrontRequest,
)
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.policy import DEFAULT_POLICY, PolicyConfig
from llmgw.gateway.resume import (
    DEFAULT_MAX_MIGRATIONS,
    DEFAULT_MAX_TEXT,
    ResumeMetrics,
    StreamResume,
    break_off,
    continued,
    record_for,
)
from llmgw.gateway.router import Router
from llmgw.gateway.unstarted import Unstarted
from llmgw.gateway.upstream import UpstreamConnection, UpstreamPool, UpstreamProtocolError
from llmgw.gateway.usage import Usage, UsageCollector, UsageMeter, ask_for_usage
from llmgw.hostcheck import HostCheck
from llmgw.routing import (
    DEFAULT_QUEUE_DEPTH,
    DEFAULT_QUEUE_TIMEOUT_S,
    Demand,
    IDemand,
    IInFlight,
    IRoutingTable,
    Route,
)

#: The proxied paths whose streams can be asked for usage.
_COMPLETIONS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
_EVENT_STREAM: Final = b"text/event-stream"
REPLICA_HEADER: Final = forwarding.REPLICA_HEADER  # names the replica that answered
#: Response headers the gateway writes itself.
_DROP_RESPONSE: Final = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"trailer", b"transfer-encoding",
        b"upgrade", b"date", b"server", b"content-length",
    }
)


@dataclass
class GatewayConfig:
    """
    The gateway's tunables; times in seconds. C{head_timeout},
    C{request_timeout}, C{body_timeout} and C{keep_alive_timeout} bound
    slow or idle clients, C{max_per_address} (0: none) caps the connections
    from one address (see L{llmgw.gateway.front}); the others bound replicas.
    """

    max_body: int = 8 * 1024 * 1024
    head_timeout: float = HEAD_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    max_per_address: int = 0
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT
    connect_timeout: float = 5.0
    first_byte_timeout: float = 300.0
    idle_timeout: float = 120.0
    max_tries: int = 3
    failure_threshold: int = 3
    cooldown: float = 10.0
    retry_after: int = 5
    max_idle_connections: int = 256
    #: Routing (L{llmgw.gateway.policy}): the policy of models the routing
    #: table names none for, and the policies' knobs.
    default_policy: str = DEFAULT_POLICY
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    #: The share of each API key's limits this gateway enforces (usage).
    limit_share: float = 1.0
    #: The admission queue (L{llmgw.gateway.admission}) of models whose
    #: deployment sets no C{queue_depth} / C{queue_timeout_s}.
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    #: Bytes of bodies that may wait in it, per model and in all.
    queue_bytes_per_model: int = DEFAULT_QUEUE_BYTES_PER_MODEL
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    #: Who the client is, told to the replica (L{FORWARDED_HEADERS}); the
    #: client's own forwarding headers are dropped whatever this says.
    forwarded_headers: str = "x-forwarded"
    #: Streams continued elsewhere (L{llmgw.gateway.resume}): times a request, text kept.
    max_stream_resumes: int = DEFAULT_MAX_MIGRATIONS
    max_resume_text: int = DEFAULT_MAX_TEXT

    def __post_init__(self) -> None:
        if self.forwarded_headers not in FORWARDED_HEADERS:
            raise ValueError(
                f"forwarded headers {self.forwarded_headers!r} is not one of {', '.join(FORWARDED_HEADERS)}"
            )


class Gateway:
    """
    What every request shares. C{keys} is C{None} when no API keys are
    configured (every caller is accepted); C{hosts} are the C{Host} names
    served (loopback names when not given).
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.Gateway")

    def __init__(
        self,
        reactor: Any,
        table: IRoutingTable,
        config: GatewayConfig | None = None,
        registry: CollectorRegistry | None = None,
        keys: KeyRing | None = None,
        hosts: HostCheck | None = None,
    ):
        self.reactor = reactor
        self.table = table
        self.hosts = hosts if hosts is not None else HostCheck(option="--gateway-hosts")
        self.config = config = config if config is not None else GatewayConfig()
        self.keys = keys
        self.router = Router(reactor, config.failure_threshold, config.cooldown, config.policy)
        #: Requests waiting for a replica's first byte (moved when it leaves the table).
        self.unstarted = Unstarted()
        self.pool = UpstreamPool(reactor, config.connect_timeout, config.max_idle_connections)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, self.router.snapshot)
        self.resumes = ResumeMetrics(self.registry)
        # usage and limits per key (llmgw.gateway.usage)
        self.usage = Usage(reactor, keys.limits if keys is not None else None, config.limit_share)
        self.registry.register(UsageCollector(self._usage))
        #: Requests waiting for a replica, and in flight per model.
        self.admission = gateway_admission(self)

    def _usage(self) -> Usage:
        return self.usage

    def in_flight(self, replica_id: str) -> int:
        return self.router.in_flight(replica_id)

    def demand(self) -> dict[str, Demand]:
        """
        L{IDemand}: per model, requests in flight from this gateway and
        waiting in its admission queue (models with neither left out).
        """
        return self.admission.demand()

    def policy_for(self, model: str) -> str:
        """
        The routing policy of C{model}: the routing table's, else the
        configured default.
        """
        named = getattr(self.table, "policy", None)
        policy = named(model) if named is not None else None
        return policy or self.config.default_policy

    def close(self) -> None:
        self.admission.close()
        self.pool.close()


# Not @implementer (setup.py's rules for compiled classes).
classImplements(Gateway, IInFlight, IDemand)


#: The C{Host} line (and the head's end) per replica address.
_HOST_LINES: Final[dict[str, bytes]] = {}


class ProxyCall:
    """
    One client request on its way to a replica and back.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.ProxyCall")
    # One per request: slots make it cheaper to make and to read.
    __slots__ = (
        "gw", "policy", "key", "meter", "request", "model", "path_label", "body", "routes", "started", "head",
        "route", "tried", "conn", "connecting", "armed", "sent_at", "counted", "sent_headers", "done",
        "paused", "fresh_retry_used", "last_error", "last_was_timeout", "reused", "status", "resume",
    )

    def __init__(
        self,
        gateway: Gateway,
        request: FrontRequest,
        model: str,
        path_label: str,
        body: bytes,
        routes: Sequence[Route],
        started: float,
        policy: str = "least_loaded",
        key: bytes | None = None,
        meter: UsageMeter | None = None,
    ):
        self.gw = gateway
        #: Counts the answer's tokens (llmgw.gateway.usage).
        self.meter = meter
        self.policy = policy
        self.key = key
        self.request = request
        self.model = model
        self.path_label = path_label
        if meter is not None and path_label in _COMPLETIONS:
            # So that a stream's tokens count whether or not its client
            # asked for usage (the usage chunk is then kept from it).
            asking = ask_for_usage(body)
            if asking is not None:
                body = asking
                meter.asked = True
        self.body = body
        self.routes = routes
        self.started = started
        self.head = forwarded_head(request, len(body), gateway.config.forwarded_headers)
        self.route: Route | None = None
        self.tried: set[str] = set()
        self.conn: UpstreamConnection | None = None
        self.connecting: Deferred[UpstreamConnection] | None = None
        #: The connection whose timer is armed for this call.
        self.armed: UpstreamConnection | None = None
        self.sent_at = 0.0
        self.counted = False
        self.sent_headers = False
        self.done = False
        self.paused = False
        self.fresh_retry_used = False
        self.last_error = ""
        self.last_was_timeout = False
        self.reused = False
        self.status = 0
        #: The stream's record for a continuation elsewhere, when it may have one.
        self.resume: StreamResume | None = None

    # the call's course

    def start(self) -> None:
        self.request.on_lost = self._client_gone
        self.gw.admission.started(self.model)
        self._attempt(None)

    def _attempt(self, same: Route | None) -> None:
        if same is None:
            route = self.gw.router.pick(self.routes, self.tried, self.policy, self.key)
            if route is None:
                self._give_up()
                return
            self.tried.add(route.replica_id)
            conn = self.gw.pool.take(route.address)
        else:
            route, conn = same, None
        self.route = route
        self.gw.router.begin(route.replica_id)
        self.counted = True
        if conn is not None:
            self._send(conn, True)
            return
        try:
            d = self.gw.pool.connect(route.address)
        except ValueError as e:
            self._connect_failed(Failure(e))
            return
        self.connecting = d
        d.addCallbacks(self._connected, self._connect_failed)

    def _connected(self, conn: UpstreamConnection) -> None:
        self.connecting = None
        if self.done:
            conn.abort()
            return
        self._send(conn, False)

    def _connect_failed(self, reason: Failure) -> None:
        self.connecting = None
        if self.done or reason.check(CancelledError):
            return
        assert self.route is not None
        timeout = bool(reason.check(ConnectTimeout))
        self._replica_failed(
            f"cannot connect to {self.route.address}: {reason.getErrorMessage()}",
            timeout,
            "connect_timeout" if timeout else "connect",
        )

    def _send(self, conn: UpstreamConnection, reused: bool) -> None:
        assert self.route is not None
        self.conn = conn
        self.reused = reused
        address = self.route.address
        host = _HOST_LINES.get(address)
        if host is None:
            host = b"Host: %s\r\n\r\n" % address.encode()
            if len(_HOST_LINES) < 4096:
                _HOST_LINES[address] = host
        conn.send(b"".join((self.head, host, self.body)), self)
        if self.conn is conn:
            gw = self.gw
            gw.unstarted.calls[self] = self.route.replica_id  # Unstarted.add, inline
            # One timer for the first byte and the idle wait after it: due
            # at the sooner of the two, so that the head's arrival only ever
            # moves it later (free until it comes due; sooner would be a
            # search of the reactor's heap). Firing before the first byte
            # and before the first-byte time, it waits out the rest.
            config, reactor = gw.config, gw.reactor
            self.sent_at = reactor.seconds()
            idle = config.idle_timeout
            conn.arm(reactor, min(config.first_byte_timeout, idle), self._timed_out, idle)
            self.armed = conn

    # ResponseHandler

    def response_started(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        if self.done or self.sent_headers and continued(self, status):
            return
        assert self.route is not None
        self.gw.router.succeeded(self.route.replica_id)
        self.gw.unstarted.answered(self.route.replica_id, self)
        # The idle wait starts in response_data, which follows at once.
        length = None
        chunked = False
        kept = []
        named = False
        for header in headers:
            name = header[0]
            if name not in _DROP_RESPONSE:
                kept.append(header)
            elif name == b"content-length":
                length = int(header[1])
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"connection":
                named = True
        if named:
            options = connection_options(headers)
            if options:
                kept = [h for h in kept if h[0] not in options]
        if chunked:
            # The body came chunked (a Content-Length beside it is void): its
            # length is not known, and the client's framing is chosen anew.
            length = None
        meter = self.meter
        if meter is not None and 200 <= status < 300:
            for name, value in kept:
                if name == b"content-type" and value.lower().startswith(_EVENT_STREAM):
                    meter.stream = True
                    if meter.asked:
                        # A chunk may be taken out: the length no longer holds.
                        length = None
                    self.resume = record_for(self)
                    break
        self.status = status
        self.sent_headers = True
        request = self.request
        # The head waits for the body's first bytes, which the replica's
        # connection reports next, in the same read (b"" when that read
        # held none): one send to the client, not two.
        kept.append((REPLICA_HEADER, self.route.replica_id.encode()))
        request.start_response(status, kept, length, reason or None, hold=True)
        request.set_producer(self)
        self.gw.metrics.first_byte(self.model, time.monotonic() - self.started)

    def response_relayed(self, status: int, reason: bytes, block: bytes, length: int) -> None:
        # response_started for a head in the common shape (see
        # llmgw.gateway.upstream.ResponseHandler): its header lines go on
        # to the client as they came, without the hop's own.
        if self.done or self.sent_headers and continued(self, status):
            return
        gw, replica_id = self.gw, self.route.replica_id  # type: ignore[union-attr]
        gw.router.succeeded(replica_id)
        unstarted = gw.unstarted
        unstarted.calls.pop(self, None)  # Unstarted.answered inline: its entry is this attempt's
        if unstarted.on_answer is not None:
            unstarted.on_answer(replica_id, self)
        framed: int | None = length
        meter = self.meter
        # find, not in: bytes' in tries its operand as a number first (a TypeError made and dropped).
        if meter is not None and 200 <= status < 300 and block.find(_EVENT_STREAM) >= 0:
            meter.stream = True
            if meter.asked:
                # A chunk may be taken out: the length no longer holds.
                framed = None
            self.resume = record_for(self)
        self.status = status
        self.sent_headers = True
        request = self.request
        request.start_response(  # hold, block by position: keywords cost the call more
            status, (), framed, reason or None, True, block + forwarding.replica_line(replica_id))
        request.producer = self  # request.set_producer(self), inline
        if request.channel.paused:
            self.pauseProducing()
        gw.metrics.first_byte(self.model, time.monotonic() - self.started)

    def response_data(self, data: bytes) -> None:
        if self.done:
            return
        # The connection puts the idle timer later as bytes arrive (see _send).
        if self.resume is not None:
            data = self.resume.feed(data)
        meter = self.meter
        if meter is not None and data:
            data = meter.feed(data)
        if not data:
            self.request.flush()
            return
        self.request.write(data)

    def response_finished(self) -> None:
        if self.done:
            return
        self.done = True
        self.conn = None
        armed = self.armed
        if armed is not None:  # self._cancel_timer(), inline
            self.armed = None
            armed.disarm(self._timed_out)
        self._end_attempt()
        meter = self.meter
        rest = self.resume.flush() if self.resume is not None else b""
        if meter is not None and (rest or meter.held):  # else the meter's flush has nothing
            rest = (meter.feed(rest) if rest else rest) + meter.flush()
        request = self.request
        if rest:
            request.write(rest)
        request.finish()
        if meter is not None:
            meter.finish(self.status)
        self._record(self.status)

    def response_failed(self, reason: Failure, started: bool) -> None:
        if self.done:
            return
        self.conn = None
        self._cancel_timer()
        route = self.route
        assert route is not None
        if self.sent_headers:
            self.log.warn(
                "replica {replica} ({address}) of {model} broke off a response: {reason}",
                replica=route.replica_id,
                address=route.address,
                model=self.model,
                reason=reason.getErrorMessage(),
            )
            self.gw.router.failed(route.replica_id)
            break_off(self, 502)  # or a continuation elsewhere (llmgw.gateway.resume)
            return
        if reason.check(UpstreamProtocolError):
            # The replica answered, but not in HTTP that can be passed on:
            # nothing of it reaches the client, and the request is not sent
            # again (the replica has done the work).
            self.gw.router.failed(route.replica_id)
            self._end_attempt()
            message = f"{route.address} sent a malformed response: {reason.getErrorMessage()}"
            self.log.warn(
                "replica {replica} of {model}: {problem}",
                replica=route.replica_id,
                model=self.model,
                problem=message,
            )
            self._refuse(errors.upstream_failed(self.model, message))
            return
        if self.reused and not started and not self.fresh_retry_used:
            # A kept-alive connection the replica had closed: not the
            # replica's fault; once more on a fresh connection.
            self.fresh_retry_used = True
            self._end_attempt()
            self.gw.metrics.retry(self.model, "stale_connection")
            self._attempt(route)
            return
        self._replica_failed(
            f"{route.address} closed the connection before answering: {reason.getErrorMessage()}",
            False,
            "reset",
        )

    # IPushProducer (downstream flow control)

    def pauseProducing(self) -> None:
        self.paused = True
        if self.conn is not None:
            self.conn.pause()

    def resumeProducing(self) -> None:
        self.paused = False
        if self.conn is not None:
            self.conn.resume()

    def stopProducing(self) -> None:
        self._client_gone(Failure(CancelledError("the client connection is closing")))

    # endings

    def _replica_failed(self, message: str, timeout: bool, reason: str) -> None:
        route = self.route
        assert route is not None
        self._end_attempt()
        self.last_error = message
        self.last_was_timeout = timeout
        if self.gw.router.failed(route.replica_id):
            self.gw.metrics.cooldowns.labels(route.replica_id).inc()
            self.log.warn(
                "replica {replica} ({address}) of {model} failed {n} times in a row: "
                "out of rotation for {cooldown} s",
                replica=route.replica_id,
                address=route.address,
                model=self.model,
                n=self.gw.router.failure_threshold,
                cooldown=self.gw.router.cooldown,
            )
        if len(self.tried) < self.gw.config.max_tries:
            self.gw.metrics.retry(self.model, reason)
            self.log.info(
                "{model} request: {problem}; trying another replica",
                model=self.model,
                problem=message,
            )
            self._attempt(None)
            return
        self._give_up()

    def _give_up(self) -> None:
        if not self.tried:
            self._refuse(errors.no_ready_replica(self.model, self.gw.config.retry_after))
            return
        if self.last_was_timeout:
            err = errors.upstream_timeout(self.model, self.last_error)
        else:
            err = errors.upstream_failed(self.model, self.last_error)
        self.log.warn(
            "{model} request failed after {tries} replica(s): {problem}",
            model=self.model,
            tries=len(self.tried),
            problem=self.last_error,
        )
        self._refuse(err)

    def _timed_out(self) -> None:
        self.armed = None
        if self.done:
            return
        if not self.sent_headers and self.conn is not None:
            left = self.sent_at + self.gw.config.first_byte_timeout - self.gw.reactor.seconds()
            if left > 0.001:  # not clock rounding
                self.conn.arm(self.gw.reactor, left, self._timed_out, self.gw.config.idle_timeout)
                self.armed = self.conn
                return
        route = self.route
        assert route is not None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()
        if self.sent_headers:
            self.log.warn(
                "replica {replica} ({address}) of {model} sent nothing for {idle} s "
                "in the middle of a response; giving up on it",
                replica=route.replica_id,
                address=route.address,
                model=self.model,
                idle=self.gw.config.idle_timeout,
            )
            break_off(self, 504)
            return
        self.gw.router.failed(route.replica_id)
        self._end_attempt()
        message = (
            f"{route.address} sent no response within {self.gw.config.first_byte_timeout} s"
        )
        self.log.warn("{model} request: {problem}", model=self.model, problem=message)
        # No retry: the replica may still be working on it; a second one
        # would only double the load.
        self._refuse(errors.upstream_timeout(self.model, message))

    def _refuse(self, err: errors.GatewayError) -> None:
        if self.resume is not None and self.sent_headers:
            # A continuation found no replica: the stream breaks as before.
            self.resume.count("no_replica")
            self._abort_client(err.status)
            return
        self.done = True
        request = self.request
        request.on_lost = None
        send_error(request, err)
        self._record(err.status)

    def _abort_client(self, status: int) -> None:
        self.done = True
        self._end_attempt()
        self._count_cut()
        # Closing without the last chunk tells the client the response is
        # incomplete.
        self.request.abort()
        self._record(status)

    def _client_gone(self, reason: Failure) -> None:
        if self.done:
            return
        self.done = True
        self._cancel_timer()
        if self.connecting is not None:
            d, self.connecting = self.connecting, None
            d.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()
        self._end_attempt()
        self._count_cut()
        self.gw.metrics.client_disconnect(self.model)
        self._record(499)

    def _count_cut(self) -> None:
        # A response cut short still spent the engine's tokens: what was
        # streamed of it counts (its usage, if it got that far, else its
        # chunks).
        if self.sent_headers and self.meter is not None:
            self.meter.finish(self.status)

    def _end_attempt(self) -> None:
        if self.counted:
            self.counted = False
            assert self.route is not None
            self.gw.router.end(self.route.replica_id)
            if not self.sent_headers or self.resume is not None:  # else its first byte took it out
                self.gw.unstarted.discard(self.route.replica_id, self)

    def replica_left(self) -> None:
        """
        The replica this request was sent to left the routing table before
        any byte of its answer: the request goes to another replica of the
        table as it stands now.
        """
        route = self.route
        if self.done or self.sent_headers or route is None:
            return
        conn, self.conn = self.conn, None
        self._cancel_timer()
        if conn is not None:
            conn.abort()
        self.routes = self.gw.table.routes(self.model)
        self._replica_failed(f"replica {route.replica_id} ({route.address}) left the routing "
                             "table before answering", False, "replica_left")

    def _cancel_timer(self) -> None:
        # The timer is the connection's (UpstreamConnection.arm): it stays
        # for the connection's next response, with nothing to call.
        conn = self.armed
        if conn is not None:
            self.armed = None
            conn.disarm(self._timed_out)

    def _record(self, status: int) -> None:
        gw = self.gw
        gw.metrics.answered(self.model, self.path_label, status, time.monotonic() - self.started)
        # The call is over: its capacity may go to a waiting request.
        gw.admission.ended(self.model)


# Not @implementer (setup.py's rules for compiled classes).
classImplements(ProxyCall, IPushProducer)

