"""
L{llmgw.control.ha.member}: a control-plane member that reconciles while it leads
and redirects agents while it does not, against the in-memory etcd on a
Clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

import llmgw
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import EMPTY
from llmgw.control.ha.election import MemberInfo, Role
from llmgw.control.ha.member import FencedDispatcher, HAMember, catalog_key, epoch_base_key
from llmgw.control.service import ControlPlane
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import NotConnected, ShardCommand
from llmgw.control.state.inventory import Inventory
from llmgw.testing.fakeetcd import FakeEtcd
from llmgw.testing.stream import PeerCertTransport, frame, register
from llmgw.wire import parse_redirect


class ExpectingDispatcher:
    """A dispatcher that expects exactly the calls a test names."""

    def __init__(self, test: SynchronousTestCase, expected: list[tuple[str, Any]]):
        self.test = test
        self.expected = list(expected)

    def _called(self, name: str, arg: Any) -> None:
        self.test.assertTrue(self.expected, f"unexpected {name}({arg!r})")
        self.test.assertEqual(self.expected.pop(0), (name, arg))

    def start_shard(self, command: ShardCommand) -> None:
        self._called("start", command.shard_id)

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._called("stop", shard_id)

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._called("drain", shard_id)

    def sleep_shard(self, node_id: str, shard_id: str) -> None:
        self._called("sleep", shard_id)

    def connected_nodes(self) -> list[str]:
        return ["n1"]


class FencedDispatcherTests(SynchronousTestCase):
    def test_commands_pass_only_while_leading(self) -> None:
        """
        Commands reach the agent service while the member may command; once
        it may not, each is refused with NotConnected and counted, and it
        reports no connected nodes.
        """
        leading = [True]
        inner = ExpectingDispatcher(self, [("stop", "s1"), ("sleep", "s1")])
        fenced = FencedDispatcher(inner, lambda: leading[0])
        fenced.stop_shard("n1", "s1")
        fenced.sleep_shard("n1", "s1")
        self.assertEqual(fenced.connected_nodes(), ["n1"])
        leading[0] = False
        self.assertRaises(NotConnected, fenced.stop_shard, "n1", "s2")
        self.assertRaises(NotConnected, fenced.drain_shard, "n1", "s3")
        self.assertRaises(NotConnected, fenced.sleep_shard, "n1", "s3")
        self.assertEqual(fenced.connected_nodes(), [])
        self.assertEqual(fenced.fenced, 3)
        self.assertEqual(inner.expected, [])


DEMO = (Path(llmgw.__file__).parent / "demo-catalog.toml").read_bytes()


class Member:
    def __init__(self, reactor: MemoryReactorClock, fake: FakeEtcd, name: str, base_ms: int = 1_700_000_000_000,
                 catalog_file: str | None = None):
        self.inventory = Inventory()
        self.reconciler = Reconciler(EMPTY, self.inventory, clock=reactor, adoption_grace=30)
        self.cp = ControlPlane(
            reactor, sink=self.reconciler, tls=None, agents_host="127.0.0.1", agents_port=0,
            inventory=self.inventory,
        )
        self.ha = HAMember(
            reactor, self.cp, self.reconciler, fake, "/llmgw",
            MemberInfo(name, f"127.0.0.{ord(name[-1]) - 96}:7443"), ttl=10,
            now_ms=lambda: base_ms, catalog_file=catalog_file,
        )


class HAMemberTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeEtcd(self.reactor)

    def member(self, name: str, **kw: Any) -> Member:
        m = Member(self.reactor, self.fake, name, **kw)
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        return m

    def advance(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)

    def test_leader_reconciles_with_etcd_epoch(self) -> None:
        """
        The member that wins runs its reconciler with the command epoch
        base + winning revision, where the base was stored once in etcd;
        its status says leader, its own id and agent address, and that
        epoch.
        """
        a = self.member("a")
        self.advance(0.1)
        self.assertIs(a.ha.election.role, Role.LEADER)
        self.assertTrue(a.reconciler.running)
        base = int(self.fake.kvs[epoch_base_key("/llmgw")].value)
        self.assertEqual(base, 1_700_000_000_000)
        epoch = base + a.ha.election.epoch
        self.assertEqual((a.cp.agents.epoch, a.reconciler.epoch, a.cp.epoch), (epoch, epoch, epoch))
        st = a.ha.status()
        self.assertEqual(
            (st["role"], st["leader_id"], st["leader_agent_address"], st["epoch"]),
            ("leader", "a", "127.0.0.1:7443", epoch),
        )
        self.assertIsNone(a.ha.gate())

    def test_epoch_base_is_kept_by_later_members(self) -> None:
        """
        A member started later with another clock uses the base already in
        etcd, so epochs keep increasing from leader to leader.
        """
        a = self.member("a")
        self.advance(0.1)
        b = self.member("b", base_ms=5)
        self.advance(0.1)
        self.assertEqual(b.ha.epoch_base, a.ha.epoch_base)

    def test_follower_stands_by_and_redirects(self) -> None:
        """
        A member that does not lead runs no reconciler, and refuses a
        Register with a failed-precondition Ack naming the leader's agent
        address.
        """
        self.member("a")
        self.advance(0.1)
        b = self.member("b")
        self.advance(5)
        self.assertFalse(b.reconciler.running)
        proto = b.cp.agents.buildProtocol(IPv4Address("TCP", "127.0.0.9", 40000))
        transport = PeerCertTransport(None, peerAddress=IPv4Address("TCP", "127.0.0.9", 40000))
        proto.makeConnection(transport)
        proto.dataReceived(frame(register("node-a")))
        [msg] = transport.frames()
        self.assertFalse(msg.ack.ok)
        self.assertEqual(msg.ack.code, pb.Ack.CODE_FAILED_PRECONDITION)
        self.assertEqual(parse_redirect(msg.ack.error), "127.0.0.1:7443")
        self.assertEqual(b.ha.status()["role"], "follower")
        self.assertEqual(b.ha.status()["leader_id"], "a")
        self.flushLoggedErrors()

    def test_step_down_stops_reconciler_and_fences(self) -> None:
        """
        When etcd becomes unreachable the leader stops its reconciler,
        refuses commands and registrations, and the other member takes
        over once etcd answers it, with a larger epoch.
        """
        a = self.member("a")
        self.advance(0.1)
        first = a.ha.epoch
        self.fake.available = False
        self.advance(10)
        self.assertFalse(a.reconciler.running)
        self.assertRaises(NotConnected, a.ha.dispatcher.stop_shard, "n1", "s1")
        code, _ = a.ha.gate()  # type: ignore[misc]
        self.assertEqual(code, pb.Ack.CODE_RESOURCE_EXHAUSTED)
        b = self.member("b")
        self.fake.available = True
        self.advance(15)
        leaders = [m for m in (a, b) if m.ha.election.role is Role.LEADER]
        self.assertEqual(len(leaders), 1)
        self.assertGreater(leaders[0].ha.epoch, first)
        self.flushLoggedErrors()

    def test_leader_accepts_register_and_acks_heartbeats(self) -> None:
        """
        The leader takes a Register, and acknowledges each heartbeat, so
        an agent can tell a silent (frozen) member from a quiet one.
        """
        a = self.member("a")
        self.advance(0.1)
        proto = a.cp.agents.buildProtocol(IPv4Address("TCP", "127.0.0.9", 40000))
        transport = PeerCertTransport(None, peerAddress=IPv4Address("TCP", "127.0.0.9", 40000))
        proto.makeConnection(transport)
        proto.dataReceived(frame(register("node-a")))
        proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
        acks = [(m.ack.message_id, m.ack.ok) for m in transport.frames()]
        self.assertEqual(acks, [("register", True), ("heartbeat", True)])
        self.assertEqual(a.cp.agents.connected_nodes(), ["node-a"])


class EtcdLogCase(SynchronousTestCase):
    """
    A fake etcd on a memory reactor, what is logged as text in C{logged},
    and catalog files written by L{file}.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeEtcd(self.reactor)
        self.logged: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            from twisted.logger import formatEvent

            self.logged.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def file(self, text: bytes) -> str:
        path = Path(self.mktemp())
        path.write_bytes(text)
        return str(path)


