"""
The console's playground: a chat with a model, through this control
plane's own gateway, spending an API key the operator gave the person's
role.

- C{GET /api/v1/playground}: whether there is a gateway, whether it needs
  a key, and the names of the keys this requester may spend (a key's
  C{console_roles} in the keys file, L{llmgw.gateway.keys}; the operator at
  the host, on a loopback API without TLS, may spend any of them).
- C{POST /api/v1/playground/chat} with C{{"model", "messages", "key",
  "max_tokens", "temperature"}}: sent on to the gateway as a streamed chat
  completion with that key (which never leaves the control plane), and its
  answer streamed back as it comes: status, C{Content-Type}, the replica
  that answered (C{x-llmgw-replica}), C{Retry-After}, and the body. The
  gateway's limits, queue and usage counting apply as to any client; the
  request's C{user} names the person (C{console:NAME}).

The relay holds no more than one read of the gateway's answer: while the
browser's connection is behind, reading from the gateway pauses.
"""

from __future__ import annotations

import math
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.client import Agent, Response
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from llmgw.control.admin.auth import known_admin
from llmgw.control.admin.base import JSON_TYPE, AdminNode, Refused, encode_json, json_body
from llmgw.untrusted import clip

#: Most messages one chat may carry.
MAX_MESSAGES = 200
#: Most tokens one answer may ask for.
MAX_TOKENS = 8192
#: The roles a message may have.
MESSAGE_ROLES = ("system", "user", "assistant")
#: Seconds to wait for the gateway to take the connection.
CONNECT_TIMEOUT = 10
#: The gateway's response headers the browser gets.
PASSED_HEADERS = (b"content-type", b"x-llmgw-replica", b"retry-after")


def console_role(root: Any, request: Any) -> str | None:
    """
    The role whose keys C{request}'s sender may spend: a logged-in
    person's, an admin certificate's; C{None} on a loopback API without
    TLS (the operator at the host: any console key).
    """
    session = getattr(request, "llmgw_session", None)
    if session is not None:
        return str(session.role)
    if not root.require_certificate:
        return None
    admin = known_admin(request)
    return admin.role if admin is not None else ""


def _gateway(root: Any) -> Any:
    service = getattr(root.control, "gateway", None)
    return service if service is not None and getattr(service.listener, "port", None) is not None else None


class Playground(AdminNode):
    """
    C{GET /api/v1/playground}; C{chat} below it.
    """

    def __init__(self, root: Any):
        super().__init__(root)
        self.putChild(b"chat", Chat(root))

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        service = _gateway(self.root)
        keys = service.gateway.keys if service is not None else None
        return {
            "gateway": service is not None,
            "keys_required": keys is not None,
            "keys": keys.console_keys(console_role(self.root, request)) if keys is not None else [],
        }


def parse_chat(body: dict[str, Any]) -> dict[str, Any]:
    """
    The chat completion to send for a playground request C{body}.

    @raise Refused: 400, naming what is wrong.
    """
    unknown = sorted(set(body) - {"model", "messages", "key", "max_tokens", "temperature"})
    if unknown:
        raise Refused(400, f"unknown field(s) {', '.join(map(clip, unknown[:5]))}; the body is "
                           '{"model", "messages", "key", "max_tokens", "temperature"}')
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(400, '"model" must name a model')
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise Refused(400, f'"messages" must be a list of 1 to {MAX_MESSAGES} messages')
    for m in messages:
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in MESSAGE_ROLES
                or not isinstance(m["content"], str)):
            raise Refused(400, 'each message must be {"role": "system"|"user"|"assistant", "content": TEXT}')
    chat: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    if "max_tokens" in body:
        n = body["max_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TOKENS:
            raise Refused(400, f'"max_tokens" must be a whole number from 1 to {MAX_TOKENS}')
        chat["max_tokens"] = n
    if "temperature" in body:
        t = body["temperature"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and 0 <= t <= 2):
            raise Refused(400, '"temperature" must be a number from 0 to 2')
        chat["temperature"] = t
    return chat


@implementer(IBodyProducer)
class _Bytes:
    """A request body that is all there at once."""

    def __init__(self, data: bytes):
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:  # noqa: N802
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self) -> None:  # noqa: N802
        pass

    def resumeProducing(self) -> None:  # noqa: N802
        pass

    def stopProducing(self) -> None:  # noqa: N802
        pass


