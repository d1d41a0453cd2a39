"""
Tests for L{llmgw.agent.service}: C{twistd llmgw agent} options and the
start-up errors that name the file and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cryptography.x509.oid import ExtendedKeyUsageOID
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw import tap
from llmgw.agent.gpus import discover
from llmgw.agent.service import NodeAgent, Options, makeService
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.certs import make_leaf


class OptionsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, nodes=["node-1", "node-2"], server_hosts=["127.0.0.1"])
        self.state = self.mktemp()

    def parse(self, *args: str) -> Options:
        o = Options()
        o.parseOptions(["--state-dir", self.state, *args])
        return o

    def refused(self, *args: str) -> str:
        e = self.assertRaises(usage.UsageError, self.parse, *args)
        return str(e)

    def test_certs_dir(self) -> None:
        """
        --certs DIR --node ID finds the files; the node id is the
        certificate's common name; fabrics repeat; the port defaults to 7443.
        """
        o = self.parse("--control", "127.0.0.1", "--certs", str(self.dir), "--node", "node-1",
                       "--fabric", "ib0=10.0.0.1", "--fabric", "nvlink", "--gpus", "sim:2x24GiB")
        self.assertEqual(o["node_id"], "node-1")
        self.assertEqual((o["control_host"], o["control_port"]), ("127.0.0.1", 7443))
        self.assertEqual(o["fabrics"], {"ib0": "10.0.0.1", "nvlink": ""})
        self.assertEqual((o["gpu_spec"].count, o["gpu_spec"].size_mb), (2, 24576))

    def test_explicit_files(self) -> None:
        """
        --ca/--cert/--key work without --node.
        """
        o = self.parse("--control", "[::1]:9000", "--ca", str(self.dir / "ca.pem"),
                       "--cert", str(self.dir / "agent-node-2.pem"),
                       "--key", str(self.dir / "agent-node-2.key"))
        self.assertEqual((o["node_id"], o["control_host"], o["control_port"]), ("node-2", "::1", 9000))

    def test_missing_control(self) -> None:
        """
        --control is required.
        """
        self.assertIn("--control", self.refused("--certs", str(self.dir), "--node", "node-1"))

    def test_missing_file(self) -> None:
        """
        A missing certificate file is named.
        """
        msg = self.refused("--control", "h:1", "--certs", str(self.dir), "--node", "node-9")
        self.assertIn("agent-node-9.pem", msg)
        self.assertIn("cannot read", msg)

    def test_mismatched_key(self) -> None:
        """
        A key that does not belong to the certificate is named.
        """
        msg = self.refused("--control", "h:1", "--ca", str(self.dir / "ca.pem"),
                           "--cert", str(self.dir / "agent-node-1.pem"),
                           "--key", str(self.dir / "agent-node-2.key"))
        self.assertIn("agent-node-2.key does not belong to certificate", msg)

    def test_expired(self) -> None:
        """
        An expired certificate is named with its expiry.
        """
        key, cert = make_leaf(self.ca.key, self.ca.certificate, "node-3", 0, [],
                              ExtendedKeyUsageOID.CLIENT_AUTH)
        self.ca._write_leaf("agent-node-3", key, cert, "agent")
        msg = self.refused("--control", "h:1", "--certs", str(self.dir), "--node", "node-3")
        self.assertIn("agent-node-3.pem expired", msg)

    def test_server_cert_as_agent(self) -> None:
        """
        A certificate that is not a node identity (a server certificate) is
        refused, naming the file.
        """
        msg = self.refused("--control", "h:1", "--ca", str(self.dir / "ca.pem"),
                           "--cert", str(self.dir / "server.pem"),
                           "--key", str(self.dir / "server.key"))
        self.assertIn("server.pem", msg)
        self.assertIn("client authentication", msg)

    def test_node_mismatch(self) -> None:
        """
        --node must match the certificate's common name.
        """
        (self.dir / "agent-node-x.pem").write_bytes((self.dir / "agent-node-1.pem").read_bytes())
        (self.dir / "agent-node-x.key").write_bytes((self.dir / "agent-node-1.key").read_bytes())
        msg = self.refused("--control", "h:1", "--certs", str(self.dir), "--node", "node-x")
        self.assertIn("which is for node 'node-1'", msg)

    def test_bad_flags(self) -> None:
        """
        Bad GPU specs, heartbeats, fabrics, partial file sets and unusable
        state directories are refused with what was wrong.
        """
        base = ["--control", "h:1", "--certs", str(self.dir), "--node", "node-1"]
        self.assertIn("sim:COUNTxSIZE", self.refused(*base, "--gpus", "sim:2x80"))
        self.assertIn("--heartbeat", self.refused(*base, "--heartbeat", "soon"))
        self.assertIn("twice", self.refused(*base, "--fabric", "ib0", "--fabric", "ib0=x"))
        self.assertIn("go together", self.refused("--control", "h:1", "--ca", "x"))
        self.assertIn("port", self.refused("--control", "h:port", "--certs", str(self.dir),
                                           "--node", "node-1"))
        blocker = Path(self.mktemp())
        blocker.write_text("")
        self.state = str(blocker / "state")
        self.assertIn(self.state, self.refused(*base))

    def test_tap_kind(self) -> None:
        """
        `twistd llmgw agent` reaches this module and builds a NodeAgent.
        """
        o = tap.Options()
        o.parseOptions(["agent", "--control", "127.0.0.1:7443", "--certs", str(self.dir),
                        "--node", "node-1", "--gpus", "sim:1x1GiB", "--state-dir", self.state])
        reactor = ThreadCallReactor()
        svc = tap.makeService(o, reactor=reactor)
        self.assertIsInstance(svc, NodeAgent)
        assert isinstance(svc, NodeAgent)
        self.assertEqual([g.index for g in svc.monitor.gpus()], [0])
        svc.startService()
        self.addCleanup(svc.stopService)
        self.assertEqual(len(reactor.tcpClients), 1)
        self.assertEqual(reactor.tcpClients[0][:2], ("127.0.0.1", 7443))
        self.assertTrue(makeService)
        # The model cache is in the state directory unless told otherwise.
        self.assertEqual(svc.model_cache.directory, Path(self.state) / "models")
        self.assertTrue(svc.model_cache.pool.started)

    def test_model_cache_options(self) -> None:
        """
        --model-cache names the cache's directory and --model-cache-size its
        bound, with a unit; a size that is not one is refused naming it.
        """
        base = ["agent", "--control", "127.0.0.1:7443", "--certs", str(self.dir), "--node",
                "node-1", "--gpus", "sim:1x1GiB", "--state-dir", self.state]
        o = tap.Options()
        cache = self.mktemp()
        o.parseOptions([*base, "--model-cache", cache, "--model-cache-size", "20GiB"])
        self.assertEqual((o.subOptions["model_cache"], o.subOptions["model-cache-size"]),
                         (Path(cache), 20 * 1024**3))
        svc = tap.makeService(o, reactor=ThreadCallReactor())
        assert isinstance(svc, NodeAgent)
        self.assertEqual(svc.model_cache.cache.capacity, 20 * 1024**3)
        self.assertIn("is not a size", self.refused(*base[1:], "--model-cache-size", "lots"))


class ThreadCallReactor(MemoryReactorClock):
    """
    A memory reactor that keeps what threads hand back (the model cache's
    pool), never running it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.thread_calls: list[Any] = []

    def callFromThread(self, f: Any, *a: Any, **kw: Any) -> None:
        self.thread_calls.append((f, a, kw))