class SharedCatalogTests(EtcdLogCase):

    def lead(self, catalog_file: str | None) -> Member:
        m = Member(self.reactor, self.fake, "a", catalog_file=catalog_file)
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        self.reactor.advance(0.1)
        self.assertTrue(m.ha.taken_over)
        return m

    def test_seeds_etcd_when_it_holds_none(self) -> None:
        """
        A leader whose etcd holds no catalog stores its --catalog file there
        (under its lease) and runs it.
        """
        m = self.lead(self.file(DEMO))
        self.assertEqual(self.fake.kvs[catalog_key("/llmgw")].value, DEMO)
        self.assertEqual(list(m.reconciler.catalog.deployments), ["demo"])
        self.assertTrue(m.reconciler.running)

    def test_etcd_catalog_wins_over_a_different_file(self) -> None:
        """
        A member whose catalog file differs from etcd's says so and runs
        etcd's.
        """
        self.fake.put(catalog_key("/llmgw"), DEMO.replace(b"replicas = 2", b"replicas = 5"))
        m = self.lead(self.file(DEMO))
        self.assertEqual(m.reconciler.catalog.deployments["demo"].replicas, 5)
        self.assertEqual(self.fake.kvs[catalog_key("/llmgw")].value.count(b"replicas = 5"), 1)
        self.assertTrue([line for line in self.logged if "differs from the catalog in etcd" in line])

    def test_leader_follows_catalog_changes(self) -> None:
        """
        A catalog stored in etcd while a member leads is applied by it; an
        invalid one is refused with a logged reason and the running one stays.
        """
        m = self.lead(self.file(DEMO))
        self.fake.put(catalog_key("/llmgw"), DEMO.replace(b"replicas = 2", b"replicas = 3"))
        self.assertEqual(m.reconciler.catalog.deployments["demo"].replicas, 3)
        self.fake.put(catalog_key("/llmgw"), b"[[deployments]]\nmodel = 1\n")
        self.assertEqual(m.reconciler.catalog.deployments["demo"].replicas, 3)
        self.assertTrue([line for line in self.logged if "the running catalog stays" in line])

    def test_deposed_leader_cannot_seed(self) -> None:
        """
        The seeding write is guarded by the leader's lease: with the lease
        gone, nothing is written.
        """

        m = Member(self.reactor, self.fake, "a", catalog_file=self.file(DEMO))
        m.ha.epoch_base = 1
        # Drive the load directly with a lease etcd does not hold.
        from twisted.internet import defer

        d = defer.ensureDeferred(m.ha._load_catalog(lease=424242))
        self.successResultOf(d)
        self.assertNotIn(catalog_key("/llmgw"), self.fake.kvs)


