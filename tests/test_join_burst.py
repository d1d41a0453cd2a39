"""
Nodes joining or renewing by the hundred: join connections past the served
bound wait unread rather than being closed, the token book's writes leave
the reactor and coalesce (a join is answered once its use is on disk),
certificate requests are decided a few milliseconds of the reactor at a
time, and the signer's CA is read again only when its files change.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority, JoinFactory, certificate_requested
from llmgw.control.shell.signqueue import SigningQueue
from llmgw.control.shell.tokenwrites import TokenWrites
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import new_request

NOW = 1_700_000_000.0


def frame(msg: Any) -> bytes:
    data = msg.SerializeToString()
    return struct.pack("!I", len(data)) + data


def answers(transport: StringTransport) -> list[pb.JoinResponse]:
    data, out = transport.value(), []
    while len(data) >= 4:
        (n,) = struct.unpack("!I", data[:4])
        out.append(pb.JoinResponse.FromString(data[4 : 4 + n]))
        data = data[4 + n :]
    return out


class Threads:
    """Stands in for a thread pool: runs nothing until the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[[], None], Deferred[None]]] = []

    def __call__(self, f: Callable[[], None]) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self.calls.append((f, d))
        return d

    def finish(self, fail: bool = False) -> None:
        f, d = self.calls.pop(0)
        if fail:
            d.errback(Failure(OSError("disk full")))
        else:
            d.callback(f())


