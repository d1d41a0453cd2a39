"""
A node given several join listeners (C{--join A,B --join C}: the members of
an HA control plane): the options, the order it asks them in with an
injected clock, and over loopback a join while the first is down; each
listener's chain is checked against the token before it is sent anything.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.agent.join import Joiner, JoinRefused, WrongControlPlane
from llmgw.agent.service import Options
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority, JoinFactory
from llmgw.control.shell.joinlisten import JoinServerTLS
from llmgw.testing.ports import free_port
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import spki_hash
from llmgw.tlsconf.jointoken import ParsedToken, parse_token, printable
from llmgw.tlsconf.options import ServerTLS, server_files

HASH = "sha256:" + "a" * 64
TOKEN = printable("0123abcd", "f" * 32, HASH)


class JoinOptionTests(SynchronousTestCase):
    def options(self, *joins: str) -> Options:
        o = Options()
        args = [a for j in joins for a in ("--join", j)]
        o.parseOptions([*args, "--token", TOKEN, "--node", "n1", "--state-dir", self.mktemp(), "--gpus", "none"])
        return o

    def test_repeated_and_comma_lists_in_order(self) -> None:
        """C{--join} given twice, one a comma list, names every listener in the order given."""
        o = self.options("10.0.0.1:7444,10.0.0.2:7444", "cp3.example:7445")
        self.assertEqual(o["joiner"].addresses,
                         [("10.0.0.1", 7444), ("10.0.0.2", 7444), ("cp3.example", 7445)])
        self.assertEqual((o["joiner"].host, o["joiner"].port), ("10.0.0.1", 7444))

    def test_one_address_as_before(self) -> None:
        """One C{--join} is the one listener asked."""
        self.assertEqual(self.options("10.0.0.1:7444")["joiner"].addresses, [("10.0.0.1", 7444)])

    def test_bad_addresses_named(self) -> None:
        """An address without a port, an empty one in a list, or one given twice is refused, naming it."""
        for joins, said in ((("10.0.0.1",), "'10.0.0.1'"), (("10.0.0.1:7444,",), "--join ''"),
                            (("10.0.0.1:7444", "10.0.0.1:7444"), "given twice")):
            with self.assertRaises(usage.UsageError) as e:
                self.options(*joins)
            self.assertIn(said, str(e.exception))


class ScriptedJoiner(Joiner):
    """A joiner whose asks are answered from a script, by address, in order."""

    def __init__(self, clock: Clock, script: dict[tuple[str, int], list[Any]], directory: Path):
        token: ParsedToken = parse_token(TOKEN)
        addresses = list(script)
        super().__init__(clock, *addresses[0], token, "n1", directory, poll_interval=10.0,
                         also=addresses[1:])
        self.script = script
        self.asked: list[tuple[str, int]] = []
        self.log = Logger(observer=lambda e: None)  # type: ignore[assignment]

    def ask_once(self) -> Deferred[pb.JoinResponse]:
        self.asked.append((self.host, self.port))
        step = self.script[(self.host, self.port)].pop(0)
        return fail(step) if isinstance(step, Exception) else succeed(step)


A, B, C = ("10.0.0.1", 7444), ("10.0.0.2", 7444), ("10.0.0.3", 7444)
DOWN = ConnectionRefusedError("refused")
PENDING = pb.JoinResponse(status=pb.JoinResponse.STATUS_PENDING)


class JoinerOrderTests(SynchronousTestCase):
    def run_joiner(self, script: dict[tuple[str, int], list[Any]]) -> tuple[ScriptedJoiner, Clock, Deferred[Any]]:
        clock = Clock()
        joiner = ScriptedJoiner(clock, script, Path(self.mktemp()))
        return joiner, clock, Deferred.fromCoroutine(joiner.run())

    def test_next_asked_at_once_when_one_is_down(self) -> None:
        """
        A listener that cannot be reached is followed at once by the next;
        a request kept for an operator is asked again at the listener that
        kept it.
        """
        joiner, clock, d = self.run_joiner({A: [DOWN], B: [PENDING, PENDING], C: []})
        self.assertEqual(joiner.asked, [A, B])
        clock.advance(10)
        self.assertEqual(joiner.asked, [A, B, B])
        d.cancel()
        self.failureResultOf(d)

    def test_whole_round_down_waits_then_goes_on(self) -> None:
        """When every listener is down the node waits the poll interval, then goes on with the next in turn."""
        joiner, clock, d = self.run_joiner({A: [DOWN, PENDING], B: [DOWN], C: [DOWN]})
        self.assertEqual(joiner.asked, [A, B, C])
        clock.advance(9)
        self.assertEqual(len(joiner.asked), 3)
        clock.advance(1)
        self.assertEqual(joiner.asked, [A, B, C, A])
        d.cancel()
        self.failureResultOf(d)

    def test_refusal_ends_the_join(self) -> None:
        """A refusal, or a chain the token does not name, ends the join: the next listener is not asked."""
        refused = pb.JoinResponse(status=pb.JoinResponse.STATUS_REFUSED, error="token used up")
        for first in (refused, WrongControlPlane("not the one this token names")):
            joiner, _, d = self.run_joiner({A: [DOWN], B: [first], C: [PENDING]})
            self.failureResultOf(d, JoinRefused)
            self.assertEqual(joiner.asked, [A, B])


class JoinAddressesLoopbackTests(TestCase):
    """Real listeners on loopback: one down, one of another CA, one that issues."""

    timeout = 30

    def listener(self, name: str) -> tuple[CertificateAuthority, TokenFile, list[str], int]:
        d = Path(self.mktemp())
        ca = CertificateAuthority.init(d, name=name)
        ca.issue_server(["127.0.0.1"])
        tls = ServerTLS(server_files(d))
        tokens = TokenFile(d / "join-tokens.json")
        received: list[str] = []
        authority = JoinAuthority(reactor, tokens, lambda: list(tls.files.roots), lambda n: False, signer_dir=d,
                                  lifetime=datetime.timedelta(minutes=1), agent_port=7443)
        original = authority.join

        def join(req: pb.JoinRequest, address: str) -> pb.JoinResponse:
            received.append(req.node_id)
            return original(req, address)

        authority.join = join  # type: ignore[method-assign]
        factory = TLSMemoryBIOFactory(JoinServerTLS(tls), False, JoinFactory(authority, reactor), clock=reactor)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return ca, tokens, received, port.getHost().port

    def token(self, ca: CertificateAuthority, tokens: TokenFile) -> ParsedToken:
        token, secret = tokens.book.create(reactor.seconds(), 3600)
        tokens.save()
        return parse_token(printable(token.id, secret, spki_hash(ca.certificate)))

    async def _past_a_dead_one(self) -> None:
        ca, tokens, received, port = self.listener("right CA")
        down = free_port()
        joiner = Joiner(reactor, "127.0.0.1", down, self.token(ca, tokens), "node-a", Path(self.mktemp()),
                        poll_interval=60, also=[("127.0.0.1", port)])
        files = await joiner.run()
        self.assertEqual(files.cert.subject.rfc4514_string(), "CN=node-a")
        self.assertEqual((joiner.port, received), (port, ["node-a"]))

    def test_joins_past_a_listener_that_is_down(self) -> None:
        """The first listener down, the node joins at the second without waiting a poll interval."""
        return Deferred.fromCoroutine(self._past_a_dead_one())

    async def _wrong_first(self) -> None:
        ca, tokens, received, port = self.listener("right CA")
        _, _, wrong_received, wrong = self.listener("another CA")
        joiner = Joiner(reactor, "127.0.0.1", wrong, self.token(ca, tokens), "node-b", Path(self.mktemp()),
                        poll_interval=60, also=[("127.0.0.1", port)])
        with self.assertRaises(WrongControlPlane):
            await joiner.run()
        self.assertEqual((wrong_received, received), ([], []))

    def test_each_listener_checked_before_sending(self) -> None:
        """A listener whose chain the token does not name receives nothing, and the join ends there."""
        return Deferred.fromCoroutine(self._wrong_first())
