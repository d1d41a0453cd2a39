"""
L{EtcdClient}: etcd's v3 API over its JSON gateway, with C{treq}.

L{EtcdClient} knows several member URLs. A request that cannot reach its
member (refused, reset, timed out) moves the client to the next member for
this and later requests; a request whose connection was refused is tried
on the next member at once (nothing was sent), one that timed out is not
retried here (it may have been applied) and fails with L{EtcdUnavailable}.
A request that etcd answered with an error fails with L{EtcdError}
carrying etcd's code and message. A TLS handshake that failed (etcd refused
this member's client certificate, or etcd's certificate is not from
C{--etcd-ca}) is taken as an unreachable member (nothing was applied), and
when no member could be reached for it the request fails with
L{EtcdTLSError}, which says which side refused and what to check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import treq
from twisted.internet import defer, error
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
)

from llmgw.etcd.errors import GRPC_NOT_FOUND, EtcdError, EtcdTLSError, EtcdUnavailable, tls_problem
from llmgw.etcd.kv import Compare, KeyValue, Op, TxnResult, WatchEvent, b64, prefix_end
from llmgw.etcd.watch import Watch, WatchStream

#: The JSON gateway's path prefix (etcd 3.4 and 3.5).
API_PREFIX = "/v3"
#: Seconds one unary request may take before the member is taken as gone.
DEFAULT_TIMEOUT = 2.0
#: The largest unary response read.
MAX_RESPONSE = 16 * 1024 * 1024

_JSON_HEADERS: dict[bytes | str, bytes | str] = {b"Content-Type": b"application/json"}


class _Body(Protocol):
    """Reads a unary response into memory, up to L{MAX_RESPONSE}."""

    def __init__(self, done: defer.Deferred[bytes]):
        self.done = done
        self.parts: list[bytes] = []
        self.size = 0

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        self.size += len(data)
        if self.size > MAX_RESPONSE:
            self.transport.stopProducing()  # type: ignore[union-attr]
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008,N802
        if self.size > MAX_RESPONSE:
            self.done.errback(EtcdUnavailable(f"etcd's response exceeded {MAX_RESPONSE} bytes"))
        elif reason.check(ResponseDone):
            self.done.callback(b"".join(self.parts))
        else:
            self.done.errback(reason)



#: Failures that mean the member could not be reached at all (nothing was
#: sent), so the next member may be asked at once.
_UNREACHED = (error.ConnectionRefusedError, error.ConnectError, error.DNSLookupError)


class EtcdClient:
    """
    @param reactor: the reactor (for time and connections).
    @param urls: member client URLs, C{http://127.0.0.1:2379} or
        C{https://...}; at least one.
    @param tls: an C{IPolicyForHTTPS} for C{https} members (etcd's CA and
        this member's client certificate), e.g.
        L{llmgw.tlsconf.options.ClientTLSPolicy}.
    @param timeout: seconds a unary request may take.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        urls: Sequence[str],
        tls: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        if not urls:
            raise ValueError("an etcd client needs at least one member URL")
        self.reactor = reactor
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self._current = 0
        #: Requests sent whose answer's head has not come yet.
        self._inflight: set[defer.Deferred[Any]] = set()
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 4
        self.pool.retryAutomatically = False
        agent = Agent(reactor, contextFactory=tls, pool=self.pool) if tls is not None else Agent(
            reactor, pool=self.pool
        )
        self.http = treq.client.HTTPClient(agent)
        # Watches get their own connections: a long-lived stream must not
        # hold one that unary requests would queue behind.
        self._watch_http = treq.client.HTTPClient(
            Agent(reactor, contextFactory=tls) if tls is not None else Agent(reactor)
        )

    @property
    def url(self) -> str:
        """The member URL requests go to now."""
        return self.urls[self._current]

    def _next_member(self) -> None:
        self._current = (self._current + 1) % len(self.urls)

    def close(self) -> defer.Deferred[None]:
        """
        Cancel the requests still connecting or waiting for their answer's
        head, and close pooled connections (tests call this before they end).
        """
        for posted in list(self._inflight):
            posted.cancel()
        return self.pool.closeCachedConnections()  # type: ignore[no-any-return]

    def _landed(self, result: Any, posted: defer.Deferred[Any]) -> Any:
        self._inflight.discard(posted)
        return result

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """
        POST C{body} to C{API_PREFIX + path} and return the decoded answer.

        @raise EtcdError: etcd answered with an error.
        @raise EtcdUnavailable: no member answered.
        """
        data = json.dumps(body).encode()
        tried = 0
        last = ""
        tls_failed = False
        while tried < len(self.urls):
            url = self.url
            tried += 1
            try:
                posted = self.http.post(
                    url + API_PREFIX + path, data=data, timeout=self.timeout, unbuffered=True,
                    headers=_JSON_HEADERS,
                )
                self._inflight.add(posted)
                posted.addBoth(self._landed, posted)
                response = await posted
            except _UNREACHED as e:
                last = f"{url}: {e.__class__.__name__}: {e}"
                self._next_member()
                continue
            except (defer.CancelledError, error.TimeoutError, ResponseFailed, RequestTransmissionFailed,
                    error.ConnectionLost) as e:
                self._next_member()
                problem = tls_problem(e, url)
                if problem is not None:
                    # The handshake failed: nothing reached etcd.
                    last, tls_failed = problem, True
                    continue
                raise EtcdUnavailable(
                    f"etcd member {url} did not answer {path} within {self.timeout}s "
                    f"({e.__class__.__name__})"
                ) from e
            # The answer's head came: etcd took the request, so whatever
            # cuts the body off, it is not sent to another member (it may
            # have been applied).
            done: defer.Deferred[bytes] = defer.Deferred()
            response.deliverBody(_Body(done))
            try:
                raw = await done
            except EtcdUnavailable:
                raise
            except Exception as e:
                self._next_member()
                raise EtcdUnavailable(
                    f"etcd member {url}'s answer to {path} was cut off ({e.__class__.__name__}); "
                    f"it may have been applied"
                ) from e
            try:
                answer = json.loads(raw) if raw else {}
            except ValueError as e:
                raise EtcdError(-1, f"not JSON: {raw[:200]!r}", url) from e
            if response.code != 200 or "error" in answer and "header" not in answer:
                raise EtcdError(
                    int(answer.get("code", -1)),
                    str(answer.get("message") or answer.get("error") or f"HTTP {response.code}"),
                    url,
                )
            return answer  # type: ignore[no-any-return]
        if tls_failed:
            raise EtcdTLSError(last)
        raise EtcdUnavailable(f"no etcd member could be reached ({last})")

    # -- leases -----------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of C{ttl} seconds: C{(lease id, granted TTL)}."""
        answer = await self.call("/lease/grant", {"TTL": str(ttl)})
        return int(answer["ID"]), int(answer["TTL"])

    async def keepalive(self, lease: int) -> int:
        """
        Renew C{lease} once; the TTL it has now, 0 when etcd no longer
        holds it (expired or revoked).
        """
        answer = await self.call("/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """Revoke C{lease}, deleting every key attached to it."""
        try:
            await self.call("/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if e.code != GRPC_NOT_FOUND:
                raise

    # -- keys -------------------------------------------------------------------

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write C{key}; the store's revision after it."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("/kv/put", body)
        return int(answer["header"]["revision"])

    async def range(self, key: bytes, range_end: bytes = b"") -> tuple[list[KeyValue], int]:
        """
        The keys from C{key} up to C{range_end} (just C{key} without one),
        and the store's revision they were read at.
        """
        body = {"key": b64(key)}
        if range_end:
            body["range_end"] = b64(range_end)
        answer = await self.call("/kv/range", body)
        kvs = [KeyValue.from_json(kv) for kv in answer.get("kvs", [])]
        return kvs, int(answer["header"]["revision"])

    async def get(self, key: bytes) -> KeyValue | None:
        kvs, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        return await self.range(prefix, prefix_end(prefix))

    async def delete(self, key: bytes, range_end: bytes = b"") -> int:
        """Delete C{key} (through C{range_end}); how many keys went."""
        body = {"key": b64(key)}
        if range_end:
            body["range_end"] = b64(range_end)
        answer = await self.call("/kv/deleterange", body)
        return int(answer.get("deleted", 0))

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
    ) -> TxnResult:
        """
        Run C{success} if every C{compare} holds, else C{failure}, as one
        atomic step.
        """
        answer = await self.call("/kv/txn", {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        })
        responses: list[dict[str, Any]] = []
        for r in answer.get("responses", []):
            if "response_range" in r:
                rr = r["response_range"]
                responses.append({"kvs": [KeyValue.from_json(kv) for kv in rr.get("kvs", [])]})
            else:
                responses.append(r)
        return TxnResult(bool(answer.get("succeeded", False)), int(answer["header"]["revision"]), responses)

    async def status(self) -> dict[str, Any]:
        """The member's status: C{member_id}, C{leader}, C{version}, ..."""
        answer = await self.call("/maintenance/status", {})
        return {
            "member_id": int(answer["header"]["member_id"]),
            "leader": int(answer.get("leader", 0)),
            "version": answer.get("version", ""),
            "revision": int(answer["header"]["revision"]),
        }

    # -- watch ------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        on_events: Callable[[list[WatchEvent], int], None],
        range_end: bytes = b"",
        start_revision: int = 0,
    ) -> Watch:
        """
        Stream changes of C{key} (through C{range_end}) from
        C{start_revision} (0: from now) to C{on_events(events, revision)},
        on the member C{url} names now. The caller restarts a watch whose
        C{done} fired, from C{watch.revision + 1}.
        """
        w = Watch()
        w.revision = max(0, start_revision - 1)
        req: dict[str, Any] = {"key": b64(key)}
        if range_end:
            req["range_end"] = b64(range_end)
        if start_revision:
            req["start_revision"] = str(start_revision)
        url = self.url

        def message(msg: dict[str, Any]) -> None:
            result = msg.get("result")
            if result is None:
                err = msg.get("error", {})
                if not w.done.called:
                    w.done.errback(EtcdError(int(err.get("grpc_code", err.get("code", -1))),
                                             str(err.get("message", msg)), url))
                return
            if result.get("canceled"):
                if not w.done.called:
                    w.done.errback(EtcdError(
                        -1, f"watch canceled: {result.get('cancel_reason', '')} "
                        f"(compacted to {result.get('compact_revision', 0)})", url,
                    ))
                return
            revision = int(result.get("header", {}).get("revision", 0))
            events = [
                WatchEvent(e.get("type", "PUT"), KeyValue.from_json(e.get("kv", {})))
                for e in result.get("events", [])
            ]
            if events:
                w.revision = max(w.revision, max(e.kv.mod_revision for e in events))
                on_events(events, revision)

        async def run() -> None:
            response = await self._watch_http.post(
                url + API_PREFIX + "/watch", data=json.dumps({"create_request": req}).encode(),
                unbuffered=True, headers=_JSON_HEADERS,
            )
            if response.code != 200:
                raise EtcdError(response.code, f"watch refused with HTTP {response.code}", url)
            stream_done: defer.Deferred[None] = defer.Deferred()
            w._stream = WatchStream(message, stream_done)
            response.deliverBody(w._stream)
            await stream_done

        d = defer.Deferred.fromCoroutine(run())
        w._request = d

        def ended(result: Any) -> None:
            if w.done.called:
                return
            if isinstance(result, Failure):
                if result.check(*_UNREACHED, error.ConnectionLost, ResponseFailed, RequestTransmissionFailed):
                    self._next_member()
                problem = tls_problem(result.value, url) if result.value is not None else None
                if result.check(defer.CancelledError):
                    w.done.callback(None)
                elif problem is not None:
                    w.done.errback(EtcdTLSError(problem))
                else:
                    w.done.errback(result)
            else:
                w.done.callback(None)

        d.addBoth(ended)
        return w


def as_deferred(coro: Any) -> defer.Deferred[Any]:
    """Run one of L{EtcdClient}'s coroutines as a Deferred."""
    return defer.Deferred.fromCoroutine(coro)
