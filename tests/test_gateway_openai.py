"""
OpenAI's own Python client against the gateway in front of the project's
fake model server (on loopback; the client in a thread since it blocks).
"""

from __future__ import annotations

from typing import Any

import openai
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import GatewayConfig
from tests.gateway_helpers import Harness

KEY = "sk-openai-client-test"


class OpenAIClientTests(TestCase):
    timeout = 20

    def setUp(self) -> None:
        # A short admission queue deadline: a model without a replica
        # answers 503 soon (the gateway's real clock runs).
        self.h = Harness(self, GatewayConfig(queue_timeout_s=0.2), keys=KeyRing({"tests": KEY}))
        self.h.fakemodel("r1", model="demo", tokens=5)
        self.h.known.add("idle-model")
        self.h.routes_for()
        self.client = openai.OpenAI(base_url=self.h.url + "/v1", api_key=KEY, max_retries=0, timeout=10)
        self.addCleanup(lambda: deferToThread(self.client.close))

    @inlineCallbacks
    def test_chat_completion(self) -> Any:
        """
        A chat completion through the gateway comes back parsed, from the
        replica.
        """
        result = yield deferToThread(
            self.client.chat.completions.create,
            model="demo",
            messages=[{"role": "user", "content": "hello"}],
        )
        self.assertEqual(result.choices[0].message.content, "This is a reply from")
        self.assertEqual(result.model, "demo")
        self.assertEqual(result.choices[0].finish_reason, "stop")

    @inlineCallbacks
    def test_streamed_chat_completion(self) -> Any:
        """
        A streamed chat completion arrives as its chunks, in order, up to
        the end of the stream.
        """
        def run() -> list[str]:
            stream = self.client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            return [c.choices[0].delta.content or "" for c in stream]

        parts = yield deferToThread(run)
        self.assertEqual(parts, ["", "This", " is", " a", " reply", " from", ""])

    @inlineCallbacks
    def test_models_list(self) -> Any:
        """
        The models list holds the models with a ready replica.
        """
        page = yield deferToThread(self.client.models.list)
        self.assertEqual([m.id for m in page.data], ["demo"])

    @inlineCallbacks
    def test_unknown_model(self) -> Any:
        """
        An unknown model raises the client's C{NotFoundError} with the
        gateway's code; a known model without a ready replica raises its
        503 error (C{InternalServerError}) once the admission queue's
        deadline has passed.
        """
        call = self.client.chat.completions.create
        msgs = [{"role": "user", "content": "hi"}]
        e = yield self.assertFailure(deferToThread(call, model="nope", messages=msgs), openai.NotFoundError)
        self.assertEqual(e.status_code, 404)
        self.assertEqual(e.code, "model_not_found")
        e = yield self.assertFailure(deferToThread(call, model="idle-model", messages=msgs), openai.InternalServerError)
        self.assertEqual(e.status_code, 503)
        self.assertEqual(e.code, "queue_timeout")

    @inlineCallbacks
    def test_wrong_key(self) -> Any:
        """
        A wrong API key raises the client's C{AuthenticationError}.
        """
        bad = openai.OpenAI(base_url=self.h.url + "/v1", api_key="sk-not-this-one", max_retries=0)
        self.addCleanup(lambda: deferToThread(bad.close))
        yield self.assertFailure(deferToThread(bad.models.list), openai.AuthenticationError)
