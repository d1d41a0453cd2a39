"""
Tests for L{llmgw.local}: dev certificates, the demo catalog and options.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import load_catalog
from llmgw.local import LocalError, Options, agent_cache, demo_catalog, ensure_certs
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import TLSFiles


class CertificateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())

    def test_first_run_makes_everything(self) -> None:
        """
        On the first run the CA, the control plane's certificate (for
        127.0.0.1 and localhost) and one certificate per node are made, and
        they load together.
        """
        made = ensure_certs(self.dir, ["local-1", "local-2"])
        self.assertEqual(made, ["CA", "server certificate", "certificate for local-1",
                                "certificate for local-2"])
        TLSFiles.load(self.dir / "ca.pem", self.dir / "server.pem", self.dir / "server.key")
        TLSFiles.load(self.dir / "ca.pem", self.dir / "agent-local-2.pem",
                      self.dir / "agent-local-2.key")

    def test_reused(self) -> None:
        """
        A second run reuses what is there and makes only what is missing.
        """
        ensure_certs(self.dir, ["local-1"])
        before = (self.dir / "agent-local-1.pem").read_bytes()
        self.assertEqual(ensure_certs(self.dir, ["local-1", "local-2"]),
                         ["certificate for local-2"])
        self.assertEqual((self.dir / "agent-local-1.pem").read_bytes(), before)

    def test_damaged(self) -> None:
        """
        A damaged certificate is refused, naming it and saying what to do.
        """
        ensure_certs(self.dir, ["local-1"])
        (self.dir / "server.pem").write_text("-----BEGIN CERTIFICATE-----\ngarbage\n")
        with self.assertRaises(LocalError) as e:
            ensure_certs(self.dir, ["local-1"])
        self.assertIn("server.pem", str(e.exception))
        self.assertIn("Delete", str(e.exception))

    def test_other_ca(self) -> None:
        """
        A node certificate from a different CA is refused.
        """
        ensure_certs(self.dir, ["local-1"])
        other = make_pki(self.mktemp(), nodes=("local-1",))
        for suffix in (".pem", ".key"):
            (self.dir / f"agent-local-1{suffix}").write_bytes(
                (other.directory / f"agent-local-1{suffix}").read_bytes())
        with self.assertRaises(LocalError) as e:
            ensure_certs(self.dir, ["local-1"])
        self.assertIn("not issued by the CA", str(e.exception))

    def test_certificates_without_ca(self) -> None:
        """
        Certificates without their CA are not silently joined by a new CA.
        """
        self.dir.mkdir()
        (self.dir / "server.pem").write_text("x")
        with self.assertRaises(LocalError) as e:
            ensure_certs(self.dir, ["local-1"])
        self.assertIn("no CA", str(e.exception))

    def test_damaged_ca_key(self) -> None:
        """
        A damaged CA key is refused.
        """
        ensure_certs(self.dir, ["local-1"])
        (self.dir / "ca.key").write_text("nope")
        self.assertRaises(LocalError, ensure_certs, self.dir, ["local-1"])


class CatalogTests(SynchronousTestCase):
    def test_demo_catalog(self) -> None:
        """
        The demo catalog is a valid catalog whose shards can import this copy
        of llmgw, however it was installed.
        """
        state = Path(self.mktemp())
        state.mkdir()
        path = demo_catalog(state)
        catalog = load_catalog(path)
        self.assertIn("demo", catalog.deployments)
        env = tomllib.loads(path.read_text())["profiles"]["fake-1gpu"]["env"]
        self.assertTrue((Path(env["PYTHONPATH"]) / "llmgw" / "__init__.py").exists())


class OptionsTests(SynchronousTestCase):
    def test_options(self) -> None:
        """
        The local fleet's options become a control plane's options with its
        agent port, gateway and admin API on loopback.
        """
        root = Path(self.mktemp())
        o = Options()
        o.parseOptions(["--certs", str(root / "certs"), "--state-dir", str(root / "state"),
                        "--agents", "3", "--gateway", "18000"])
        control = o["control"]
        self.assertEqual(control["gateway_address"], ("127.0.0.1", 18000))
        self.assertEqual(control["admin_address"], ("127.0.0.1", 7480))
        self.assertEqual(control["agents_host"], "127.0.0.1")
        self.assertTrue((root / "certs" / "agent-local-3.pem").exists())

    def test_model_cache(self) -> None:
        """
        --model-cache DIR gives each agent a cache of its own under DIR;
        without it each agent's is in its state directory (None here);
        --model-cache-size takes a unit.
        """
        root = Path(self.mktemp())
        base = ["--certs", str(root / "certs"), "--state-dir", str(root / "state")]
        o = Options()
        o.parseOptions(base)
        self.assertIsNone(agent_cache(o, "local-1"))
        o = Options()
        o.parseOptions([*base, "--model-cache", str(root / "cache"), "--model-cache-size", "2GiB"])
        self.assertEqual(agent_cache(o, "local-1"), (root / "cache").resolve() / "local-1")
        self.assertEqual(o["model-cache-size"], 2 * 1024**3)

    def test_sized_for_one_machine(self) -> None:
        """
        The local fleet's control plane is capped for a few agents and
        clients, so what it may hold fits a desktop's open-file limit (and
        it does not warn about it): not the 15,000 agent connections and
        10,000 gateway clients a data centre's control plane allows.
        """
        from llmgw.control.service import makeService
        from llmgw.oslimits import FD_HEADROOM

        root = Path(self.mktemp())
        o = Options()
        o.parseOptions(["--certs", str(root / "certs"), "--state-dir", str(root / "state"),
                        "--agents", "3", "--gateway", "0", "--admin", "0", "--agent-listen", "0"])
        self.assertEqual(o["control"]["max-connections"], 64)
        cp = makeService(o["control"], reactor=MemoryReactorClock())
        self.assertLessEqual(sum(n.count for n in cp.fd_needs()) + FD_HEADROOM, 10_000)

    def test_refused(self) -> None:
        """
        Bad counts and real GPU specs are refused.
        """
        root = Path(self.mktemp())
        base = ["--certs", str(root / "certs"), "--state-dir", str(root / "state")]
        for bad in (["--agents", "0"], ["--agents", "x"], ["--gpus", "auto"],
                    ["--gateway", "x:y"], ["--heartbeat", "0"]):
            self.assertRaises(usage.UsageError, Options().parseOptions, base + bad)
