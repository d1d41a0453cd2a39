"""
Tests for L{llmgw.control.admin.playground}: the console's chat, sent on to
a real gateway on loopback with a key the person's role was given, streamed
back with the replica that answered; and the keys file's C{console_roles}.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool

from llmgw.control.admin.playground import Relay, console_role, parse_chat
from llmgw.control.admin.site import admin_site
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.keys import KeysError, parse_keys
from llmgw.gateway.proxy import REPLICA_HEADER
from llmgw.testing.fleet import sample_fleet
from tests.gateway_helpers import Harness
from tests.test_login import LoginTestCase

KEYS = """
[keys.ops]
key = "sk-ops-0123456789"
console_roles = ["operator", "admin"]

[keys.everyone]
key = "sk-all-0123456789"
console_roles = ["viewer", "operator", "admin"]

[keys.batch]
key = "sk-batch-0123456789"
"""
HI = [{"role": "user", "content": "hi"}]


class KeyRoleTests(SynchronousTestCase):
    def test_console_roles(self) -> None:
        """
        A key's console_roles name the roles that may spend it; a key
        without them is never the console's; the operator at the host (no
        role) may spend every console key.
        """
        ring = parse_keys(KEYS, toml=True)
        self.assertEqual(ring.names(), ["batch", "everyone", "ops"])
        self.assertEqual(ring.console_keys("viewer"), ["everyone"])
        self.assertEqual(ring.console_keys("operator"), ["everyone", "ops"])
        self.assertEqual(ring.console_keys(None), ["everyone", "ops"])
        self.assertEqual(ring.console_key("ops", "admin"), "sk-ops-0123456789")
        self.assertIsNone(ring.console_key("ops", "viewer"))
        self.assertIsNone(ring.console_key("batch", None))
        self.assertEqual(ring.authenticate(b"Bearer sk-ops-0123456789"), "ops")

    def test_bad_roles(self) -> None:
        """
        console_roles that is not a list of console roles is refused, naming
        the key and the field.
        """
        for bad in ('"admin"', '["root"]', "[1]"):
            with self.assertRaises(KeysError) as caught:
                parse_keys(f'[keys.k]\nkey = "sk-0123456789"\nconsole_roles = {bad}\n', toml=True)
            self.assertIn("key 'k': console_roles must be a list of console roles", str(caught.exception))


class ParseTests(SynchronousTestCase):
    def test_chat_sent(self) -> None:
        """
        The gateway is asked for a streamed answer with usage; the limits
        given are passed; anything else is a 400 naming it.
        """
        chat = parse_chat({"model": "demo", "messages": HI, "max_tokens": 16, "temperature": 0.5, "key": "k"})
        self.assertEqual(chat, {"model": "demo", "messages": HI, "stream": True,
                                "stream_options": {"include_usage": True}, "max_tokens": 16, "temperature": 0.5})
        from llmgw.control.admin.base import Refused

        for body, word in (({"model": "demo", "messages": HI, "n": 2}, "unknown"),
                           ({"messages": HI}, "model"),
                           ({"model": "demo", "messages": []}, "messages"),
                           ({"model": "demo", "messages": [{"role": "tool", "content": "x"}]}, "each message"),
                           ({"model": "demo", "messages": HI, "max_tokens": 0}, "max_tokens"),
                           ({"model": "demo", "messages": HI, "temperature": float("nan")}, "temperature")):
            with self.assertRaises(Refused) as caught:
                parse_chat(body)
            self.assertIn(word, caught.exception.reason)


class FakeBody:
    """The gateway response's body as a push producer, recording calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pauseProducing(self) -> None:  # noqa: N802
        self.calls.append("pause")

    def resumeProducing(self) -> None:  # noqa: N802
        self.calls.append("resume")

    def stopProducing(self) -> None:  # noqa: N802
        self.calls.append("stop")


class FakeRequest:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.producer: Any = None
        self.finished = False

    def registerProducer(self, producer: Any, streaming: bool) -> None:  # noqa: N802
        self.producer = producer

    def unregisterProducer(self) -> None:  # noqa: N802
        self.producer = None

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def finish(self) -> None:
        self.finished = True


class RelayTests(SynchronousTestCase):
    def test_backpressure(self) -> None:
        """
        The relay registers itself on the browser's request as a streaming
        producer; the browser's connection pausing and resuming it pauses
        and resumes reading the gateway's answer; the answer's end
        finishes the request.
        """
        request, body = FakeRequest(), FakeBody()
        relay = Relay(request)
        relay.makeConnection(body)  # type: ignore[arg-type]
        self.assertIs(request.producer, relay)
        relay.dataReceived(b"data: 1\n\n")
        request.producer.pauseProducing()
        request.producer.resumeProducing()
        self.assertEqual(body.calls, ["pause", "resume"])
        relay.connectionLost(None)  # type: ignore[arg-type]
        self.assertEqual((request.written, request.finished, request.producer), ([b"data: 1\n\n"], True, None))

    def test_client_gone(self) -> None:
        """
        When the browser goes, reading the gateway's answer stops, and what
        still comes is not written.
        """
        request, body = FakeRequest(), FakeBody()
        relay = Relay(request)
        relay.makeConnection(body)  # type: ignore[arg-type]
        relay.client_gone()
        relay.dataReceived(b"late")
        relay.connectionLost(None)  # type: ignore[arg-type]
        self.assertEqual((body.calls, request.written, request.finished), (["stop"], [], False))


