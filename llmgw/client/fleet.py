"""
L{FleetClient}: the admin API over its watch socket, on txaio.

One class for both frameworks: its futures are txaio's (a C{Deferred}
under Twisted, an C{asyncio.Future} under asyncio), its timers
C{txaio.call_later}; only L{FleetClient._dial} asks which framework runs,
to pick autobahn's protocol and open the connection.
"""

from __future__ import annotations

import collections
import json
import random
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import txaio as _txaio

# txaio fills in its functions when a framework is chosen; to mypy they
# do not exist.
txaio: Any = _txaio

#: Seconds a request may wait for its answer.
REQUEST_TIMEOUT = 30.0
#: Messages kept for C{async for} when the consumer falls behind; past it
#: the oldest are dropped and a C{reset}-like C{gap} message says so.
MAX_QUEUED = 10_000
#: Redirects followed in a row (a member that does not lead sends the
#: client to the leader: one hop; more means the members disagree).
MAX_REDIRECTS = 3


class FleetError(Exception):
    """
    The admin API refused a request (C{status} is its HTTP status, C{reason}
    what it said), or the connection to it failed (C{status} 0).
    """

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}" if status else reason)
        self.status = status
        self.reason = reason


def _choose_framework() -> None:
    if txaio.using_twisted or txaio.using_asyncio:
        return
    if "twisted.internet.reactor" in sys.modules:
        txaio.use_twisted()
    else:
        txaio.use_asyncio()


_classes: dict[str, Any] = {}


def _socket_class() -> Any:
    """
    autobahn's client protocol of the framework in use, with the client's
    hooks.
    """
    key = "twisted" if txaio.using_twisted else "asyncio"
    if key in _classes:
        return _classes[key]
    Base: Any
    if key == "twisted":
        from autobahn.twisted.websocket import WebSocketClientProtocol as Base
    else:
        from autobahn.asyncio.websocket import WebSocketClientProtocol as Base

    class Socket(Base):  # type: ignore[misc, valid-type]
        client: FleetClient

        def onOpen(self) -> None:
            self.client._opened(self)

        def onMessage(self, payload: bytes, isBinary: bool) -> None:  # noqa: N803
            self.client._received(self, payload)

        def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:  # noqa: N803
            self.client._closed(self, reason)

        def failHandshake(self, reason: str, *args: Any) -> None:  # noqa: N802
            # A member that does not lead answers the socket's upgrade with
            # a 307 to the leader: kept, and followed once this one closes.
            status = (getattr(self, "http_status_line", "") or "").split()
            location = (getattr(self, "http_headers", None) or {}).get("location")
            if len(status) > 1 and status[1] in ("307", "308") and location:
                self.llmgw_moved = location
            super().failHandshake(reason, *args)

    _classes[key] = Socket
    return Socket