class CtlStatusTests(SynchronousTestCase):
    def test_ctl_status_shows_role_leader_and_epoch(self) -> None:
        """
        `llmgw ctl status` against an HA member shows its role, the leader's
        member id and agent address, and the epoch.
        """
        from llmgw.ctl.fleet import render_status

        text = render_status("http://127.0.0.1:7444", {
            "role": "follower", "member_id": "c2", "leader_id": "c1",
            "leader_agent_address": "10.0.0.1:7443", "epoch": 1796131490208,
        }, [], 0.0)
        lines = {line.split()[0]: line.split()[1] for line in text.splitlines() if len(line.split()) >= 2}
        self.assertEqual(lines["role"], "follower")
        self.assertEqual(lines["leader_id"], "c1")
        self.assertEqual(lines["leader_agent_address"], "10.0.0.1:7443")
        self.assertEqual(lines["epoch"], "1796131490208")


class EtcdOptionsTests(SynchronousTestCase):
    def parse(self, *args: str) -> Any:
        from llmgw.control.service import Options

        o = Options()
        o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:7443", *args])
        return o

    def test_defaults_and_without_etcd(self) -> None:
        """
        Without --etcd nothing of HA is set up; with it the prefix defaults to
        /llmgw, the TTL to 10 s and the advertised agent address to --agents.
        """
        self.assertEqual(self.parse()["etcd_urls"], [])
        o = self.parse("--etcd", "http://127.0.0.1:2379,http://127.0.0.2:2379/", "--member-id", "c1")
        self.assertEqual(o["etcd_urls"], ["http://127.0.0.1:2379", "http://127.0.0.2:2379"])
        self.assertEqual((o["etcd-prefix"], o["etcd-ttl"], o["advertise_agents"]), ("/llmgw", 10, "127.0.0.1:7443"))

    def test_bad_etcd_options_refused(self) -> None:
        """
        A URL that is not an etcd client URL, https without TLS files, TLS
        files without --etcd, a bad prefix or a TTL under 2 s are refused
        with a message naming the option.
        """
        from twisted.python.usage import UsageError

        for args, words in [
            (["--etcd", "127.0.0.1:2379"], "--etcd"),
            (["--etcd", "https://10.0.0.1:2379"], "--etcd-ca"),
            (["--etcd-ca", "ca.pem"], "only meaningful with --etcd"),
            (["--etcd", "http://127.0.0.1:2379", "--etcd-prefix", "llmgw"], "--etcd-prefix"),
            (["--etcd", "http://127.0.0.1:2379", "--etcd-ttl", "1"], "--etcd-ttl"),
        ]:
            with self.assertRaises(UsageError) as cm:
                self.parse(*args)
            self.assertIn(words, str(cm.exception), args)


