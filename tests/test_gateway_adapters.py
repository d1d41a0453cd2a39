"""
The gateway's routing of requests for LoRA adapters
(L{llmgw.gateway.adapters}): only to replicas of the base that hold the
adapter, by the base's policy; llama.cpp's "lora" field written for the
adapter and for the base; adapters listed in C{/v1/models}; usage counted
per adapter.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.adapters import AdapterRouting, choose_routes, lora_field, with_member
from llmgw.gateway.resource import listed_models
from llmgw.routing import Route, RoutingSnapshot, RoutingTable
from tests.test_gateway_resource import Front, error_of, post


def cpp(rid: str, adapters: tuple[str, ...], draining: bool = False) -> Route:
    return Route(rid, "tiny", f"10.0.0.{rid[-1]}:80", draining=draining, adapters=adapters, lora_ids=True)


def vllm(rid: str, adapters: tuple[str, ...]) -> Route:
    return Route(rid, "big", f"10.0.1.{rid[-1]}:80", adapters=adapters)


ADAPTERS = {"sql": "tiny", "chat": "tiny", "x": "big", "y": "big"}


class ChoiceTests(SynchronousTestCase):
    def test_lora_field(self) -> None:
        """
        The "lora" member lists every id of the replica's adapters: scale 1
        for the one asked for, 0 for the others (all 0 for the base).
        """
        self.assertEqual(json.loads(b"{" + lora_field(("a", "b"), "b") + b"}"),
                         {"lora": [{"id": 0, "scale": 0}, {"id": 1, "scale": 1}]})
        self.assertEqual(json.loads(b"{" + lora_field(("a", "b"), None) + b"}"),
                         {"lora": [{"id": 0, "scale": 0}, {"id": 1, "scale": 0}]})

    def test_with_member(self) -> None:
        """
        The member is added last to a JSON object, whatever whitespace it
        ends with; anything else is refused.
        """
        self.assertEqual(json.loads(with_member(b'{"model": "m"} \n', b'"lora":[]')), {"model": "m", "lora": []})
        self.assertEqual(json.loads(with_member(b"{ }", b'"a":1')), {"a": 1})
        self.assertRaises(ValueError, with_member, b"[1]", b'"a":1')

    def test_holders_only(self) -> None:
        """
        A request for an adapter may go only to replicas that hold it.
        """
        routes = (vllm("r1", ("x",)), vllm("r2", ("x", "y")), vllm("r3", ()))
        self.assertEqual([r.replica_id for r in choose_routes(routes, "y")[0]], ["r2"])
        self.assertEqual([r.replica_id for r in choose_routes(routes, "x")[0]], ["r1", "r2"])
        self.assertEqual(choose_routes(routes, "x")[1], b"")
        self.assertEqual(choose_routes(routes, "z")[0], ())

    def test_one_layout_during_a_replace(self) -> None:
        """
        llama.cpp replicas select adapters by position: a request's
        candidates share the list most (not draining) replicas hold, ties
        to the longer, so that ids mean one adapter.
        """
        routes = (cpp("r1", ("sql",)), cpp("r2", ("chat", "sql")), cpp("r3", ("chat", "sql")))
        chosen, member = choose_routes(routes, "sql")
        self.assertEqual([r.replica_id for r in chosen], ["r2", "r3"])
        self.assertIn(b'{"id":1,"scale":1}', member)
        tie = (cpp("r1", ("sql",)), cpp("r2", ("chat", "sql")))
        self.assertEqual([r.replica_id for r in choose_routes(tie, None)[0]], ["r2"])
        drained = (cpp("r1", ("sql",)), cpp("r2", ("chat", "sql"), draining=True), cpp("r3", ("chat", "sql"),
                                                                                        draining=True))
        self.assertEqual([r.replica_id for r in choose_routes(drained, "sql")[0]], ["r1"])
        self.assertEqual(choose_routes((cpp("r1", ()),), None), ((cpp("r1", ()),), b""))

    def test_choice_kept_while_routes_stay(self) -> None:
        """
        The choice is worked out again only when the base's routes change;
        a model that is no adapter, on replicas that select none by
        position, is left alone.
        """
        choices = AdapterRouting()
        routes = (vllm("r1", ("x",)),)
        first = choices.resolve(ADAPTERS, lambda base: routes, "x", ())
        again = choices.resolve(ADAPTERS, lambda base: routes, "x", ())
        assert first is not None and again is not None
        self.assertIs(again[0], first[0])
        other = (vllm("r2", ("x",)),)
        self.assertEqual(choices.resolve(ADAPTERS, lambda base: other, "x", ())[0], other)  # type: ignore[index]
        self.assertIsNone(choices.resolve(ADAPTERS, lambda base: routes, "big", routes))
        self.assertIsNone(choices.resolve(ADAPTERS, lambda base: (), "nothing", ()))

    def test_models_listed_beside_their_base(self) -> None:
        """
        C{/v1/models} lists each adapter after its base, with the base as
        its parent; adapters of a base with no ready replica are left out.
        """
        listed = listed_models(["big", "tiny"], {"x": "big", "sql": "tiny", "gone": "none"})
        self.assertEqual([(e["id"], e.get("parent")) for e in listed],
                         [("big", None), ("x", "big"), ("tiny", None), ("sql", "tiny")])


class GatewayTests(SynchronousTestCase):
    def front(self, routes: list[Route]) -> Front:
        known = sorted({r.model for r in routes} | {"tiny", "big"})
        return Front(table=RoutingSnapshot(routes, known, 1, adapters=ADAPTERS))

    def forwarded(self, front: Front, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        front.send(post(json.dumps(body).encode()))
        host, port, *_ = front.clock.tcpClients[-1]
        _, transport = front.upstream()
        sent = transport.value()
        return f"{host}:{port}", json.loads(sent.partition(b"\r\n\r\n")[2])

    def test_adapter_goes_to_a_holder_with_its_lora(self) -> None:
        """
        A request for a llama.cpp adapter goes to a replica holding it,
        with the "lora" field selecting it; a request for the base carries
        scale 0 for every adapter.
        """
        front = self.front([cpp("r1", ("chat", "sql")), Route("r9", "other", "10.0.9.9:80")])
        address, body = self.forwarded(front, {"model": "sql", "messages": []})
        self.assertEqual(address, "10.0.0.1:80")
        self.assertEqual(body["lora"], [{"id": 0, "scale": 0}, {"id": 1, "scale": 1}])
        self.assertEqual(body["model"], "sql")
        _, body = self.forwarded(front, {"model": "tiny", "messages": []})
        self.assertEqual(body["lora"], [{"id": 0, "scale": 0}, {"id": 1, "scale": 0}])

    def test_vllm_adapter_goes_as_written(self) -> None:
        """
        A request for a vLLM adapter goes, unchanged, only to a replica
        that holds it (vLLM serves it under its name).
        """
        front = self.front([vllm("r1", ()), vllm("r2", ("x",)), vllm("r3", ())])
        for _ in range(3):
            address, body = self.forwarded(front, {"model": "x", "prompt": "hi"})
            self.assertEqual(address, "10.0.1.2:80")
            self.assertEqual(body, {"model": "x", "prompt": "hi"})

    def test_client_lora_refused(self) -> None:
        """
        A client may not choose llama.cpp adapters itself: its "lora" field
        is refused with 400, naming the field.
        """
        front = self.front([cpp("r1", ("sql",))])
        status, _, body = front.answer(post(json.dumps({"model": "tiny", "lora": []}).encode()))
        self.assertEqual(status, 400)
        self.assertEqual(error_of(body)["code"], "invalid_lora")
        self.assertEqual(front.clock.tcpClients, [])

    def test_adapter_with_no_holder_waits(self) -> None:
        """
        An adapter no replica holds is known (not 404): the request waits
        in the adapter's own admission queue, then gets 503.
        """
        front = self.front([vllm("r1", ())])
        t = front.send(post(json.dumps({"model": "y", "prompt": "hi"}).encode()))
        self.assertEqual(t.value(), b"")
        self.assertEqual(front.gateway.admission.waiting("y"), 1)
        front.clock.advance(front.gateway.config.queue_timeout_s + 1)
        self.assertIn(b" 503 ", t.value().split(b"\r\n")[0] + b" ")
        status, _, body = front.answer(post(json.dumps({"model": "nothing"}).encode()))
        self.assertEqual(status, 404)

    def test_models_endpoint_lists_adapters(self) -> None:
        """
        C{GET /v1/models} lists adapters beside their base, and
        C{/v1/models/ADAPTER} answers for one.
        """
        front = self.front([cpp("r1", ("sql",))])
        raw = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n"
        status, _, body = front.answer(raw)
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["tiny", "chat", "sql"])
        status, _, body = front.answer(raw.replace(b"/v1/models", b"/v1/models/sql"))
        self.assertEqual((status, json.loads(body)["parent"]), (200, "tiny"))

    def test_usage_counted_per_adapter(self) -> None:
        """
        The gateway's request metrics name the adapter as the model.
        """
        front = self.front([vllm("r1", ("x",))])
        self.forwarded(front, {"model": "x", "prompt": "hi"})
        self.assertIn(b'model="x"', front.metrics())

    def test_waiting_request_goes_once_loaded(self) -> None:
        """
        A request waiting for an adapter no replica held goes, to the new
        holder, as soon as the routing table shows it loaded.
        """
        table = RoutingTable(Clock())
        table.adapter_source = lambda: ADAPTERS
        table.set_known(["big"])
        table.publish([vllm("r1", ()), vllm("r2", ())], ["big"])
        front = Front(table=table)
        front.send(post(json.dumps({"model": "x", "prompt": "hi"}).encode()))
        self.assertEqual(front.gateway.admission.waiting("x"), 1)
        self.assertEqual(front.clock.tcpClients, [])
        table.publish([vllm("r1", ()), vllm("r2", ("x",))], ["big"])
        front.drain()
        self.assertEqual(front.gateway.admission.waiting("x"), 0)
        host, port, *_ = front.clock.tcpClients[-1]
        self.assertEqual(f"{host}:{port}", "10.0.1.2:80")


    def test_waiting_request_takes_the_layout_it_goes_to(self) -> None:
        """
        A request for a llama.cpp adapter that waited gets the "lora" field
        of the replicas it is finally sent to, not of those of its arrival.
        """
        table = RoutingTable(Clock())
        table.adapter_source = lambda: ADAPTERS
        table.set_known(["tiny"])
        table.publish([Route("r1", "tiny", "10.0.0.1:80", adapters=("sql",), lora_ids=True, draining=True)],
                      ["tiny"])
        front = Front(table=table)
        front.send(post(json.dumps({"model": "sql", "messages": []}).encode()))
        self.assertEqual(front.gateway.admission.waiting("sql"), 1)
        table.publish([cpp("r2", ("chat", "sql"))], ["tiny"])
        front.drain()
        _, transport = front.upstream()
        body = json.loads(transport.value().partition(b"\r\n\r\n")[2])
        self.assertEqual(body["lora"], [{"id": 0, "scale": 0}, {"id": 1, "scale": 1}])

class FollowerTests(SynchronousTestCase):
    def test_watch_keeps_adapters(self) -> None:
        """
        A standalone gateway's table takes the adapter -> base map from a
        watch snapshot, keeps it across a routes message (which names
        models only), and takes the held adapters of the routes it brings.
        """
        from llmgw.gateway.follower import FollowerTable

        table = FollowerTable(Clock(), "http://cp:7480/", http=object())
        table.apply_watch({"type": "snapshot", "epoch": "e1", "revision": 5, "routes": {
            "revision": 5, "known": ["big"], "adapters": {"x": "big"}, "routes": [
                {"replica": "r1", "model": "big", "address": "10.0.1.1:80"}]}})
        self.assertEqual(table.adapters, {"x": "big"})
        table.apply_watch({"type": "routes", "revision": 6, "routes_revision": 6, "models": {"big": [
            {"replica": "r1", "model": "big", "address": "10.0.1.1:80", "adapters": ["x"]}]}})
        self.assertEqual(table.adapters, {"x": "big"})
        self.assertEqual(table.routes("big")[0].adapters, ("x",))