class Base(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.ca.issue_server(["127.0.0.1"])
        self.clock = Clock()
        self.clock.advance(NOW)
        self.tokens = TokenFile(self.dir / "join-tokens.json")
        self.token, self.secret = self.tokens.book.create(NOW, 3600, uses=100)
        self.tokens.save()
        self.threads = Threads()

    def authority(self, in_thread: Any = None) -> JoinAuthority:
        roots = list(self.ca.roots)
        return JoinAuthority(self.clock, self.tokens, lambda: roots, lambda n: False, signer_dir=self.dir,
                             lifetime=datetime.timedelta(hours=1), in_thread=in_thread)

    def request(self, name: str) -> pb.JoinRequest:
        return pb.JoinRequest(token_id=self.token.id, token_secret=self.secret, node_id=name,
                              csr_pem=new_request(name)[1])


class ListenerBoundTests(Base):
    def connect(self, factory: JoinFactory) -> tuple[Any, StringTransport]:
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def test_past_the_bound_waits_unread_then_served(self) -> None:
        """A connection past max_connections is paused, not closed, and is served (read again) when one closes."""
        factory = JoinFactory(self.authority(), self.clock, max_connections=2, max_waiting=5)
        (p1, t1), (p2, t2), (p3, t3) = (self.connect(factory) for _ in range(3))
        self.assertEqual(t3.producerState, "paused")
        self.assertFalse(t3.disconnecting)
        self.assertEqual(factory.waited, 1)
        p3.dataReceived(frame(self.request("n3")))
        self.assertEqual(answers(t3), [])
        p1.connectionLost(Failure(ConnectionError()))
        self.assertEqual(t3.producerState, "producing")
        self.assertIn(p3, factory.serving)

    def test_oldest_waiting_first_and_bounded(self) -> None:
        """Waiting connections are served oldest first; past max_waiting a new one is closed at accept."""
        factory = JoinFactory(self.authority(), self.clock, max_connections=1, max_waiting=2)
        p1, _ = self.connect(factory)
        p2, t2 = self.connect(factory)
        p3, t3 = self.connect(factory)
        _, t4 = self.connect(factory)
        self.assertTrue(t4.disconnected or t4.disconnecting)
        p1.connectionLost(Failure(ConnectionError()))
        self.assertEqual((t2.producerState, t3.producerState), ("producing", "paused"))

    def test_waiting_one_that_closes_leaves_the_queue(self) -> None:
        """A waiting connection that closes is never served."""
        factory = JoinFactory(self.authority(), self.clock, max_connections=1, max_waiting=2)
        p1, _ = self.connect(factory)
        p2, _ = self.connect(factory)
        p2.connectionLost(Failure(ConnectionError()))
        p1.connectionLost(Failure(ConnectionError()))
        self.assertEqual(factory.serving, set())

    def test_answer_waits_for_the_token_write(self) -> None:
        """A join's answer is sent only once the token book's write that records its use is done."""
        factory = JoinFactory(self.authority(self.threads), self.clock)
        proto, transport = self.connect(factory)
        proto.dataReceived(frame(self.request("n1")))
        self.assertEqual(answers(transport), [])
        self.threads.finish()
        [answer] = answers(transport)
        self.assertEqual(answer.status, pb.JoinResponse.STATUS_ISSUED)
        again = TokenFile(self.tokens.path)
        again.load()
        self.assertEqual(again.book.tokens[self.token.id].used, 1)

    def test_closed_before_the_write_ends(self) -> None:
        """A join connection that closes while its token write is under way is not written to."""
        factory = JoinFactory(self.authority(self.threads), self.clock)
        proto, transport = self.connect(factory)
        proto.dataReceived(frame(self.request("n1")))
        proto.connectionLost(Failure(ConnectionError()))
        self.threads.finish()
        self.assertEqual(answers(transport), [])

    def test_failed_write_refuses(self) -> None:
        """A join whose token use cannot be written is refused with a reason, not left hanging."""
        factory = JoinFactory(self.authority(self.threads), self.clock)
        proto, transport = self.connect(factory)
        proto.dataReceived(frame(self.request("n1")))
        self.threads.finish(fail=True)
        [answer] = answers(transport)
        self.assertEqual(answer.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("could not record", answer.error)
        self.flushLoggedErrors()

    def test_answers_counted_as_sent(self) -> None:
        """Each answer the listener sends is counted by its outcome, once sent: a join refused after its write failed counts as refused."""
        auth = self.authority(self.threads)
        factory = JoinFactory(auth, self.clock)
        ok, bad, failed = (self.connect(factory) for _ in range(3))
        ok[0].dataReceived(frame(self.request("n1")))
        bad[0].dataReceived(frame(pb.JoinRequest(token_id=self.token.id, token_secret="wrong", node_id="n2",
                                                 csr_pem=new_request("n2")[1])))
        self.assertEqual(auth.answers, {("join", "refused"): 1})
        self.threads.finish()
        self.clock.advance(1)  # past the group commit's window
        failed[0].dataReceived(frame(self.request("n3")))
        self.threads.finish(fail=True)
        self.assertEqual(auth.answers, {("join", "issued"): 1, ("join", "refused"): 2})
        self.flushLoggedErrors()


class GroupCommitTests(Base):
    """Token uses and issued.jsonl lines written together, at most one commit per window."""

    def writes(self) -> TokenWrites:
        return TokenWrites(self.tokens, self.threads, self.clock, window=0.02)

    def test_lone_change_written_at_once(self) -> None:
        """After a quiet window, a change starts its commit at once: a lone join waits for no timer."""
        writes = self.writes()
        writes.save()
        self.assertEqual(len(self.threads.calls), 1)
        self.threads.finish()
        self.clock.advance(1)
        writes.save()
        self.assertEqual(len(self.threads.calls), 1)

    def test_window_gathers_a_burst(self) -> None:
        """Changes within the window of the last commit's start wait for its end and go into one commit."""
        writes = self.writes()
        writes.save()
        self.threads.finish()
        waiters = []
        for _ in range(5):
            self.clock.advance(0.002)
            writes.save()
            waiters.append(writes.written())
        self.assertEqual(self.threads.calls, [])
        self.clock.advance(0.01)
        self.assertEqual(len(self.threads.calls), 1)
        self.threads.finish()
        for d in waiters:
            self.successResultOf(d)
        self.assertEqual((writes.writes, writes.busy), (2, False))

    def test_issued_lines_in_the_commit(self) -> None:
        """A recorded line is appended (and the book written) by the commit its waiters wait for, not before."""
        writes = self.writes()
        issued = self.dir / "issued.jsonl"
        before = issued.read_text()
        writes.record(issued, '{"serial": "ab"}\n')
        writes.record(issued, '{"serial": "cd"}\n')
        self.tokens.book.use(self.token.id, "n1")
        writes.save()
        d = writes.written()
        self.assertEqual(issued.read_text(), before)
        self.threads.finish()
        self.successResultOf(d)
        self.assertEqual(issued.read_text(), before + '{"serial": "ab"}\n{"serial": "cd"}\n')
        again = TokenFile(self.tokens.path)
        again.load()
        self.assertEqual(again.book.tokens[self.token.id].used, 1)

    def test_unappendable_line_logged_not_failed(self) -> None:
        """A line that cannot be appended is logged with the file and the line itself (the serial); the join still gets its answer."""
        events: list[dict[str, Any]] = []
        writes = self.writes()
        writes.log = Logger(observer=events.append)
        writes.record(self.dir / "missing" / "issued.jsonl", '{"serial": "ab12"}\n')
        writes.save()
        d = writes.written()
        self.threads.finish()
        self.successResultOf(d)
        [event] = [e for e in events if e["log_level"] == LogLevel.error]
        self.assertIn("missing/issued.jsonl", event["error"])
        self.assertIn('"serial": "ab12"', event["error"])

    def test_unappendable_line_logged_when_the_book_fails_too(self) -> None:
        """A line that cannot be appended is logged even when the token book's write fails as well; the waiters fail."""
        events: list[dict[str, Any]] = []
        writes = self.writes()
        writes.log = Logger(observer=events.append)

        def full(text: str) -> None:
            raise OSError(28, "No space left on device")

        self.patch(self.tokens, "write", full)
        writes.record(self.dir / "missing" / "issued.jsonl", '{"serial": "ef34"}\n')
        writes.save()
        d = writes.written()
        self.threads.finish()
        self.failureResultOf(d, OSError)
        [event] = [e for e in events if e["log_level"] == LogLevel.error]
        self.assertIn('"serial": "ef34"', event["error"])

    def test_join_answered_after_its_record(self) -> None:
        """A join's issued.jsonl line is on disk when its answer is sent, in the commit of its token's use."""
        factory = JoinFactory(self.authority(self.threads), self.clock)
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(frame(self.request("n1")))
        issued = (self.dir / "issued.jsonl").read_text()
        self.assertNotIn("CN=n1", issued)
        self.assertEqual(len(self.threads.calls), 1)
        self.threads.finish()
        [answer] = answers(transport)
        self.assertEqual(answer.status, pb.JoinResponse.STATUS_ISSUED)
        self.assertIn("CN=n1", (self.dir / "issued.jsonl").read_text())


class TokenWritesTests(Base):
    def test_burst_coalesced(self) -> None:
        """Changes made while a write is under way go into one next write, and each waiter fires after its own."""
        writes = TokenWrites(self.tokens, self.threads)
        writes.save()
        first = writes.written()
        for _ in range(5):
            writes.save()
        second = writes.written()
        self.assertEqual(len(self.threads.calls), 1)
        self.threads.finish()
        self.successResultOf(first)
        self.assertNoResult(second)
        self.assertEqual(len(self.threads.calls), 1)
        self.threads.finish()
        self.successResultOf(second)
        self.assertEqual((writes.writes, writes.busy), (2, False))

    def test_failure_reported_and_written_again(self) -> None:
        """A failed write fails its waiters; the change is written again for the next one that waits."""
        writes = TokenWrites(self.tokens, self.threads)
        writes.save()
        d = writes.written()
        self.threads.finish(fail=True)
        self.failureResultOf(d, OSError)
        self.assertTrue(writes.busy)
        again = writes.written()
        self.threads.finish()
        self.successResultOf(again)

    def test_without_a_thread_written_at_once(self) -> None:
        """Without a thread to write in, save writes at once and written has already fired."""
        writes = TokenWrites(self.tokens)
        self.tokens.book.use(self.token.id, "n1")
        writes.save()
        self.successResultOf(writes.written())
        again = TokenFile(self.tokens.path)
        again.load()
        self.assertEqual(again.book.tokens[self.token.id].used, 1)


class SigningQueueTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.now = [0.0]
        self.done: list[int] = []

    def turn(self) -> None:
        """One reactor turn: the calls due now, not those they schedule (Clock.advance would run those too)."""
        due = [c for c in self.clock.getDelayedCalls() if c.getTime() <= self.clock.seconds()]
        for c in due:
            self.clock.calls.remove(c)
            c.func(*c.args, **c.kw)

    def work(self, i: int, cost: float = 0.002) -> Callable[[], None]:
        def run() -> None:
            self.now[0] += cost
            self.done.append(i)

        return run

    def test_budget_per_turn(self) -> None:
        """Work runs at once while the turn's budget lasts; the rest waits, in order, a budget's worth a turn."""
        q = SigningQueue(self.clock, budget=0.005, timer=lambda: self.now[0])
        for i in range(7):
            self.assertTrue(q.submit(self.work(i)))
        self.assertEqual(self.done, [0, 1, 2])
        self.turn()
        self.assertEqual(self.done, [0, 1, 2, 3, 4, 5])
        self.turn()
        self.assertEqual(self.done, list(range(7)))
        self.turn()
        self.assertTrue(q.submit(self.work(7)))
        self.assertEqual(self.done[-1], 7)

    def test_bounded(self) -> None:
        """Past max_waiting, submit says no and runs nothing."""
        q = SigningQueue(self.clock, budget=0.001, max_waiting=2, timer=lambda: self.now[0])
        self.assertTrue(q.submit(self.work(0)))
        self.assertTrue(q.submit(self.work(1)))
        self.assertTrue(q.submit(self.work(2)))
        self.assertFalse(q.submit(self.work(3)))
        self.assertEqual(len(q), 2)

    def test_failure_logged_queue_goes_on(self) -> None:
        """A piece of work that raises is logged, and the next still runs."""
        q = SigningQueue(self.clock, timer=lambda: self.now[0])

        def boom() -> None:
            raise RuntimeError("boom")

        q.submit(boom)
        q.submit(self.work(1))
        self.assertEqual(self.done, [1])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class Stream:
    """What certificate_requested reads of a stream, and what it sends."""

    def __init__(self, factory: Any, node_id: str) -> None:
        self.factory = factory
        self.node_id = node_id
        self.certificate_serial = 1
        self.sent: list[Any] = []
        from twisted.logger import Logger

        self.log = Logger()

    def peer_name(self) -> str:
        return "10.0.0.9:1"

    def send_message(self, msg: Any) -> None:
        self.sent.append(msg)

    def send_command(self, msg: Any, force: bool = False) -> None:
        self.sent.append(msg)


class Service:
    def __init__(self, joining: JoinAuthority) -> None:
        self.joining = joining
        self.streams: dict[str, Stream] = {}

    def stream(self, node_id: str) -> Stream | None:
        return self.streams.get(node_id)


class RenewalQueueTests(Base):
    def setUp(self) -> None:
        super().setUp()
        self.auth = self.authority()
        self.service = Service(self.auth)

    def stream(self, name: str) -> Stream:
        s = Stream(self.service, name)
        self.service.streams[name] = s
        return s

    def ask(self, s: Stream) -> None:
        certificate_requested(s, pb.CertificateRequest(csr_pem=new_request(s.node_id)[1]))

    def test_queued_then_issued(self) -> None:
        """A renewal that has to wait its turn is issued in a later turn."""
        self.auth.queue.budget = 0.0  # every request waits a turn
        s = self.stream("n1")
        self.ask(s)
        self.assertEqual(s.sent, [])
        self.clock.advance(0)
        self.assertEqual([m.WhichOneof("msg") for m in s.sent], ["certificate_issued"])

    def test_gone_stream_not_signed(self) -> None:
        """A renewal whose stream is no longer its node's by its turn is dropped unsigned (the node asks again)."""
        self.auth.queue.budget = 0.0
        s = self.stream("n1")
        self.ask(s)
        self.stream("n1")  # a newer stream for the same node
        self.clock.advance(0)
        self.assertEqual(s.sent, [])
        self.assertFalse((self.dir / "issued.jsonl").exists() and "n1" in (self.dir / "issued.jsonl").read_text())

    def test_issued_only_once_recorded(self) -> None:
        """A renewed certificate is sent once its issued.jsonl line is on disk (so it can be revoked by name), not before."""
        self.auth = self.authority(in_thread=self.threads)
        self.service = Service(self.auth)
        s = self.stream("n1")
        self.ask(s)
        issued = self.dir / "issued.jsonl"
        self.assertEqual(s.sent, [])
        self.assertFalse(issued.exists() and "CN=n1" in issued.read_text())
        self.assertEqual(self.auth.answers, {})
        self.threads.finish()
        self.assertEqual(self.auth.answers, {("renewal", "issued"): 1})
        [msg] = s.sent
        serial = format(x509.load_pem_x509_certificate(msg.certificate_issued.certificate_pem).serial_number, "x")
        self.assertIn(f'"serial": "{serial}"', issued.read_text())

    def test_gone_while_recorded_not_sent(self) -> None:
        """A stream replaced while its renewal's line was written gets nothing; the line stays (the certificate exists)."""
        self.auth = self.authority(in_thread=self.threads)
        self.service = Service(self.auth)
        s = self.stream("n1")
        self.ask(s)
        self.stream("n1")
        self.threads.finish()
        self.assertEqual(s.sent, [])
        self.assertIn("CN=n1", (self.dir / "issued.jsonl").read_text())

    def test_full_queue_turned_away(self) -> None:
        """Past the queue's bound a renewal gets a RESOURCE_EXHAUSTED Ack at once, to ask again later."""
        self.auth.queue.budget = 0.0
        self.auth.queue.max_waiting = 1
        a, b = self.stream("n1"), self.stream("n2")
        self.ask(a)
        self.ask(b)
        [ack] = b.sent
        self.assertEqual(ack.ack.code, pb.Ack.CODE_RESOURCE_EXHAUSTED)
        self.assertFalse(ack.ack.ok)
        self.assertEqual(self.auth.answers, {("renewal", "refused"): 1})


class SignerCacheTests(Base):
    def test_loaded_again_only_after_a_change(self) -> None:
        """The signer's CA is read once for many requests, and again once a rollover rewrites its files."""
        loads: list[Path] = []
        real = CertificateAuthority.load

        def counting(directory: Any) -> CertificateAuthority:
            loads.append(Path(directory))
            return real(directory)

        self.patch(CertificateAuthority, "load", staticmethod(counting))
        roots: list[Any] = list(self.ca.roots)
        auth = JoinAuthority(self.clock, self.tokens, lambda: roots, lambda n: False, signer_dir=self.dir)
        for name in ("n1", "n2", "n3"):
            auth.renew(name, None, new_request(name)[1], "a")
        self.assertEqual(len(loads), 1)
        ca = real(self.dir)
        new_root = ca.rotate()
        roots[:] = [new_root, *roots]
        issued = auth.renew("n4", None, new_request("n4")[1], "a")
        self.assertEqual(len(loads), 2)
        assert issued is not None
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(issued.certificate_pem)
        self.assertEqual(cert.issuer, new_root.subject)


class JoinerDialTests(SynchronousTestCase):
    def test_address_dialled_without_a_resolver(self) -> None:
        """A join listener given as an address is dialled at once, with no name lookup (no thread)."""
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.agent.join import Joiner
        from llmgw.tlsconf.jointoken import ParsedToken

        for host in ("127.0.0.1", "[::1]"):
            reactor = MemoryReactorClock()
            token = ParsedToken("0123abcd", "f" * 32, "sha256:" + "a" * 64)
            joiner = Joiner(reactor, host, 7444, token, "n1", Path(self.mktemp()))
            joiner.ask_once()
            [(dialled, port, *_)] = reactor.tcpClients
            self.assertEqual((dialled, port), (host.strip("[]"), 7444))


class OpenFilesTests(SynchronousTestCase):
    def test_join_listener_counted(self) -> None:
        """With --join-listen, the join listener's served and waiting connections count in the open-file check."""
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.control.service import Options, makeService
        from llmgw.control.shell.joining import MAX_JOIN_CONNECTIONS, MAX_JOIN_WAITING

        certs = Path(self.mktemp())
        CertificateAuthority.init(certs).issue_server(["127.0.0.1"])

        def needs(*args: str) -> dict[str, int]:
            o = Options()
            o.parseOptions(["--certs", str(certs), "--agents", "127.0.0.1:0", "--admin", "off", *args])
            cp = makeService(o, reactor=MemoryReactorClock())
            return {n.what: n.count for n in cp.fd_needs()}

        self.assertNotIn("the join listener's connections", needs())
        self.assertEqual(needs("--join-listen", "127.0.0.1:0")["the join listener's connections"],
                         MAX_JOIN_CONNECTIONS + MAX_JOIN_WAITING)