class _Listener:
    """What L{admin_url_to_publish} reads of an admin listener."""

    def __init__(self, host: str, port: int, tls: bool = False):
        self.port = object()
        self.tls = tls
        self._address = (host, port)

    def address(self) -> tuple[str, int]:
        return self._address


class _Control:
    def __init__(self, listener: _Listener | None):
        self.admin_listener = listener


class AdminURLTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeEtcd(self.reactor)

    def test_what_is_published(self) -> None:
        """
        --advertise-admin is published as given; without it, the admin
        listener's bound host and port with the scheme it serves; a listener
        on every address, or none, publishes nothing and says why, naming
        --advertise-admin.
        """
        from llmgw.control.service import admin_url_to_publish

        self.assertEqual(admin_url_to_publish(_Control(_Listener("0.0.0.0", 1)), "https://cp.example:7480"),  # type: ignore[arg-type]
                         ("https://cp.example:7480", ""))
        self.assertEqual(admin_url_to_publish(_Control(_Listener("127.0.0.1", 7481)), ""),  # type: ignore[arg-type]
                         ("http://127.0.0.1:7481", ""))
        self.assertEqual(admin_url_to_publish(_Control(_Listener("10.0.0.5", 7480, tls=True)), ""),  # type: ignore[arg-type]
                         ("https://10.0.0.5:7480", ""))
        self.assertEqual(admin_url_to_publish(_Control(_Listener("::1", 7480)), ""),  # type: ignore[arg-type]
                         ("http://[::1]:7480", ""))
        for control in (_Control(_Listener("0.0.0.0", 7480)), _Control(_Listener("::", 7480)), _Control(None)):
            url, problem = admin_url_to_publish(control, "")  # type: ignore[arg-type]
            self.assertEqual(url, "")
            self.assertIn("--advertise-admin", problem)

    def member(self, name: str, published: tuple[str, str]) -> Member:
        m = Member(self.reactor, self.fake, name)
        m.ha.admin_url = lambda: published
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        self.reactor.advance(0.1)
        return m

    def test_followers_name_the_listener(self) -> None:
        """
        A leader without --advertise-admin publishes its listener's URL in
        etcd; a member that does not lead names it as the leader's admin URL
        (where its admin API sends clients).
        """
        a = self.member("a", ("http://127.0.0.1:7481", ""))
        b = self.member("b", ("http://127.0.0.1:7482", ""))
        self.assertIs(a.ha.election.role, Role.LEADER)
        st = b.ha.status()
        self.assertEqual((st["role"], st["leader_id"]), ("follower", "a"))
        self.assertEqual(st["leader_admin_url"], "http://127.0.0.1:7481")
        self.assertEqual(a.ha.status()["leader_admin_url"], "http://127.0.0.1:7481")

    def test_wildcard_leader_says_why(self) -> None:
        """
        A leader with nothing to publish publishes why; the other members
        show it, and their admin API's 503 gives it (set --advertise-admin).
        """
        from llmgw.control.admin.base import Refused
        from llmgw.control.admin.leader import to_leader

        self.member("a", ("", "its admin API listens on every address: set --advertise-admin URL"))
        b = self.member("b", ("http://127.0.0.1:7482", ""))
        st = b.ha.status()
        self.assertEqual(st["leader_id"], "a")
        self.assertEqual(st["leader_admin_url"], "")
        self.assertIn("--advertise-admin", st["leader_admin_problem"])

        class Request:
            method = b"POST"
            uri = b"/api/v1/nodes/gpu-1/cordon"
            args: dict[bytes, list[bytes]] = {}

        refused = self.assertRaises(Refused, to_leader, Request(), ["api", "v1", "nodes", "gpu-1", "cordon"],
                                    b.ha, "test", Logger())
        self.assertEqual(refused.status, 503)
        self.assertIn("listens on every address: set --advertise-admin", str(refused))


