"""
Tests for the reconciler's part of C{twistd llmgw control}: its options,
C{--config}, and the catalog reload on SIGHUP.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.service import Options, ReloadOnHangup, makeService
from llmgw.control.shell.reconciler import Reconciler

EXAMPLE = str(Path(__file__).parent.parent / "llmgw" / "demo-catalog.toml")


def parse(*args: str) -> Options:
    opts = Options()
    opts.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", *args])
    return opts


class OptionsTests(SynchronousTestCase):
    def test_defaults(self) -> None:
        """
        The timing options default to the design's values; without a
        catalog the reconciler runs with an empty one.
        """
        opts = parse()
        self.assertEqual(
            (opts["pass-interval"], opts["suspect-after"], opts["lost-after"], opts["adoption-grace"]),
            (1.0, 15.0, 300.0, 30.0),
        )
        self.assertEqual(dict(opts["catalog_loaded"].deployments), {})

    def test_catalog_and_timings(self) -> None:
        """
        C{--catalog} and the timing options are read and checked.
        """
        opts = parse("--catalog", EXAMPLE, "--pass-interval", "0.5", "--lost-after", "60")
        self.assertEqual(opts["catalog_loaded"].deployments["demo"].replicas, 2)
        self.assertEqual((opts["pass-interval"], opts["lost-after"]), (0.5, 60.0))

    def test_bad_values(self) -> None:
        """
        Bad timings are refused with the option named.
        """
        with self.assertRaises(usage.UsageError) as ctx:
            parse("--suspect-after", "soon")
        self.assertIn("--suspect-after", str(ctx.exception))
        self.assertRaises(usage.UsageError, parse, "--lost-after", "10", "--suspect-after", "15")
        self.assertRaises(usage.UsageError, parse, "--pass-interval", "0")

    def test_bad_catalog_is_clear_exit(self) -> None:
        """
        A bad catalog at start is a usage error naming the entry and field.
        """
        path = Path(self.mktemp())
        path.write_text('[[deployments]]\nmodel = "demo"\nprofile = "missing"\n')
        with self.assertRaises(usage.UsageError) as ctx:
            parse("--catalog", str(path))
        self.assertIn("deployment 'demo'", str(ctx.exception))
        self.assertIn("'profile'", str(ctx.exception))

    def test_config_file(self) -> None:
        """
        C{--config} can hold any option (flags included, with dashes or
        underscores); the command line wins over it.
        """
        path = Path(self.mktemp())
        path.write_text(
            f'catalog = "{EXAMPLE}"\nsuspect_after = 20\nlost-after = 100\n'
            'pass-interval = 3\ninsecure = true\nagents = "127.0.0.1:0"\n'
        )
        opts = Options()
        opts.parseOptions(["--config", str(path), "--pass-interval", "2"])
        self.assertEqual((opts["suspect-after"], opts["lost-after"], opts["pass-interval"]), (20.0, 100.0, 2.0))
        self.assertTrue(opts["insecure"])
        self.assertEqual(opts["catalog_loaded"].deployments["demo"].profile, "fake-1gpu")

    def test_config_unknown_key(self) -> None:
        """
        An unknown key in the config file is refused, naming it.
        """
        path = Path(self.mktemp())
        path.write_text("suspect_afterr = 20\n")
        with self.assertRaises(usage.UsageError) as ctx:
            parse("--config", str(path))
        self.assertIn("suspect_afterr", str(ctx.exception))


class MakeServiceTests(SynchronousTestCase):
    def test_reconciler_is_the_sink(self) -> None:
        """
        The control plane's status sink is a reconciler driving the agent
        service, with the options' timings and catalog.
        """
        cp = makeService(parse("--catalog", EXAMPLE, "--adoption-grace", "5"), reactor=MemoryReactorClock())
        rec = cp.reconciler
        assert rec is not None
        self.assertIsInstance(rec, Reconciler)
        self.assertIs(cp.sink, rec)
        self.assertIs(rec.dispatcher, cp.agents)
        self.assertEqual(rec.epoch, cp.epoch)
        self.assertEqual(rec.adoption_grace, 5.0)
        self.assertTrue(rec.knows_model("demo"))

    def test_growth_freezes_only_in_its_own_process(self) -> None:
        """
        As twistd builds it (no reactor given), the control plane's
        reconciler freezes the collector's heap through the collector
        tuning after the fleet grew; an embedder's control plane, or one
        with the tuning off, leaves the collector alone.
        """
        own = makeService(parse("--catalog", EXAMPLE))
        collector = own.getServiceNamed("collector")
        assert own.reconciler is not None
        self.assertEqual(own.reconciler.after_growth, collector.freeze_grown)
        for embedded in (makeService(parse("--catalog", EXAMPLE), reactor=MemoryReactorClock()),
                         makeService(parse("--catalog", EXAMPLE, "--gc-threshold", "0"))):
            assert embedded.reconciler is not None
            self.assertIsNone(embedded.reconciler.after_growth)


    def test_cordons_kept_beside_catalog(self) -> None:
        """
        The control plane keeps cordons in the state file beside its
        C{--catalog}: a new one made from the same options starts with them,
        and an uncordon clears the file; without a catalog nothing is kept.
        """
        path = Path(self.mktemp())
        path.write_text(Path(EXAMPLE).read_text())
        Path(str(path) + ".scale.json").write_text(json.dumps({"cordoned": ["gpu-1"], "draining": ["gpu-2"]}))
        rec = makeService(parse("--catalog", str(path)), reactor=MemoryReactorClock()).reconciler
        assert rec is not None
        self.assertEqual((rec.cordoned, rec.draining_nodes), ({"gpu-1", "gpu-2"}, {"gpu-2"}))
        rec.uncordon("gpu-2")
        again = makeService(parse("--catalog", str(path)), reactor=MemoryReactorClock()).reconciler
        assert again is not None
        self.assertEqual((again.cordoned, again.draining_nodes), ({"gpu-1"}, set()))
        bare = makeService(parse(), reactor=MemoryReactorClock()).reconciler
        assert bare is not None
        self.assertIsNone(bare.fleet_state.path)

class FakeReactor:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def callFromThread(self, fn: Any, *a: Any) -> None:
        self.calls.append(fn)
        fn(*a)


class ReloadOnHangupTests(SynchronousTestCase):
    def test_sighup_reloads_and_chains(self) -> None:
        """
        SIGHUP reloads the catalog; a handler installed before is still
        called; stopping restores it.
        """
        path = Path(self.mktemp())
        path.write_text(Path(EXAMPLE).read_text())
        cp = makeService(parse("--catalog", str(path)), reactor=MemoryReactorClock())
        rec = cp.reconciler
        assert rec is not None
        earlier: list[int] = []
        old = signal.signal(signal.SIGHUP, lambda s, f: earlier.append(s))
        self.addCleanup(signal.signal, signal.SIGHUP, old)
        reactor = FakeReactor()
        svc = ReloadOnHangup(reactor, rec, handle_sighup=True)
        svc.startService()
        path.write_text(Path(EXAMPLE).read_text().replace('model = "demo"', 'model = "other"'))
        signal.getsignal(signal.SIGHUP)(signal.SIGHUP, None)  # type: ignore[operator]
        self.assertTrue(rec.knows_model("other"))
        self.assertEqual(earlier, [signal.SIGHUP])
        path.write_text("not toml [")
        svc.reload()
        self.assertTrue(rec.knows_model("other"))
        svc.stopService()
        self.assertNotEqual(signal.getsignal(signal.SIGHUP), svc._sighup._on_signal)