class FleetClient:
    """
    A client of the admin API at C{url} (C{http://HOST:PORT} or
    C{https://...}; C{ws://}/C{wss://} too). Over TLS it presents the admin
    certificate C{cert} with its key C{key} and trusts only C{ca}, as
    C{llmgw ctl} does (C{ca.pem}, C{admin-NAME.pem}, C{admin-NAME.key}).

    Reads (L{nodes}, L{deployments}, L{replicas}, L{events}, L{status},
    L{routes}) and commands (L{scale}, L{cordon}, L{uncordon}, L{drain},
    L{reload}) return a future of the API's answer, or fail with
    L{FleetError}. Against an HA control plane any member's URL does: a
    member that does not lead sends the client to the leader (a C{307} to
    the socket's upgrade, or to a request), which it follows at once, at
    most L{MAX_REDIRECTS} hops in a row and never from TLS to plain; it
    logs each, and C{redirected_to} is the leader's URL it talks to then.
    Requests that member left unanswered are sent to the leader (a member
    that does not lead runs no command). A lost connection to the leader
    is dialled again at the URL first given, which names the leader of
    the moment. The connection opens on first use; L{watch} keeps it
    open, reconnecting after a loss with a backoff (C{retry} seconds,
    doubled to C{max_retry}, a fifth of jitter) and resuming from the last
    revision seen, so a watcher sees every message once (or a C{reset} and
    a C{snapshot} when the control plane could not resume).
    """

    def __init__(
        self,
        url: str,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        retry: float = 0.5,
        max_retry: float = 30.0,
        timeout: float = REQUEST_TIMEOUT,
    ):
        _choose_framework()
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss"):
            raise ValueError(f"{url!r}: the admin API's URL is http://HOST:PORT or https://HOST:PORT")
        self.secure = parts.scheme in ("https", "wss")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.secure else 80)
        if self.secure and not (ca and cert and key):
            raise ValueError("an https:// admin API needs ca, cert and key (an admin certificate)")
        self.ca, self.cert, self.key = ca, cert, key
        #: The URL first given: dialled again when a leader's socket is lost.
        self._home = (self.host, self.port, self.secure)
        #: The leader's URL this client was sent to, while it talks there.
        self.redirected_to: str | None = None
        self._redirects = 0
        #: A redirect to follow once the current socket has closed.
        self._moving: str | None = None
        self.retry, self.max_retry, self.timeout = retry, max(retry, max_retry), timeout
        self.log = txaio.make_logger()
        self.revision: int | None = None
        self.epoch: str | None = None
        self._socket: Any = None
        self._dialing = False
        self._closing = False
        self._failures = 0
        self._next_id = 0
        self._pending: dict[int, tuple[Any, Any, bytes]] = {}
        self._queued: list[bytes] = []
        self._watchers: list[Callable[[dict[str, Any]], None]] = []
        self._keep_open = False
        self._queue: collections.deque[dict[str, Any]] | None = None
        self._waiting: Any = None
        self._redial: Any = None
        self._rng = random.Random()

    # -- reads and commands ------------------------------------------------------------

    def status(self) -> Any:
        return self._request("GET", "/api/v1/status")

    def nodes(self) -> Any:
        return self._request("GET", "/api/v1/nodes", "nodes")

    def deployments(self) -> Any:
        return self._request("GET", "/api/v1/deployments", "deployments")

    def replicas(self) -> Any:
        return self._request("GET", "/api/v1/replicas", "replicas")

    def events(self, since: float = 0.0) -> Any:
        return self._request("GET", "/api/v1/events?" + urlencode({"since": repr(float(since))}), "events")

    def routes(self) -> Any:
        return self._request("GET", "/api/v1/routes")

    def scale(self, model: str, replicas: int) -> Any:
        return self._request("POST", f"/api/v1/deployments/{quote(model, safe='')}/scale",
                             body={"replicas": replicas})

    def cordon(self, node: str) -> Any:
        return self._request("POST", f"/api/v1/nodes/{quote(node, safe='')}/cordon")

    def uncordon(self, node: str) -> Any:
        return self._request("POST", f"/api/v1/nodes/{quote(node, safe='')}/uncordon")

    def drain(self, node: str) -> Any:
        return self._request("POST", f"/api/v1/nodes/{quote(node, safe='')}/drain")

    def reload(self) -> Any:
        """
        Re-read the control plane's catalog.
        """
        return self._request("POST", "/api/v1/catalog/reload")

    # -- the stream ----------------------------------------------------------------------

    def watch(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """
        Call C{callback(message)} with every message of the stream from now
        on (first a C{snapshot}), across reconnections.
        """
        self._watchers.append(callback)
        self._keep_open = True
        self._ensure_open()

    def __aiter__(self) -> FleetClient:
        if self._queue is None:
            self._queue = collections.deque()
            self._keep_open = True
            self._ensure_open()
        return self

    async def __anext__(self) -> dict[str, Any]:
        """
        The stream's next message (C{async for message in client}), under
        either framework.
        """
        self.__aiter__()
        assert self._queue is not None
        while not self._queue:
            if self._closing:
                raise StopAsyncIteration
            self._waiting = txaio.create_future()
            await self._waiting
        return self._queue.popleft()

    def close(self) -> Any:
        """
        Close the connection and stop reconnecting; pending requests fail.
        Returns a future that fires once it is closed.
        """
        self._closing = True
        self._keep_open = False
        if self._redial is not None:
            self._redial.cancel()
            self._redial = None
        self._wake()
        done = txaio.create_future()
        socket = self._socket
        if socket is None:
            txaio.resolve(done, None)
            return done
        self._close_waiter = done
        socket.sendClose()
        return done

    # -- the connection ---------------------------------------------------------------

    def _url(self) -> str:
        url = f"{'wss' if self.secure else 'ws'}://{self.host}:{self.port}/api/v1/watch"
        if self.revision is not None and self.epoch is not None:
            url += "?" + urlencode({"since": self.revision, "epoch": self.epoch})
        return url

    def _ensure_open(self) -> None:
        if self._socket is None and not self._dialing and not self._closing and self._redial is None:
            self._dial()

    def _dial(self) -> None:
        self._redial = None
        if self._socket is not None or self._dialing or self._closing:
            return
        self._dialing = True
        url = self._url()
        socket_class = _socket_class()
        client = self
        if txaio.using_twisted:
            from autobahn.twisted.websocket import WebSocketClientFactory
            from twisted.internet import reactor
            from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS

            factory: Any = WebSocketClientFactory(url, reactor=reactor)
            endpoint: Any = HostnameEndpoint(reactor, self.host, self.port, timeout=self.timeout)
            if self.secure:
                from llmgw.tlsconf.options import ClientTLSPolicy, TLSFiles

                assert self.ca and self.cert and self.key
                policy = ClientTLSPolicy(TLSFiles.load(self.ca, self.cert, self.key))
                endpoint = wrapClientTLS(policy.creatorForNetloc(self.host.encode("idna"), self.port), endpoint)
            connecting = lambda: endpoint.connect(factory)  # noqa: E731
        else:
            import asyncio
            import ssl

            from autobahn.asyncio.websocket import WebSocketClientFactory as AsyncioFactory

            factory = AsyncioFactory(url)
            context = None
            if self.secure:
                context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_cert_chain(self.cert or "", self.key)
            loop: Any = asyncio.get_event_loop()
            connecting = lambda: asyncio.ensure_future(  # noqa: E731
                loop.create_connection(factory, self.host, self.port, ssl=context)
            )
        factory.setProtocolOptions(autoPingInterval=10, autoPingTimeout=10, openHandshakeTimeout=self.timeout)

        # A protocol class of this client's own: both frameworks' factories
        # build with self.protocol().
        factory.protocol = type("FleetSocket", (socket_class,), {"client": client})
        try:
            attempt = connecting()
        except Exception as e:
            self._closed(None, str(e))
            return
        txaio.add_callbacks(attempt, None, lambda f: self._closed(None, txaio.failure_message(f)))

    def _opened(self, socket: Any) -> None:
        self._dialing = False
        self._socket = socket
        self._failures = 0
        queued, self._queued = self._queued, []
        for payload in queued:
            socket.sendMessage(payload)

    def _closed(self, socket: Any, reason: Any) -> None:
        if socket is not None:
            # autobahn may tell of one socket's end more than once.
            if getattr(socket, "llmgw_closed", False):
                return
            socket.llmgw_closed = True
            if self._socket is not None and socket is not self._socket:
                return
        self._socket = None
        self._dialing = False
        why = str(reason or "the connection closed")
        moving, self._moving = self._moving or getattr(socket, "llmgw_moved", None), None
        if moving is not None and not self._closing and self._move(moving, why):
            # Unanswered requests go to the leader, in the order they were made.
            self._queued = [payload for _, (_, _, payload) in sorted(self._pending.items())]
            self._dial()
            return
        if self.redirected_to is not None:
            # The leader went away: the member first given names the next.
            self.host, self.port, self.secure = self._home
            self.redirected_to = None
        # Every state change first: a caller told of its failed request
        # below may ask again at once, and that request must be kept.
        pending, self._pending = self._pending, {}
        self._queued = []
        waiter = getattr(self, "_close_waiter", None)
        if waiter is not None and self._closing:
            self._close_waiter = None
            txaio.resolve(waiter, None)
        if self._closing or not self._keep_open:
            self._wake()
        else:
            self._failures += 1
            delay = min(self.max_retry, self.retry * 2 ** (self._failures - 1)) * (1 + 0.2 * self._rng.random())
            self.log.info("llmgw admin socket closed ({why}); reconnecting in {delay:.1f} s", why=why, delay=delay)
            self._redial = txaio.call_later(delay, self._dial)
        for future, call, _ in pending.values():
            call.cancel()
            txaio.reject(future, FleetError(0, f"the admin API's socket closed: {why}"))

    def _move(self, location: str, why: str) -> bool:
        """
        Point the client at C{location} (a leader's URL, named by a member
        that does not lead); whether it is followed: not past
        L{MAX_REDIRECTS} in a row, not from TLS to plain, not to TLS
        without an admin certificate.
        """
        parts = urlsplit(location)
        secure = parts.scheme in ("https", "wss")
        refusal = None
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            refusal = "it is not an http(s) URL"
        elif self.secure and not secure:
            refusal = "it is not https (the client would leave TLS)"
        elif secure and not (self.ca and self.cert and self.key):
            refusal = "it is https and this client has no admin certificate"
        elif self._redirects >= MAX_REDIRECTS:
            refusal = f"{MAX_REDIRECTS} redirects in a row: do the members agree on the leader?"
        if refusal is not None:
            self.log.warn("llmgw admin: not following the redirect to {location}: {refusal}",
                          location=location[:200], refusal=refusal)
            return False
        self._redirects += 1
        was = f"{'https' if self.secure else 'http'}://{self.host}:{self.port}"
        self.host = parts.hostname or self.host
        self.port = parts.port or (443 if secure else 80)
        self.secure = secure
        self.redirected_to = f"{'https' if secure else 'http'}://{self.host}:{self.port}"
        self.log.info("llmgw admin: {was} does not lead; going to the leader at {leader}",
                      was=was, leader=self.redirected_to)
        return True

    def _received(self, socket: Any, payload: bytes) -> None:
        try:
            message = json.loads(payload)
        except ValueError:
            self.log.warn("llmgw admin socket: a message is not JSON; ignored")
            return
        if not isinstance(message, dict):
            return
        if message.get("type") == "response":
            entry = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
            if entry is None:
                return
            future, call, payload = entry
            status, body = message.get("status"), message.get("body")
            location = body.get("location") if isinstance(body, dict) else None
            if status in (307, 308) and isinstance(location, str) and self._socket is socket:
                # This member no longer leads: the request goes to the
                # leader, on a socket there, once this one has closed.
                self._pending[message["id"]] = entry  # type: ignore[index]
                self._moving = location
                socket.sendClose()
                return
            call.cancel()
            if status not in (307, 308):
                self._redirects = 0
            if status == 200:
                txaio.resolve(future, body)
            else:
                reason = body.get("error") if isinstance(body, dict) else str(body)
                txaio.reject(future, FleetError(int(status or 0), str(reason)))
            return
        # A member that streams to this client serves it: redirects counted anew.
        self._redirects = 0
        revision = message.get("revision")
        if isinstance(revision, int):
            self.revision = revision
        if message.get("type") == "snapshot" and isinstance(message.get("epoch"), str):
            self.epoch = message["epoch"]
        for callback in list(self._watchers):
            try:
                callback(message)
            except Exception:
                self.log.failure("llmgw watch callback {callback!r} failed", callback=callback)
        if self._queue is not None:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
            self._queue.append(message)
            self._wake()

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            txaio.resolve(waiting, None)

    def _request(self, method: str, path: str, pick: str | None = None, body: Any = None) -> Any:
        if self._closing:
            failed = txaio.create_future()
            txaio.reject(failed, FleetError(0, "the client is closed"))
            return failed
        self._next_id += 1
        rid = self._next_id
        message: dict[str, Any] = {"type": "request", "id": rid, "method": method, "path": path}
        if body is not None:
            message["body"] = body
        future = txaio.create_future()

        def expire() -> None:
            if self._pending.pop(rid, None) is not None:
                txaio.reject(future, FleetError(0, f"no answer to {method} {path} within {self.timeout} s"))

        payload = json.dumps(message).encode("utf-8")
        self._pending[rid] = (future, txaio.call_later(self.timeout, expire), payload)
        if self._socket is not None:
            self._socket.sendMessage(payload)
        else:
            self._queued.append(payload)
            self._ensure_open()
        if pick is None:
            return future
        result = txaio.create_future()
        txaio.add_callbacks(
            future,
            lambda answer: txaio.resolve(result, answer[pick]),
            lambda failure: txaio.reject(result, failure),
        )
        return result
