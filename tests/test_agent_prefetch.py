"""
Tests for L{llmgw.agent.prefetch}: the cache report in Register and
heartbeats, the PrefetchModel/DropModel handler, and how the control
plane's stream reads those fields (an older agent's Register without them
still registers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.prefetch import REPORT_EVERY, CacheReport, Prefetcher
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentstream import cached_copies, peer_address_problem
from llmgw.ctl.models import render_models
from llmgw.models.cache import CachedModel
from llmgw.models.index import EntryState
from llmgw.models.source import cache_key, parse_source
from llmgw.shards import source_message
from llmgw.sourcespec import parse_source as parse_spec


@dataclass
class FakeCache:
    """
    The parts of a ModelCache the report and the handler use.
    """

    capacity: int = 1000
    held: list[CachedModel] = field(default_factory=list)
    pins: dict[str, set[str]] = field(default_factory=dict)
    ensured: list[Any] = field(default_factory=list)
    peers: list[tuple[str, ...]] = field(default_factory=list)

    def models(self) -> list[CachedModel]:
        return list(self.held)

    def used(self) -> int:
        return sum(m.size for m in self.held)

    def pin(self, key: str, user: str) -> None:
        self.pins.setdefault(key, set()).add(user)

    def unpin(self, key: str, user: str) -> None:
        self.pins.get(key, set()).discard(user)

    def ensure(self, source: Any, progress: Any = None, peers: Any = ()) -> Deferred[Any]:
        self.ensured.append(source)
        self.peers.append(tuple(peers))
        return Deferred()


def held(key: str = "k1", size: int = 100) -> CachedModel:
    return CachedModel(key=key, source="hf://org/m@v1", state=EntryState.COMPLETE, size=size,
                       last_used=5.0, pinned_by=frozenset(), progress=None)


class CacheReportTests(SynchronousTestCase):
    def test_register_carries_cache(self) -> None:
        """
        A Register lists every cached model and the room, and keeps the
        peer address it was given; it survives the wire and reads back as
        the inventory keeps it.
        """
        cache = FakeCache(held=[held()])
        report = CacheReport(cache)  # type: ignore[arg-type]
        reg = pb.Register(node_id="n", peer_address="10.0.0.1:7000")
        report.fill_register(reg)
        again = pb.Register.FromString(reg.SerializeToString())
        self.assertEqual((again.peer_address, again.cache_capacity, again.cache_free),
                         ("10.0.0.1:7000", 1000, 900))
        [c] = cached_copies(again.cached_models)
        self.assertEqual((c.key, c.size, c.state, c.revision), ("k1", 100, "complete", "v1"))

    def test_heartbeat_only_when_changed_or_now_and_then(self) -> None:
        """
        Heartbeats carry the cache only when it changed since the last
        report (an empty cache included, flagged) or every REPORT_EVERY.
        """
        cache = FakeCache(held=[held()])
        report = CacheReport(cache)  # type: ignore[arg-type]
        report.fill_register(pb.Register())
        hb = pb.Heartbeat()
        report.fill_heartbeat(hb)
        self.assertFalse(hb.cache_changed)
        cache.held = []
        hb = pb.Heartbeat()
        report.fill_heartbeat(hb)
        self.assertTrue(hb.cache_changed)
        self.assertEqual(list(hb.cached_models), [])
        flags = []
        for _ in range(REPORT_EVERY):
            hb = pb.Heartbeat()
            report.fill_heartbeat(hb)
            flags.append(hb.cache_changed)
        self.assertEqual(flags, [False] * (REPORT_EVERY - 1) + [True])

    def test_room_only_when_changed_or_with_the_cache(self) -> None:
        """
        A heartbeat carries the cache's room (capacity, free) when it
        changed since it was last sent, and with every cache report; a
        cache that stands still adds nothing to a heartbeat.
        """
        cache = FakeCache(held=[held()])
        report = CacheReport(cache)  # type: ignore[arg-type]
        report.fill_register(pb.Register())
        hb = pb.Heartbeat()
        report.fill_heartbeat(hb)
        self.assertEqual(hb.SerializeToString(), b"")
        cache.capacity = 2000
        hb = pb.Heartbeat()
        report.fill_heartbeat(hb)
        self.assertEqual((hb.cache_changed, hb.cache_capacity, hb.cache_free), (False, 2000, 1900))
        for _ in range(REPORT_EVERY - 3):  # the register, two heartbeats, these, then a report
            hb = pb.Heartbeat()
            report.fill_heartbeat(hb)
            self.assertEqual(hb.SerializeToString(), b"")
        hb = pb.Heartbeat()
        report.fill_heartbeat(hb)
        self.assertEqual((hb.cache_changed, hb.cache_capacity, hb.cache_free), (True, 2000, 1900))

    def test_no_cache_no_fields(self) -> None:
        """
        An agent without a cache sends none of the fields: it reads as an
        older agent does.
        """
        report = CacheReport(None)
        reg, hb = pb.Register(), pb.Heartbeat()
        report.fill_register(reg)
        report.fill_heartbeat(hb)
        self.assertEqual((reg.SerializeToString(), hb.SerializeToString()), (b"", b""))

    def test_peer_address_checked(self) -> None:
        """
        A peer address must be HOST:PORT; empty is fine.
        """
        self.assertIsNone(peer_address_problem(""))
        self.assertIsNone(peer_address_problem("[::1]:7000"))
        self.assertIsNotNone(peer_address_problem("host"))
        self.assertIsNotNone(peer_address_problem("host:99999"))


class PrefetcherTests(SynchronousTestCase):
    def test_prefetch_pins_and_ensures_drop_unpins(self) -> None:
        """
        A PrefetchModel pins the model's key under its pin and ensures the
        source; a DropModel takes the pin away.
        """
        cache = FakeCache()
        spec = parse_spec("hf://org/m@v1")
        key = cache_key(parse_source("hf://org/m@v1"))
        p = Prefetcher(cache)  # type: ignore[arg-type]
        p.prefetch(pb.PrefetchModel(source=source_message(spec), pin="prefetch:m",
                                    model_peers=["10.0.0.2:7000"]))
        self.assertEqual(cache.pins, {key: {"prefetch:m"}})
        self.assertEqual([str(s) for s in cache.ensured], ["hf://org/m@v1"])
        self.assertEqual(cache.peers, [("10.0.0.2:7000",)])
        p.drop(pb.DropModel(key=key, pin="prefetch:m"))
        self.assertEqual(cache.pins, {key: set()})

    def test_pull_is_not_pinned(self) -> None:
        """
        A PrefetchModel without a pin (an operator's pull) fetches without
        pinning.
        """
        cache = FakeCache()
        Prefetcher(cache).prefetch(  # type: ignore[arg-type]
            pb.PrefetchModel(source=source_message(parse_spec("hf://org/m@v1"))))
        self.assertEqual((cache.pins, len(cache.ensured)), ({}, 1))


class RenderTests(SynchronousTestCase):
    def test_models_table(self) -> None:
        """
        One row per model and node, named by its deployments, sizes in
        binary units, last use as an age; a model no node holds shows once.
        """
        text = render_models({"models": [
            {"key": "k", "source": "hf://o/m@v1", "size": 2 << 30, "deployments": ["m"],
             "nodes": [{"node": "a", "size": 2 << 30, "state": "complete", "last_used": 40.0}]},
            {"key": "k2", "source": "hf://o/n@v1", "size": None, "deployments": [], "nodes": []},
        ]}, now=100.0)
        lines = text.splitlines()
        self.assertEqual(lines[0].split(), ["MODEL", "SOURCE", "NODE", "SIZE", "STATE", "LAST", "USED"])
        self.assertEqual(lines[1].split(), ["m", "hf://o/m@v1", "a", "2.0", "GiB", "complete", "60s", "ago"])
        self.assertEqual(lines[2].split()[:3], ["k2", "hf://o/n@v1", "-"])
