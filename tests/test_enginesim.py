"""
The engine simulator test tool (llmgw.testing.enginesim) and the fake model
server's --engine-sim mode, on a Clock.
"""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.testing.enginesim import CannotFit, EngineSim, EngineSimConfig
from llmgw.testing.fakemodel import FakeModelConfig, main, make_resource
from tests.test_fakemodel import parse_sse


def parse_metrics_text(text: str) -> dict[str, float]:
    """
    Sample values by metric name (labels dropped).
    """
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


CONFIG = EngineSimConfig(
    kv_blocks=20, block_tokens=4, max_running=8, step_s=0.01, step_per_seq_s=0.001, prefill_s_per_token=0.01
)


class Recorder:
    """
    When each token of one simulated request came out.
    """

    def __init__(self, clock: Clock):
        self.clock = clock
        self.times: list[float] = []
        self.finished: float | None = None

    def token(self, n: int) -> None:
        assert n == len(self.times) + 1
        self.times.append(self.clock.seconds())

    def done(self) -> None:
        self.finished = self.clock.seconds()


def words(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def run(clock: Clock, seconds: float = 10.0, step: float = 0.001) -> None:
    for _ in range(int(seconds / step)):
        clock.advance(step)


class EngineSimTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()

    def submit(self, sim: EngineSim, tokens: list[str], max_tokens: int) -> tuple[Recorder, Any]:
        rec = Recorder(self.clock)
        return rec, sim.submit(tokens, max_tokens, rec.token, rec.done)

    def test_prefix_cache_cuts_prefill(self) -> None:
        """
        A second request with the same leading full blocks gets them from
        the cache: its first token comes sooner by their prefill time, and
        the counters count its hit tokens.
        """
        sim = EngineSim(self.clock, CONFIG)
        first, req1 = self.submit(sim, words(12), 2)
        run(self.clock, 1)
        second, req2 = self.submit(sim, words(12) + ["new"], 2)
        start = self.clock.seconds()
        run(self.clock, 1)
        self.assertEqual(req1.cached_tokens, 0)
        self.assertEqual(req2.cached_tokens, 12)
        self.assertAlmostEqual(first.times[0], 0.01 + 0.001 + 12 * 0.01, places=2)
        self.assertAlmostEqual(second.times[0] - start, 0.01 + 0.001 + 1 * 0.01, places=2)
        self.assertEqual((sim.queries, sim.hits), (25, 12))

    def test_decode_slows_with_batch(self) -> None:
        """
        A decode step takes longer the more requests run in it.
        """
        config = EngineSimConfig(kv_blocks=100, block_tokens=4, step_s=0.01, step_per_seq_s=0.005, prefill_s_per_token=0)
        alone_sim = EngineSim(self.clock, config)
        alone, _ = self.submit(alone_sim, words(4), 5)
        run(self.clock, 1)
        crowd_sim = EngineSim(self.clock, config)
        crowd = [self.submit(crowd_sim, words(4, f"p{i}"), 5)[0] for i in range(8)]
        run(self.clock, 1)
        gap_alone = alone.times[-1] - alone.times[-2]
        gap_crowd = crowd[0].times[-1] - crowd[0].times[-2]
        self.assertApproximates(gap_alone, 0.015, 0.0015)
        self.assertApproximates(gap_crowd, 0.05, 0.0015)

    def test_queues_when_kv_full(self) -> None:
        """
        A request that does not fit in the free KV blocks waits (counted as
        waiting) until a running one ends and frees its blocks.
        """
        sim = EngineSim(self.clock, CONFIG)
        big, _ = self.submit(sim, words(40, "a"), 20)  # 15 blocks
        queued, _ = self.submit(sim, words(16, "b"), 8)  # 6 blocks: does not fit beside it
        self.clock.advance(0)
        text = sim.metrics_text("m")
        figures = parse_metrics_text(text)
        self.assertEqual(figures["vllm:num_requests_waiting"], 1.0)
        self.assertEqual(figures["vllm:num_requests_running"], 1.0)
        self.assertAlmostEqual(figures["vllm:kv_cache_usage_perc"], 15 / 20)
        run(self.clock, 5)
        assert big.finished is not None and queued.finished is not None
        self.assertGreater(queued.times[0], big.finished)

    def test_lru_eviction(self) -> None:
        """
        Blocks no request holds stay cached until their space is needed;
        then the least recently used go first.
        """
        config = EngineSimConfig(kv_blocks=10, block_tokens=4, prefill_s_per_token=0)
        sim = EngineSim(self.clock, config)
        self.submit(sim, words(16, "a"), 1)  # 4 shared blocks + 1 private
        run(self.clock, 0.1)
        self.submit(sim, words(16, "b"), 1)
        run(self.clock, 0.1)
        _, c = self.submit(sim, words(16, "c"), 1)  # needs 5: evicts a's blocks, not b's
        run(self.clock, 0.1)
        _, b = self.submit(sim, words(16, "b"), 1)
        run(self.clock, 0.1)
        _, a = self.submit(sim, words(16, "a"), 1)
        run(self.clock, 0.1)
        self.assertEqual((c.cached_tokens, b.cached_tokens, a.cached_tokens), (0, 16, 0))

    def test_cancel_frees(self) -> None:
        """
        A cancelled request leaves the batch (or the queue) and frees its
        blocks; it gets no more tokens.
        """
        sim = EngineSim(self.clock, CONFIG)
        rec, req = self.submit(sim, words(8), 50)
        run(self.clock, 0.5)
        self.assertGreater(sim.used_blocks(), 0)
        got = len(rec.times)
        sim.cancel(req)
        self.assertEqual((len(sim.running), sim.used_blocks()), (0, 0))
        run(self.clock, 0.5)
        self.assertEqual(len(rec.times), got)
        self.assertIsNone(rec.finished)

    def test_hang(self) -> None:
        """
        A hung engine gives no request another token while its metrics go
        on saying they run, and its generated-token counter stays flat; the
        counter counted every token before.
        """
        sim = EngineSim(self.clock, CONFIG)
        rec, _ = self.submit(sim, words(8), 50)
        run(self.clock, 0.5)
        got = len(rec.times)
        self.assertGreater(got, 0)
        before = parse_metrics_text(sim.metrics_text("m"))
        self.assertEqual(before["vllm:generation_tokens_total"], float(got))
        sim.hang()
        self.submit(sim, words(8), 50)
        run(self.clock, 5.0)
        self.assertEqual(len(rec.times), got)
        after = parse_metrics_text(sim.metrics_text("m"))
        self.assertEqual(after["vllm:generation_tokens_total"], float(got))
        self.assertEqual((after["vllm:num_requests_running"], after["vllm:num_requests_waiting"]),
                         (1.0, 1.0))
        self.assertIsNone(rec.finished)

    def test_cannot_fit(self) -> None:
        """
        A request that needs more blocks than the whole cache is refused at
        once with the numbers.
        """
        sim = EngineSim(self.clock, CONFIG)
        e = self.assertRaises(CannotFit, sim.submit, words(100), 10, lambda n: None, lambda: None)
        self.assertIn("28 KV blocks", str(e))


class FakeModelSimTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.stub = StubTreq(
            make_resource(FakeModelConfig(model="m", metrics="vllm", engine_sim=CONFIG), self.clock)
        )

    def post(self, body: dict[str, Any]) -> Any:
        d = self.stub.post(
            "http://sim.test/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={b"content-type": [b"application/json"]},
        )
        for _ in range(3000):
            self.clock.advance(0.001)
            self.stub.flush()
        response = self.successResultOf(d)
        return response, self.successResultOf(response.content())

    def test_stream_and_usage(self) -> None:
        """
        With the simulator, a streamed chat gets max_tokens token chunks and
        a usage chunk whose cached tokens grow on a repeat of the prompt;
        /metrics counts the prefix-cache queries and hits.
        """
        messages = [{"role": "system", "content": " ".join(words(20))}, {"role": "user", "content": "hi"}]
        body = {"model": "m", "messages": messages, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        _, raw1 = self.post(body)
        _, raw2 = self.post(body)
        events1, events2 = parse_sse(raw1), parse_sse(raw2)
        self.assertEqual(events2[-1], "[DONE]")
        content = [e["choices"][0]["delta"].get("content") for e in events2[1:-3]]
        self.assertEqual(len(content), 3)
        self.assertEqual(events1[-2]["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
        self.assertEqual(events2[-2]["usage"]["prompt_tokens_details"]["cached_tokens"], 20)
        response = self.successResultOf(self.stub.get("http://sim.test/metrics"))
        figures = parse_metrics_text(self.successResultOf(response.text()))
        self.assertEqual(figures["vllm:prefix_cache_hits_total"], 20.0)
        self.assertEqual(figures["vllm:prefix_cache_queries_total"], 46.0)  # 23 tokens twice

    def test_whole_reply(self) -> None:
        """
        Without streaming, the simulated reply is one document with usage.
        """
        response, raw = self.post({"model": "m", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4})
        doc = json.loads(raw)
        self.assertEqual(response.code, 200)
        self.assertEqual(doc["usage"]["completion_tokens"], 4)
        self.assertEqual(doc["usage"]["prompt_tokens"], 4)

    def test_too_long(self) -> None:
        """
        A prompt that can never fit is a 400 that says why.
        """
        response, raw = self.post({"model": "m", "messages": [{"role": "user", "content": "x " * 200}]})
        self.assertEqual(response.code, 400)
        self.assertIn("KV blocks", json.loads(raw)["error"]["message"])

    def test_cli_checks_parameters(self) -> None:
        """
        Bad simulator parameters on the command line exit 2.
        """
        self.assertEqual(main(["--port", "1", "--engine-sim", "--kv-blocks", "0"]), 2)
