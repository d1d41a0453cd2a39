"""
Tests for L{llmgw.agent.peers} and its wiring in the agent: the
C{--peer-listen} option, the address the agent reports in Register, the
listener serving a cache to another node's cache, and reloads.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw import tap
from llmgw.agent.gpus import discover
from llmgw.agent.peers import AgentPeers, reported_address
from llmgw.agent.service import NodeAgent
from llmgw.models.cache import ModelCache, thread_runner
from llmgw.testing.fakefetch import FakeFetcher
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.crl import revoke
from llmgw.tlsconf.options import agent_files
from tests.test_models_peers import CONFIG, MODELS, SOURCE, WEIGHTS


class OptionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        make_pki(self.dir, nodes=["node-1"], server_hosts=["127.0.0.1"])

    def parse(self, *args: str) -> dict[str, object]:
        o = tap.Options()
        o.parseOptions(["agent", "--control", "127.0.0.1:7443", "--certs", str(self.dir), "--node", "node-1",
                        "--gpus", "sim:1x1GiB", "--state-dir", self.mktemp(), *args])
        return o.subOptions  # type: ignore[no-any-return]

    def test_peer_listen(self) -> None:
        """
        C{--peer-listen} takes HOST:PORT or a bare port (every interface);
        without it there is no listener; a malformed value is refused
        naming the option.
        """
        self.assertIsNone(self.parse()["peer_listen"])
        self.assertEqual(self.parse("--peer-listen", "10.0.0.7:7444")["peer_listen"], ("10.0.0.7", 7444))
        self.assertEqual(self.parse("--peer-listen", "7444")["peer_listen"], ("0.0.0.0", 7444))
        self.assertEqual(self.parse("--peer-listen", "[::1]:7444")["peer_listen"], ("::1", 7444))
        for bad in ("nowhere", "10.0.0.7:0", "::1:7444"):
            e = self.assertRaises(usage.UsageError, self.parse, "--peer-listen", bad)
            self.assertIn("--peer-listen", str(e))

    def test_bad_crl_refused(self) -> None:
        """
        A CRL beside the CA that does not parse is refused at start, naming
        the file: the peer listener and peer fetches would check it.
        """
        (self.dir / "crl.pem").write_text("-----BEGIN X509 CRL-----\nMIIB")
        e = self.assertRaises(usage.UsageError, self.parse)
        self.assertIn("crl.pem", str(e))

    def test_reported_address(self) -> None:
        """
        The reported address is the listener's host, or the advertised host
        when it listens on every interface; empty without a listener or a
        host.
        """
        self.assertEqual(reported_address(None, "10.0.0.7"), "")
        self.assertEqual(reported_address(("10.0.0.8", 7444), "10.0.0.7"), "10.0.0.8:7444")
        self.assertEqual(reported_address(("0.0.0.0", 7444), "10.0.0.7"), "10.0.0.7:7444")
        self.assertEqual(reported_address(("::", 7444), "fd00::7"), "[fd00::7]:7444")
        self.assertEqual(reported_address(("0.0.0.0", 7444), ""), "")

    def test_register_carries_peer_address(self) -> None:
        """
        An agent with a peer listener reports its address in Register once
        listening; one without reports none; a reload reaches the listener.
        """
        options = self.parse("--peer-listen", "127.0.0.1:7444")
        clock = MemoryReactorClock()

        def agent(listen: tuple[str, int] | None) -> NodeAgent:
            svc = NodeAgent(
                clock, tls=options["tls"], node_id="node-1", control_host="127.0.0.1",  # type: ignore[arg-type]
                control_port=7443, state=options["state"],  # type: ignore[arg-type]
                gpu_source=discover(options["gpu_spec"], clock, salt="node-1"),  # type: ignore[arg-type]
                handle_sighup=False, peer_listen=listen)
            return svc
        svc = agent(("127.0.0.1", 7444))
        self.assertEqual(svc.core.register_message().peer_address, "")
        svc.peers.startService()
        self.addCleanup(svc.peers.stopService)
        self.assertEqual(svc.core.register_message().peer_address, "127.0.0.1:7444")
        self.assertEqual(clock.tcpServers[0][0], 7444)
        self.assertTrue(svc.reload_certificate())
        self.assertIs(svc.peers.server_tls.files, svc.peers.files)
        self.assertEqual(agent(None).core.register_message().peer_address, "")


class AgentPeersTests(TestCase):
    timeout = 60

    def test_serves_cache_and_fetches(self) -> None:
        """
        One node's L{AgentPeers} serves its cache; another's peering
        fetches the model from it, the source asked for the plan only. After
        the client node's certificate is revoked and the server reloads, the
        client is refused and the source serves.
        """
        ca = make_pki(self.mktemp(), nodes=("node-a", "node-b"))
        pool = ThreadPool(minthreads=0, maxthreads=4, name="peers-agent-test")
        pool.start()
        self.addCleanup(pool.stop)
        run_ = thread_runner(reactor, pool)

        async def run() -> None:
            a = AgentPeers(reactor, agent_files(ca.directory, "node-a"), ("127.0.0.1", 0))
            b = AgentPeers(reactor, agent_files(ca.directory, "node-b"), None)
            holder = ModelCache(self.mktemp(), 1 << 30, {"hf": FakeFetcher(MODELS)}, reactor, run_,
                                peering=a.peering)
            a.serve(holder)
            a.startService()
            self.addCleanup(a.stopService)
            await holder.load()
            await holder.ensure(SOURCE)
            address = a.reported("")
            source_fetcher = FakeFetcher(MODELS)
            cache = ModelCache(self.mktemp(), 1 << 30, {"hf": source_fetcher}, reactor, run_, peering=b.peering)
            await cache.load()
            path = await cache.ensure(SOURCE, peers=[address])
            self.assertEqual(((path / "sub/weights.bin").read_bytes(), (path / "config.json").read_bytes()),
                             (WEIGHTS, CONFIG))
            self.assertEqual(source_fetcher.written, [])

            revoke(ca, node_id="node-b")
            a.reload(agent_files(ca.directory, "node-a"))
            again = FakeFetcher(MODELS)
            other = ModelCache(self.mktemp(), 1 << 30, {"hf": again}, reactor, run_, peering=b.peering)
            await other.load()
            await other.ensure(SOURCE, peers=[address])
            self.assertEqual(sorted(again.written), ["config.json", "sub/weights.bin"])
        return Deferred.fromCoroutine(run())