@implementer(IPushProducer)
class Relay(Protocol):
    """
    The gateway's answer body, written to the browser's request as it
    comes; the browser's connection pauses and resumes the reading
    (C{registerProducer} on the request), and its going stops it.
    """

    def __init__(self, request: Any):
        self.request = request
        self.gone = False
        self.done: Deferred[None] = Deferred()

    def connectionMade(self) -> None:  # noqa: N802
        self.request.registerProducer(self, True)

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        if not self.gone:
            self.request.write(data)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]  # noqa: N802
        if not self.gone:
            self.request.unregisterProducer()
            self.request.finish()
        self.done.callback(None)

    def client_gone(self) -> None:
        self.gone = True
        self.stopProducing()

    def pauseProducing(self) -> None:  # noqa: N802
        producer: Any = self.transport  # the response's body, an IPushProducer
        if producer is not None:
            producer.pauseProducing()

    def resumeProducing(self) -> None:  # noqa: N802
        producer: Any = self.transport  # the response's body, an IPushProducer
        if producer is not None:
            producer.resumeProducing()

    def stopProducing(self) -> None:  # noqa: N802
        producer: Any = self.transport  # the response's body, an IPushProducer
        if producer is not None:
            producer.stopProducing()


class Chat(AdminNode):
    """
    C{POST /api/v1/playground/chat}: see the module's docstring.
    """

    log = Logger()

    def render_POST(self, request: Any) -> Any:  # noqa: N802
        body = json_body(request, self.root.max_body)
        chat = parse_chat(body)
        service = _gateway(self.root)
        if service is None:
            raise Refused(409, "this control plane runs no gateway (--gateway off): the playground "
                               "talks to the models through it")
        keys = service.gateway.keys
        role = console_role(self.root, request)
        headers = Headers({b"content-type": [b"application/json"]})
        key_name = body.get("key")
        if keys is not None:
            secret = keys.console_key(key_name, role) if isinstance(key_name, str) else None
            if secret is None:
                mine = keys.console_keys(role)
                raise Refused(403, f"no API key {clip(str(key_name))} for role {role or 'any'} to spend; "
                                   + (f"yours: {', '.join(mine)}" if mine else
                                      "the operator gives a role keys with console_roles in the keys file"))
            headers.setRawHeaders(b"authorization", [b"Bearer " + secret.encode()])
        person = getattr(getattr(request, "llmgw_session", None), "user", None) or \
            getattr(known_admin(request), "name", None) or "operator"
        chat["user"] = f"console:{person}"
        address = service.listener.port.getHost()
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address.host, address.host)
        url = f"http://{'[' + host + ']' if ':' in host else host}:{address.port}/v1/chat/completions"
        self.log.info("admin API: playground chat with {model} as {who} (key {key})",
                      model=chat["model"], who=self.root.who(request), key=key_name if keys is not None else "none")
        agent = Agent(service.reactor, connectTimeout=CONNECT_TIMEOUT)
        asked = agent.request(b"POST", url.encode(), headers, _Bytes(encode_json(chat)))
        relay = Relay(request)
        gone: list[Any] = []

        def client_gone(_: Any) -> None:
            gone.append(True)
            if not asked.called:
                asked.cancel()
            relay.client_gone()

        request.notifyFinish().addErrback(client_gone)

        def answered(response: Response) -> None:
            if gone:
                response.deliverBody(Protocol())
                return
            request.setResponseCode(response.code)
            request.setHeader(b"cache-control", b"no-store")
            request.setHeader(b"x-content-type-options", b"nosniff")
            for name in PASSED_HEADERS:
                values = response.headers.getRawHeaders(name)
                if values:
                    request.setHeader(name, values[0])
            response.deliverBody(relay)

        def failed(f: Failure) -> None:
            if gone:
                return
            self.log.warn("admin API: the playground could not reach the gateway at {url}: {error}",
                          url=url, error=f.getErrorMessage())
            reason = f"the gateway at {url} did not answer: {f.getErrorMessage()}"
            data = encode_json({"error": reason, "status": 502})
            request.setResponseCode(502)
            request.setHeader(b"content-type", JSON_TYPE)
            request.setHeader(b"content-length", str(len(data)).encode())
            request.write(data)
            request.finish()

        asked.addCallbacks(answered, failed)
        return server.NOT_DONE_YET