class CatalogFileCheckTests(EtcdLogCase):

    def member(self, name: str, catalog_file: str) -> Member:
        m = Member(self.reactor, self.fake, name, catalog_file=catalog_file)
        m.ha.startService()
        self.addCleanup(m.ha.stopService)
        self.reactor.advance(0.1)
        return m

    def events(self, m: Member) -> list[Any]:
        return [e for e in m.reconciler.event_log if e.kind == "catalog_file_differs"]

    def test_follower_with_a_different_file_says_so(self) -> None:
        """
        A member that does not lead, started with a catalog file that
        differs from etcd's, logs a warning, shows it in its status and
        records an event; the leader with the same file as etcd's shows no
        difference.
        """
        a = self.member("a", self.file(DEMO))
        b = self.member("b", self.file(DEMO.replace(b"replicas = 2", b"replicas = 4")))
        self.assertIs(b.ha.election.role, Role.FOLLOWER)
        self.assertEqual(a.ha.status()["catalog_file"]["differs_from_etcd"], False)
        self.assertEqual(self.events(a), [])
        st = b.ha.status()["catalog_file"]
        self.assertEqual(st["differs_from_etcd"], True)
        self.assertEqual(st["etcd_revision"], self.fake.kvs[catalog_key("/llmgw")].mod_revision)
        self.assertEqual(len(self.events(b)), 1)
        self.assertIn("llmgw ctl catalog apply", self.events(b)[0].reason)
        self.assertEqual(len([line for line in self.logged if "differs from the catalog in etcd" in line]), 1)

    def test_said_again_when_etcd_changes(self) -> None:
        """
        A change of etcd's catalog is compared again: one that now matches
        the file clears the field (and says so), one that differs again is
        another warning and event. Spacing and comments are no difference.
        """
        own = DEMO.replace(b"replicas = 2", b"replicas = 4")
        self.member("a", self.file(DEMO))
        b = self.member("b", self.file(own))
        self.fake.put(catalog_key("/llmgw"), b"# applied by hand\n" + own.replace(b"replicas = 4", b"replicas    = 4"))
        self.assertEqual(b.ha.status()["catalog_file"]["differs_from_etcd"], False)
        self.assertTrue([line for line in self.logged if "now says what the catalog in etcd says" in line])
        self.fake.put(catalog_key("/llmgw"), DEMO)
        self.assertEqual(b.ha.status()["catalog_file"]["differs_from_etcd"], True)
        self.assertEqual(len(self.events(b)), 2)

    def test_no_file_no_field(self) -> None:
        """
        A member without --catalog has nothing to compare: the field is
        None, and an etcd without a catalog leaves the answer unknown.
        """
        a = Member(self.reactor, self.fake, "a")
        self.assertIsNone(a.ha.status()["catalog_file"])
        b = self.member("b", self.file(DEMO))
        # b leads and seeds etcd from its file: the same.
        self.assertEqual(b.ha.status()["catalog_file"]["differs_from_etcd"], False)