class CertificateReloadTests(SynchronousTestCase):
    def setUp(self) -> None:
        import signal

        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, nodes=["node-1", "node-2"], server_hosts=["127.0.0.1"])
        original = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, original)

    def agent(self, handle_sighup: bool = False) -> NodeAgent:
        o = tap.Options()
        o.parseOptions(["agent", "--control", "127.0.0.1:7443", "--certs", str(self.dir),
                        "--node", "node-1", "--gpus", "sim:1x1GiB", "--state-dir", self.mktemp()])
        svc = NodeAgent(
            self.reactor, tls=o.subOptions["tls"], node_id="node-1", control_host="127.0.0.1",
            control_port=7443, state=o.subOptions["state"],
            gpu_source=discover(o.subOptions["gpu_spec"], self.reactor, salt="node-1"),
            handle_sighup=handle_sighup,
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        return svc

    def setup_reactor(self) -> None:
        self.reactor = ThreadCallReactor()

    def test_reload_renewed(self) -> None:
        """
        A renewed certificate is taken for the next connection and its new
        expiry goes out in the next Register.
        """
        self.setup_reactor()
        svc = self.agent()
        renewed = self.ca.issue_agent("node-1", days=400)
        self.assertTrue(svc.reload_certificate())
        self.assertEqual(svc.client_tls.files.cert.serial_number, renewed.certificate.serial_number)
        self.assertEqual(svc.core.config.certificate_not_after,
                         int(renewed.certificate.not_valid_after_utc.timestamp()))

    def test_reload_refuses_bad_files(self) -> None:
        """
        A half-written certificate is refused and the running one stays.
        """
        self.setup_reactor()
        svc = self.agent()
        before = svc.client_tls.files.cert.serial_number
        (self.dir / "agent-node-1.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB")
        self.assertFalse(svc.reload_certificate())
        self.assertEqual(svc.client_tls.files.cert.serial_number, before)

    def test_sighup(self) -> None:
        """
        SIGHUP reloads the certificate on the reactor's next turn.
        """
        import os
        import signal

        self.setup_reactor()
        svc = self.agent(handle_sighup=True)
        renewed = self.ca.issue_agent("node-1", days=200)
        os.kill(os.getpid(), signal.SIGHUP)
        # The model cache's threads hand back results too: not those.
        [(f, a, kw)] = [c for c in self.reactor.thread_calls
                        if not isinstance(getattr(c[0], "__self__", None), Deferred)]
        f(*a, **kw)
        self.assertEqual(svc.client_tls.files.cert.serial_number, renewed.certificate.serial_number)
