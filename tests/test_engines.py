"""
Engines: the normalisation of vLLM's, SGLang's and llama.cpp's
metrics against samples of their real output (tests/data/metrics-*.txt say
where each came from), and the engine defaults a profile gets.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw import engines
from llmgw.agent.state import ShardSpec
from llmgw.control.core.catalog import CatalogError, parse_catalog, parse_profile

DATA = Path(__file__).parent / "data"


def sample(name: str) -> str:
    return (DATA / f"metrics-{name}.txt").read_text()


def names(engine: str) -> dict[str, str]:
    return engines.metric_names_for(engine)


class NormaliseTests(SynchronousTestCase):
    def test_vllm(self) -> None:
        """
        vLLM's gauges are summed over its engines' label sets, its KV-cache
        fraction is the largest engine's, and its prefix-cache counters are
        read under the _total names prometheus_client exposes.
        """
        s = engines.normalise(sample("vllm"), names("vllm"), sampled_at=5.0)
        self.assertEqual((s.waiting, s.running, s.kv_cache_usage), (4.0, 5.0, 0.42))
        self.assertEqual((s.prefix_cache_queries, s.prefix_cache_hits), (20000.0, 10000.0))
        self.assertEqual(s.sampled_at, 5.0)

    def test_vllm_v0(self) -> None:
        """
        Before v0.10, KV-cache use was vllm:gpu_cache_usage_perc and there
        were no prefix-cache counters: the fraction is read from the old
        name and the counters are None, not zero (a hit-rate gauge is not
        a count).
        """
        s = engines.normalise(sample("vllm-v0"), names("vllm"), sampled_at=0.0)
        self.assertEqual((s.waiting, s.running, s.kv_cache_usage), (2.0, 1.0, 0.0625))
        self.assertIsNone(s.prefix_cache_queries)
        self.assertIsNone(s.prefix_cache_hits)

    def test_sglang(self) -> None:
        """
        SGLang: the queue and running gauges, token_usage as the KV-cache
        fraction (largest rank's), prompt tokens as queries and cached
        tokens (summed over cache sources) as hits, and the generated-token
        counter.
        """
        s = engines.normalise(sample("sglang"), names("sglang"), sampled_at=0.0)
        self.assertEqual((s.waiting, s.running, s.kv_cache_usage), (5.0, 7.0, 0.31))
        self.assertEqual((s.prefix_cache_queries, s.prefix_cache_hits), (8.128902e6, 2.0e6))
        self.assertEqual(s.generated_tokens, 7.557572e6)

    def test_llamacpp_real_output(self) -> None:
        """
        A real llama-server's /metrics: deferred requests wait, processing
        ones run, no KV-cache figure (current builds export none), and the
        prefix-cache queries are uncached plus cached prompt tokens; its
        decode steps are the progress counter (its predicted tokens are
        added only when a request ends, so they would look flat during a
        long generation).
        """
        s = engines.normalise(sample("llamacpp"), names("llamacpp"), sampled_at=0.0)
        self.assertEqual((s.waiting, s.running), (0.0, 0.0))
        self.assertIsNone(s.kv_cache_usage)
        self.assertEqual((s.prefix_cache_queries, s.prefix_cache_hits), (78.0, 38.0))
        self.assertEqual(s.generated_tokens, 8.0)

    def test_llamacpp_progress_is_decode_steps(self) -> None:
        """
        llama.cpp's progress counter is its decode steps, which move while a
        request generates, not its predicted tokens, which it adds only when
        a request ends.
        """
        text = ("llamacpp:requests_processing 1\nllamacpp:tokens_predicted_total 3\n"
                "llamacpp:n_decode_total 50\n")
        s = engines.normalise(text, names("llamacpp"), sampled_at=0.0)
        self.assertEqual((s.running, s.generated_tokens), (1.0, 50.0))

    def test_generic_reads_any_engine(self) -> None:
        """
        A generic profile with a metrics path and no names understands any
        of the three engines' shapes.
        """
        for shape, running in (("vllm", 5.0), ("sglang", 7.0), ("llamacpp", 0.0)):
            s = engines.normalise(sample(shape), names("generic"), sampled_at=0.0)
            self.assertEqual(s.running, running, shape)

    def test_overrides(self) -> None:
        """
        A profile's metric_names win over the engine's: here vLLM's
        running count is read from another metric.
        """
        text = "vllm:num_requests_running 3\nmy_running 9\n"
        s = engines.normalise(text, engines.metric_names_for("vllm", {"running": "my_running"}), 0.0)
        self.assertEqual(s.running, 9.0)

    def test_garbage_is_an_error(self) -> None:
        """
        A response with no Prometheus sample at all (an HTML page, binary
        junk) raises MetricsError; a document that merely lacks our names
        gives None figures.
        """
        self.assertRaises(engines.MetricsError, engines.normalise,
                          "<html>nope</html>\n\x00\x01", names("vllm"), 0.0)
        s = engines.normalise("other_metric 1\n", names("vllm"), 0.0)
        self.assertEqual((s.waiting, s.running), (None, None))

    def test_bad_values_and_labels(self) -> None:
        """
        NaN and infinite values are skipped, label values may hold spaces
        and braces, a timestamp after the value is ignored, and a KV-cache
        fraction over 1 is clamped.
        """
        text = ('vllm:num_requests_waiting{model_name="a b} c"} 2 1700000000000\n'
                "vllm:num_requests_running NaN\n"
                "vllm:kv_cache_usage_perc 1.5\n")
        s = engines.normalise(text, names("vllm"), 0.0)
        self.assertEqual(s.waiting, 2.0)
        self.assertIsNone(s.running)
        self.assertEqual(s.kv_cache_usage, 1.0)


class ProfileDefaultsTests(SynchronousTestCase):
    def test_engine_defaults(self) -> None:
        """
        engine = "llamacpp" gives its health and metrics paths, names, grace
        and startup timeout; generic stays as llmgw always was.
        """
        p = parse_profile("p", {"engine": "llamacpp", "command": ["llama-server"]})
        self.assertEqual((p.health_path, p.metrics_path, p.stop_grace_s, p.startup_timeout_s),
                         ("/health", "/metrics", 10, 600))
        self.assertEqual(p.metric_names["running"], "llamacpp:requests_processing")
        g = parse_profile("g", {"command": ["x"]})
        self.assertEqual((g.engine, g.health_path, g.metrics_path, g.stop_grace_s,
                          g.startup_timeout_s, g.stop_signal), ("generic", "/health", "", 30, 600,
                                                                "SIGTERM"))
        self.assertEqual(g.metric_names, {})

    def test_every_default_can_be_overridden(self) -> None:
        """
        Each engine default yields to the profile's own value.
        """
        p = parse_profile("p", {
            "engine": "vllm", "command": ["vllm"], "health_path": "/ping", "metrics_path": "/m",
            "stop_grace_s": 5, "startup_timeout_s": 7, "stop_signal": "SIGINT",
            "metric_names": {"waiting": "q"},
        })
        self.assertEqual((p.health_path, p.metrics_path, p.stop_grace_s, p.startup_timeout_s,
                          p.stop_signal), ("/ping", "/m", 5, 7, "SIGINT"))
        self.assertEqual(p.metric_names["waiting"], "q")
        self.assertEqual(p.metric_names["running"], "vllm:num_requests_running")
        off = parse_profile("p", {"engine": "vllm", "command": ["vllm"], "metrics_path": ""})
        self.assertEqual((off.metrics_path, off.metric_names), ("", {}))

    def test_worker_command(self) -> None:
        """
        Ranks 1..N-1 run worker_command with worker_health_path (default:
        ready while alive); rank 0 runs command; only rank 0 is scraped,
        with or without a worker_command.
        """
        p = parse_profile("p", {
            "engine": "sglang", "command": ["lead", "{rank}"], "worker_command": ["work", "{host}"],
            "shards": 2, "fabric": "ib0",
        })
        lead, work = p.launch(0), p.launch(1)
        self.assertEqual((lead.argv, lead.health_path, lead.metrics_path),
                         (("lead", "{rank}"), "/health", "/metrics"))
        self.assertEqual((work.argv, work.health_path, work.metrics_path),
                         (("work", "{host}"), "", ""))
        same = parse_profile("q", {"engine": "vllm", "command": ["x"], "shards": 2, "fabric": "ib0"})
        self.assertEqual(same.launch(1).argv, ("x",))
        self.assertEqual(same.launch(1).health_path, "/health")
        self.assertEqual((same.launch(0).metrics_path, same.launch(1).metrics_path), ("/metrics", ""))

    def test_refusals(self) -> None:
        """
        An unknown engine, stop signal or signal name, a bad path, an empty
        worker_command or an unknown placeholder in it is refused naming
        the profile and the field.
        """
        cases = [
            ({"engine": "tgi"}, "field 'engine' names 'tgi'"),
            ({"stop_signal": "SIGHUP"}, "field 'stop_signal'"),
            ({"metric_names": {"queue": "x"}}, "unknown signal 'queue'"),
            ({"metric_names": {"waiting": ""}}, "'waiting' must be a metric name"),
            ({"metrics_path": "metrics"}, "field 'metrics_path' must start with '/'"),
            ({"worker_health_path": "h"}, "field 'worker_health_path'"),
            ({"worker_command": []}, "field 'worker_command' must be a non-empty list"),
            ({"worker_command": ["x", "{nope}"]}, "unknown placeholder '{nope}'"),
        ]
        for extra, message in cases:
            with self.assertRaises(CatalogError) as cm:
                parse_catalog({"profiles": {"p": {"command": ["x"], **extra}}})
            self.assertIn("profile 'p'", str(cm.exception))
            self.assertIn(message, str(cm.exception))

    def test_host_placeholders(self) -> None:
        """
        {host} and {leader_host} are placeholders a command may use.
        """
        p = parse_profile("p", {"command": ["x", "--host", "{host}", "--m", "{leader_host}"]})
        self.assertIn("{host}", p.command)


class HelpersTests(SynchronousTestCase):
    def test_health_url(self) -> None:
        """
        The health URL uses the advertised host (bracketed for IPv6); no
        health path means no URL (ready while alive).
        """
        spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                         gpu_indices=[], port=8001, health_path="/health")
        self.assertEqual(engines.health_url("10.0.0.7", spec), "http://10.0.0.7:8001/health")
        self.assertEqual(engines.health_url("::1", spec), "http://[::1]:8001/health")
        self.assertEqual(engines.health_url("10.0.0.7", replace(spec, health_path="")), "")

    def test_stop_signals(self) -> None:
        """
        Stop signals map to their numbers; an unknown name is TERM.
        """
        self.assertEqual(engines.stop_signal_number("SIGINT"), signal.SIGINT)
        self.assertEqual(engines.stop_signal_number("nope"), signal.SIGTERM)

    def test_advertise_address(self) -> None:
        """
        Host names and IP addresses are accepted; a port, spaces or a URL
        are not.
        """
        for ok in ("", "10.1.2.3", "gpu-07.example", "fe80::1"):
            self.assertIsNone(engines.advertise_address_problem(ok), ok)
        for bad in ("10.0.0.1 x", "http://x/", "-x", "a" * 300):
            self.assertIsNotNone(engines.advertise_address_problem(bad), bad)


class ReadmeProfilesTests(SynchronousTestCase):
    def test_readme_catalog_is_valid(self) -> None:
        """
        The engine profiles the README shows (a model named by its source,
        then hand-written commands) parse as one catalog, each with its
        engine's defaults; the source's deployment gets the argv llmgw
        writes, and the multi-node ones give their workers their own command.
        """
        import re
        import tomllib

        readme = (Path(__file__).parent.parent / "README.md").read_text()
        blocks = [b for b in re.findall(r"```toml\n(.*?)```", readme, re.S) if "engine =" in b]
        self.assertEqual(len(blocks), 2)
        text = "\n".join(line[3:] if line.startswith("   ") else line
                         for line in "\n".join(blocks).splitlines())
        cat = parse_catalog(tomllib.loads(text))
        by_source = cat.deployments["llama-3.1-70b"]
        argv = cat.profiles[by_source.profile].launch(0, by_source).argv
        self.assertEqual(argv[:3], ("vllm", "serve", "{weights}"))
        self.assertIn("--tensor-parallel-size", argv)
        engines_seen = {p.engine for p in cat.profiles.values()}
        self.assertEqual(engines_seen, {"vllm", "sglang", "llamacpp"})
        for name in ("llama-405b-2x8", "llama-405b-sglang"):
            p = cat.profiles[name]
            self.assertEqual(p.shards, 2)
            self.assertNotEqual(p.launch(1).argv, p.launch(0).argv)
            self.assertEqual(p.launch(1).health_path, "")
        self.assertIn("--headless", cat.profiles["llama-405b-2x8"].worker_command)