class ViewerTests(LoginTestCase):
    def test_viewer_may_chat_with_its_keys(self) -> None:
        """
        A viewer may post a playground chat (its role is judged by the keys
        it may spend, not refused as a write); without a gateway the answer
        is a 409 that says so. A viewer's role is the one its keys are
        looked up for.
        """
        cookie, csrf = self.login("vera")
        d = self.treq.request("POST", "http://127.0.0.1:7480/api/v1/playground/chat",
                              headers={"Content-Type": ["application/json"], "Cookie": [f"llmgw_session={cookie}"],
                                       "X-CSRF-Token": [csrf]},
                              data=json.dumps({"model": "demo", "messages": HI}).encode())
        self.treq.flush()
        response = self.successResultOf(d)
        body = json.loads(self.successResultOf(self.treq.content(response)))
        self.assertEqual(response.code, 409, body)
        self.assertIn("no gateway", body["error"])
        code, _, _ = self.call("POST", "/api/v1/nodes/gpu-1/cordon", {}, cookie=cookie, csrf=csrf)
        self.assertEqual(code, 403)

    def test_role_of(self) -> None:
        """
        The role keys are looked up for: a session's; none on a loopback
        API without TLS.
        """

        class Session:
            role = "viewer"

        class Request:
            llmgw_session = Session()

        self.assertEqual(console_role(self.resource, Request()), "viewer")

        class Root:
            require_certificate = False

        self.assertIsNone(console_role(Root(), object()))


class GatewayService:
    """What the playground reads of the embedded gateway's service."""

    def __init__(self, harness: Harness):
        self.gateway = harness.gateway
        self.reactor = reactor

        class Listener:
            port = harness.port

        self.listener = Listener()


class Control:
    def __init__(self, gateway: Any):
        self.gateway = gateway


class ChatTests(TestCase):
    """
    The admin API on loopback in front of a real gateway and fake model
    server.
    """

    timeout = 20

    def setUp(self) -> None:
        self.harness = Harness(self, keys=parse_keys(KEYS, toml=True))
        self.harness.fakemodel("demo-r1", model="demo")
        site = admin_site(sample_fleet(), make_registry(), control=Control(GatewayService(self.harness)))
        site.resource.log = Logger(observer=lambda e: None)  # type: ignore[attr-defined]
        self.port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.url = f"http://127.0.0.1:{self.port.getHost().port}/api/v1/playground"
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    def post(self, body: dict[str, Any]) -> Any:
        return treq.post(self.url + "/chat", data=json.dumps(body).encode(), pool=self.pool,
                         headers={"Content-Type": ["application/json"]})

    @inlineCallbacks
    def test_streamed_with_replica(self) -> Any:
        """
        A chat with a console key is answered by the gateway as an event
        stream, relayed with the replica that answered; the gateway counted
        it under the key.
        """
        response = yield treq.get(self.url, pool=self.pool)
        keys = yield response.json()
        self.assertEqual(keys, {"gateway": True, "keys_required": True, "keys": ["everyone", "ops"]})
        response = yield self.post({"model": "demo", "messages": HI, "key": "ops", "max_tokens": 8})
        text = yield response.text()
        self.assertEqual(response.code, 200, text)
        self.assertTrue(response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/event-stream"))
        self.assertEqual(response.headers.getRawHeaders(REPLICA_HEADER), [b"demo-r1"])
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertTrue(any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks), chunks)
        self.assertTrue(any(c.get("usage") for c in chunks), chunks)

    @inlineCallbacks
    def test_key_not_for_the_console(self) -> Any:
        """
        A key with no console_roles, or none at all, is a 403 that lists
        the keys this requester may spend.
        """
        for key in ("batch", None):
            response = yield self.post({"model": "demo", "messages": HI, **({"key": key} if key else {})})
            body = yield response.json()
            self.assertEqual(response.code, 403, body)
            self.assertIn("yours: everyone, ops", body["error"])

    @inlineCallbacks
    def test_gateway_refusal_passed_on(self) -> Any:
        """
        What the gateway refuses (an unknown model) comes back with its own
        status and body.
        """
        response = yield self.post({"model": "nope", "messages": HI, "key": "everyone"})
        body = yield response.json()
        self.assertEqual(response.code, 404, body)
        self.assertIn("nope", body["error"]["message"])


class ReplicaHeaderTests(TestCase):
    timeout = 10

    @inlineCallbacks
    def test_gateway_names_the_replica(self) -> Any:
        """
        The gateway's answer names the replica that answered in
        x-llmgw-replica, for a whole answer and for a stream.
        """
        h = Harness(self)
        h.fakemodel("r-7", model="demo")
        for extra in ({}, {"stream": True}):
            response = yield h.chat(extra=extra)
            yield response.content()
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(REPLICA_HEADER), [b"r-7"])


class LocalOptionTests(SynchronousTestCase):
    def test_local_api_keys(self) -> None:
        """
        C{llmgw local --api-keys FILE} gives the local fleet's gateway that
        keys file, console roles and all; without it the gateway needs none.
        """
        from pathlib import Path

        from llmgw.local import Options

        root = Path(self.mktemp())
        root.mkdir()
        keys = root / "keys.toml"
        keys.write_text(KEYS)
        keys.chmod(0o600)
        base = ["--certs", str(root / "certs"), "--state-dir", str(root / "state")]
        o = Options()
        o.parseOptions([*base, "--api-keys", str(keys)])
        self.assertEqual(o["control"]["keyring"].console_keys("viewer"), ["everyone"])
        o = Options()
        o.parseOptions(base)
        self.assertIsNone(o["control"]["keyring"])
