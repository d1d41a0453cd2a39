"""
Tests for L{llmgw.reactor}: Twisted's own reactor test suites run against
L{llmgw.reactor.LeanEPollReactor}; its C{afterEvents}; how it dispatches
events when a handler fails; and how twistd picks it (C{--reactor
llmgw-epoll}, the default of C{twistd llmgw gateway} alone).

Every test that runs the reactor is bounded (L{_Bounded}): the reactor
is stopped and the test fails after L{REACTOR_TEST_TIMEOUT} seconds (a
broken read path spins: epoll keeps reporting the socket nobody reads);
the process ends itself, with every thread's traceback, after
L{WATCHDOG_S} (a loop that never comes back to its timers); and TERM ends
it while a reactor under test runs (the reactor's own handler would only
stop that reactor, and trial would go on to the next test).

Everything built on Twisted's C{ReactorBuilder} is skipped (by it) where
epoll is missing, since C{llmgw.reactor.LeanEPollReactor} then does not
exist.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from twisted.internet import error, reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.test import test_core, test_fdset, test_tcp, test_threads, test_time
from twisted.internet.test.reactormixins import ReactorBuilder
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python import log as legacy_log
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

try:
    from llmgw import reactor as lean_reactor
except ImportError:  # no epoll (not Linux): llmgw.reactor does not import
    lean_reactor = None  # type: ignore[assignment]

try:
    from twisted.internet.test import test_process
except ImportError as e:  # it needs PyHamcrest, not one of llmgw's dependencies
    test_process = None  # type: ignore[assignment]
    _NO_PROCESS_TESTS = f"twisted.internet.test.test_process cannot be imported: {e}"

LEAN = "llmgw.reactor.LeanEPollReactor"
EPOLL = "twisted.internet.epollreactor.EPollReactor"
ROOT = Path(__file__).resolve().parent.parent

#: Seconds a test may run a reactor (C{runReactor}'s timeout, which
#: trial's C{timeout} attribute sets): every test here takes well under
#: one, so a reactor that stops reading fails in seconds, not trial's 120.
REACTOR_TEST_TIMEOUT = 10
#: Seconds after which a test's process is ended outright, by
#: faulthandler's watchdog: a C thread, which needs neither the reactor
#: nor the GIL, so it ends a loop that never returns.
WATCHDOG_S = 45


class _Bounded:
    """
    A mixin for test classes that run a reactor: see the module's
    docstring.
    """

    timeout = REACTOR_TEST_TIMEOUT

    def setUp(self) -> None:
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        self.addCleanup(faulthandler.cancel_dump_traceback_later)  # type: ignore[attr-defined]
        super().setUp()  # type: ignore[misc]

    def buildReactor(self) -> Any:
        reactor = super().buildReactor()  # type: ignore[misc]
        # Read when the reactor starts running, to install its handler.
        reactor.sigTerm = _end_process
        return reactor


def _end_process(number: int, frame: Any = None) -> None:
    """
    TERM while a reactor under test runs ends the test process, as it
    would any program, rather than stopping that reactor (its own handler
    would, and trial would go on with the next test).
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# Tests of Twisted's suites that do not apply to LeanEPollReactor, and why.
_NOT_HERE = {
    "test_logPrefix": (
        "pins the legacy log context around each event, which LeanEPollReactor "
        "drops on purpose (see llmgw.reactor)"
    ),
    "test_lostFileDescriptor": (
        "epoll cannot see a descriptor closed under it; Twisted skips this test "
        "for EPollReactor by class name, which does not match its subclass"
    ),
    "test_changeUID": (
        "fails the same way on Twisted's own EPollReactor on this machine "
        "(its child, run as root with another uid, exits 1)"
    ),
}


def _not_here(reason: str) -> Any:
    def test(self: object) -> None:
        """
        Not run against LeanEPollReactor (see its skip reason).
        """

    test.skip = reason  # type: ignore[attr-defined]
    return test


def _lean(builder: type[ReactorBuilder]) -> type[ReactorBuilder]:
    """
    A subclass of C{builder} (one of Twisted's reactor test builders) that
    builds only L{llmgw.reactor.LeanEPollReactor}, named after it and
    living in this module, bounded in time (L{_Bounded}), less the tests
    in L{_NOT_HERE}.
    """
    attrs: dict[str, Any] = {"_reactors": [LEAN], "__module__": __name__}
    attrs.update({name: _not_here(why) for name, why in _NOT_HERE.items() if hasattr(builder, name)})
    return type(builder.__name__, (_Bounded, builder), attrs)


# Twisted's own suites, against our reactor. Each generated class is named
# <Builder>_LeanEPollReactorTests.
_TWISTED_BUILDERS = [
    test_tcp.TCP4ClientTestsBuilder,
    test_tcp.TCP6ClientTestsBuilder,
    test_tcp.TCPPortTestsBuilder,
    test_tcp.TCPFDPortTestsBuilder,
    test_tcp.TCPConnectionTestsBuilder,
    test_tcp.TCP4ConnectorTestsBuilder,
    test_tcp.TCP6ConnectorTestsBuilder,
    test_tcp.TCPTransportTestsBuilder,
    test_tcp.AdoptStreamConnectionTestsBuilder,
    test_tcp.TestBindAddressBuilder,
    test_tcp.AbortConnectionTests,
    test_core.SystemEventTestsBuilder,
    test_time.TimeTestsBuilder,
    test_threads.ThreadTestsBuilder,
    test_fdset.ReactorFDSetTestsBuilder,
]
if test_process is not None:
    _TWISTED_BUILDERS += [test_process.ProcessTestsBuilder, test_process.PTYProcessTestsBuilder]
else:

    class ProcessTestsBuilder_LeanEPollReactorTests(TestCase):
        """
        Twisted's process tests against LeanEPollReactor: skipped, as their
        module cannot be imported here.
        """

        skip = _NO_PROCESS_TESTS

        def test_process(self) -> None:
            """
            Stands for Twisted's process tests, which did not run.
            """

for _builder in _TWISTED_BUILDERS:
    globals().update(_lean(_builder).makeTestCaseClasses())
del _builder


@implementer(IReadDescriptor, IWriteDescriptor)
class _End:
    """
    One end of a socket pair, registered with a reactor as a reader: it
    reads what is there, records that in C{events}, then does what the test
    asked (C{on_read}), and returns what the test wants C{doRead} to return.
    """

    def __init__(self, name: str, sock: socket.socket, events: list[str]) -> None:
        self.name = name
        self.sock = sock
        self.events = events
        self.on_read: Any = None
        self.read_result: Any = None
        self.lost: list[Failure] = []
        self.lost_raises: BaseException | None = None
        self.fileno_raises = 0
        self.write_result: Any = None

    def fileno(self) -> int:
        if self.fileno_raises:
            self.fileno_raises -= 1
            raise RuntimeError(f"{self.name}: no fileno this time")
        return self.sock.fileno()

    def doRead(self) -> Any:
        self.sock.recv(65536)
        self.events.append(f"read {self.name}")
        if self.on_read is not None:
            self.on_read()
        return self.read_result

    def doWrite(self) -> Any:
        self.events.append(f"write {self.name}")
        return self.write_result

    def connectionLost(self, reason: Failure) -> None:
        self.lost.append(reason)
        if self.lost_raises is not None:
            raise self.lost_raises

    def logPrefix(self) -> str:
        return f"end-{self.name}"


class _LeanTestsMixin(_Bounded):
    """
    Helpers for tests of L{llmgw.reactor.LeanEPollReactor} on a real
    instance (built by C{ReactorBuilder}, run by its C{runReactor}, which
    fails the test if the reactor is still running after its timeout).
    """

    ends: list[_End]

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.ends = []

    def end(self, reactor: Any, name: str, events: list[str], readable: bool = True) -> _End:
        """
        A reader registered with C{reactor}, readable (a byte waiting) if
        C{readable}; its sockets are closed when the test ends.
        """
        mine, theirs = socket.socketpair()
        for s in (mine, theirs):
            s.setblocking(False)
            self.addCleanup(s.close)  # type: ignore[attr-defined]
        if readable:
            theirs.send(b"x")
        end = _End(name, mine, events)
        reactor.addReader(end)
        self.ends.append(end)
        return end


class AfterEventsTestsBuilder(_LeanTestsMixin, ReactorBuilder):
    """
    L{llmgw.reactor.LeanEPollReactor.afterEvents}.
    """

    _reactors = [LEAN]

    def test_after_all_events_of_the_poll(self) -> None:
        """
        A function given while handling one event of a poll runs after all
        the events of that poll were handled: with two connections readable
        at once, both reads come before it, whichever was first.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        a = self.end(reactor, "a", events)
        b = self.end(reactor, "b", events)

        def first_read_asks() -> None:
            if len(events) == 1:
                reactor.afterEvents(after)

        def after() -> None:
            events.append("after")
            reactor.stop()

        a.on_read = b.on_read = first_read_asks
        self.runReactor(reactor)
        self.assertEqual(sorted(events[:2]), ["read a", "read b"])
        self.assertEqual(events[2:], ["after"])

    def test_from_timer_before_waiting(self) -> None:
        """
        A function given from a timer runs before the reactor next waits,
        not at the next I/O event: with nothing readable and no timer due
        for long, it still runs at once, and what it does (here: stopping
        the reactor) takes effect without waiting for that timeout.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        self.end(reactor, "idle", events, readable=False)

        def after() -> None:
            events.append("after")
            reactor.stop()

        reactor.callLater(0, lambda: reactor.afterEvents(after))
        # Were it to wait, the next thing to wake it is runReactor's own
        # timeout, which fails the test.
        self.runReactor(reactor)
        self.assertEqual(events, ["after"])

    def test_timer_set_by_it_runs_promptly(self) -> None:
        """
        A timer set by a function given from a timer (run before the
        reactor waits) is due at once and runs at once, not after the wait
        the reactor had worked out before that function ran.
        """
        reactor = self.buildReactor()
        events: list[str] = []

        def after() -> None:
            events.append("after")
            reactor.callLater(0, timer)

        def timer() -> None:
            events.append("timer")
            reactor.stop()

        reactor.callLater(0, lambda: reactor.afterEvents(after))
        self.runReactor(reactor)
        self.assertEqual(events, ["after", "timer"])

    def test_io_not_starved_by_timers_asking(self) -> None:
        """
        A chain of C{callLater(0)} steps each asking C{afterEvents} (as a
        step writing through C{send_now} does) does not keep the reactor
        from polling: a connection readable meanwhile is read.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        end = self.end(reactor, "a", events)
        steps = [0]

        def step() -> None:
            steps[0] += 1
            reactor.afterEvents(lambda: None)
            reactor.callLater(0, step)

        end.on_read = reactor.stop
        reactor.callLater(0, step)
        self.runReactor(reactor)
        self.assertIn("read a", events)

    def test_each_once_in_order_errors_logged(self) -> None:
        """
        Each call of afterEvents runs its function once, in the order
        given (the same function given twice runs twice); an exception
        from one is logged and the later ones still run.
        """
        reactor = self.buildReactor()
        events: list[str] = []

        def one() -> None:
            events.append("one")

        def fails() -> None:
            events.append("fails")
            1 / 0  # noqa: B018

        def two() -> None:
            events.append("two")
            # A few more turns, to show nothing runs again.
            reactor.callLater(0.05, reactor.stop)

        def give() -> None:
            for f in (one, fails, one, two):
                reactor.afterEvents(f)

        reactor.callLater(0, give)
        self.runReactor(reactor)
        self.assertEqual(events, ["one", "fails", "one", "two"])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class DispatchTestsBuilder(_LeanTestsMixin, ReactorBuilder):
    """
    How L{llmgw.reactor.LeanEPollReactor} dispatches the events of a poll
    when one handler fails.
    """

    _reactors = [LEAN]

    def setUp(self) -> None:
        super().setUp()
        self.logged: list[dict[str, Any]] = []
        legacy_log.addObserver(self.logged.append)
        self.addCleanup(legacy_log.removeObserver, self.logged.append)

    def stop_after(self, reactor: Any, *ends: _End) -> None:
        """
        Stop C{reactor} once the events of the poll that read C{ends} were
        all handled, noting first (the reactor disconnects everything as it
        stops) its readers and writers in C{self.readers} and
        C{self.writers}, and in C{self.lost} how many times each end had
        lost its connection.
        """
        def stop() -> None:
            self.readers = reactor.getReaders()
            self.writers = reactor.getWriters()
            self.lost = {end.name: len(end.lost) for end in self.ends}
            reactor.stop()

        def asked() -> None:
            if not stopping:
                stopping.append(True)
                reactor.afterEvents(stop)

        stopping: list[bool] = []
        for end in ends:
            end.on_read = asked

    def test_one_poll_reads(self) -> None:
        """
        One poll with a descriptor readable calls its C{doRead} (the inline
        read), without the loop running: a read path that stops reading
        fails here at once, not at a timeout.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        a = self.end(reactor, "a", events)
        reactor.doPoll(0)
        self.assertEqual(events, ["read a"])
        self.assertEqual(a.lost, [])
        # Read: the next poll finds nothing.
        reactor.doPoll(0)
        self.assertEqual(events, ["read a"])
        # Before its socket is closed (the cleanups run in reverse order).
        reactor.removeReader(a)

    def test_escaping_exception_logged_others_handled(self) -> None:
        """
        An exception escaping the dispatch of one event (its disconnection
        raises: C{connectionLost} fails) is logged, with that descriptor's
        log prefix as its system, and the other event of the same poll is
        still handled.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        bad = self.end(reactor, "bad", events)
        good = self.end(reactor, "good", events)
        bad.read_result = error.ConnectionLost()
        bad.lost_raises = RuntimeError("connectionLost failed")
        self.stop_after(reactor, bad, good)
        self.runReactor(reactor)
        self.assertEqual(sorted(events), ["read bad", "read good"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        errors = [e for e in self.logged if e.get("isError")]
        self.assertEqual([(e["system"], e["why"]) for e in errors],
                         [("end-bad", "Unhandled error dispatching an event")])
        self.assertNotIn(bad, self.readers)
        self.assertIn(good, self.readers)

    def test_escaping_exception_on_write_event(self) -> None:
        """
        The same holds for an event other than a plain read (a writable
        descriptor, dispatched through the epoll reactor's own handling):
        its failing disconnection is logged and the read of the same poll
        is still handled.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        bad = self.end(reactor, "bad", events, readable=False)
        reactor.removeReader(bad)
        reactor.addWriter(bad)
        good = self.end(reactor, "good", events)
        bad.write_result = error.ConnectionLost()
        bad.lost_raises = RuntimeError("connectionLost failed")
        self.stop_after(reactor, good)
        self.runReactor(reactor)
        self.assertEqual(sorted(events), ["read good", "write bad"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertNotIn(bad, self.writers)
        self.assertIn(good, self.readers)

    def test_fileno_raising(self) -> None:
        """
        A descriptor whose C{fileno()} raises when its read event is
        handled: the error is logged, that descriptor is disconnected with
        it, and the other event of the same poll is still handled.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        bad = self.end(reactor, "bad", events)
        good = self.end(reactor, "good", events)
        self.stop_after(reactor, good)
        bad.fileno_raises = 1
        self.runReactor(reactor)
        self.assertEqual(events, ["read good"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(self.lost, {"bad": 1, "good": 0})
        bad.lost[0].trap(RuntimeError)
        self.assertNotIn(bad, self.readers)
        self.assertIn(good, self.readers)

    def test_read_returning_failure_disconnects_only_it(self) -> None:
        """
        A C{doRead} that returns a failure disconnects that descriptor only
        (its C{connectionLost} gets the failure); the other one read in the
        same poll stays connected.
        """
        reactor = self.buildReactor()
        events: list[str] = []
        bad = self.end(reactor, "bad", events)
        good = self.end(reactor, "good", events)
        bad.read_result = error.ConnectionLost()
        self.stop_after(reactor, bad, good)
        self.runReactor(reactor)
        self.assertEqual(sorted(events), ["read bad", "read good"])
        self.assertEqual(self.lost, {"bad": 1, "good": 0})
        bad.lost[0].trap(error.ConnectionLost)
        self.assertNotIn(bad, self.readers)
        self.assertIn(good, self.readers)


globals().update(AfterEventsTestsBuilder.makeTestCaseClasses())
globals().update(DispatchTestsBuilder.makeTestCaseClasses())


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")}


_OPTIONS_REACTOR = (
    "from llmgw import tap\n"
    "make = {{name: make for name, _, make, _ in tap.Options.subCommands}}[{kind!r}]\n"
    "make()\n"
    "from twisted.internet import reactor\n"
    "print(type(reactor).__module__ + '.' + type(reactor).__qualname__)\n"
)

#: Each kind's command line, on loopback, for as long as it takes to log
#: its reactor class.
_KIND_ARGS = {
    "gateway": ["--gateway", "127.0.0.1:0", "--metrics", "off", "--admin-url", "http://127.0.0.1:1"],
    "control": ["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--gateway", "off"],
}


class _WaitForLine(ProcessProtocol):
    """
    Collects a process's output, and kills it once C{line} appears in it.
    """

    def __init__(self, line: bytes) -> None:
        self.line = line
        self.out = b""
        self.seen = False
        self.ended: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if not self.seen and self.line in self.out:
            self.seen = True
            self.transport.signalProcess("KILL")

    errReceived = outReceived

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


class TwistdReactorTests(TestCase):
    """
    How twistd picks the reactor: C{--reactor llmgw-epoll} (the dropin
    C{twisted/plugins/llmgw_reactors.py}), by default for C{twistd llmgw
    gateway} alone; each in a fresh process.
    """

    timeout = 60

    def setUp(self) -> None:
        if sys.platform != "linux":
            self.skipTest("no epoll here")

    @inlineCallbacks
    def python(self, *args: str) -> Any:
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, args, env=_env(), path=self.mktemp_dir(), reactor=reactor,
        )
        self.assertEqual(code, 0, err)
        return out.decode()

    def mktemp_dir(self) -> str:
        path = Path(self.mktemp())
        path.mkdir(parents=True)
        return str(path)

    @inlineCallbacks
    def test_help_reactors_lists_it(self) -> Any:
        """
        C{twistd --help-reactors} lists C{llmgw-epoll} as available (not
        marked as missing a dependency).
        """
        out = yield self.python("-c", "from twisted.scripts.twistd import run; run()", "--help-reactors")
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        self.assertIn("llmgw-epoll", names)

    @inlineCallbacks
    def options_reactor(self, kind: str) -> Any:
        """
        The reactor a fresh Python has after building C{kind}'s Options
        as C{twistd llmgw KIND} does, then importing the global reactor.
        """
        return (yield self.python("-c", _OPTIONS_REACTOR.format(kind=kind))).strip()

    @inlineCallbacks
    def test_other_kinds_options_install_nothing(self) -> Any:
        """
        Building the control plane's, an agent's or the local fleet's
        Options installs no reactor of llmgw's: the global one is then
        Twisted's default (epoll on Linux). The gateway's installs ours.
        """
        for kind in ("control", "agent", "local"):
            self.assertEqual((kind, (yield self.options_reactor(kind))), (kind, EPOLL))
        self.assertEqual((yield self.options_reactor("gateway")), LEAN)

    @inlineCallbacks
    def twistd_reactor(self, kind: str, *twistd_options: str) -> Any:
        """
        Run C{twistd llmgw KIND} on loopback until its log names its
        reactor class (at most 15 s), kill it, and return that class name.
        """
        p = _WaitForLine(b"reactor class: ")
        argv = [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
            "-n", "--logfile=-", "--pidfile=", *twistd_options, "llmgw", kind, *_KIND_ARGS[kind],
        ]
        proc = reactor.spawnProcess(p, sys.executable, argv, env=_env(), path=self.mktemp_dir())
        bound = reactor.callLater(15, proc.signalProcess, "KILL")
        yield p.ended
        if bound.active():
            bound.cancel()
        text = p.out.decode("utf-8", "replace")
        self.assertTrue(p.seen, f"no reactor class line within 15 s:\n{text}")
        for line in text.splitlines():
            if "reactor class: " in line:
                return line.split("reactor class: ", 1)[1].rstrip(".")
        raise AssertionError(text)  # seen, so not reached

    @inlineCallbacks
    def test_twistd_gateway_runs_on_it(self) -> Any:
        """
        C{twistd llmgw gateway} (no --reactor) runs on LeanEPollReactor,
        and twistd's start-up line says so.
        """
        self.assertEqual((yield self.twistd_reactor("gateway")), LEAN)

    @inlineCallbacks
    def test_twistd_reactor_option_wins(self) -> Any:
        """
        C{twistd --reactor=poll llmgw gateway} runs on the poll reactor,
        not ours.
        """
        self.assertEqual((yield self.twistd_reactor("gateway", "--reactor=poll")),
                         "twisted.internet.pollreactor.PollReactor")

    @inlineCallbacks
    def test_twistd_control_runs_on_twisted_default(self) -> Any:
        """
        C{twistd llmgw control} (no --reactor) runs on Twisted's default
        reactor, not ours.
        """
        self.assertEqual((yield self.twistd_reactor("control")), EPOLL)

    @inlineCallbacks
    def test_reactor_option_picks_it_for_control(self) -> Any:
        """
        C{twistd --reactor llmgw-epoll llmgw control} runs the control
        plane on LeanEPollReactor.
        """
        self.assertEqual((yield self.twistd_reactor("control", "--reactor", "llmgw-epoll")), LEAN)


class SuitesBuildOursTests(SynchronousTestCase):
    """
    The Twisted suites in this module run against our reactor.
    """

    def test_every_builder_builds_lean(self) -> None:
        """
        Every ReactorBuilder test class in this module (Twisted's suites and
        ours) builds LeanEPollReactor, and there is one for each of
        Twisted's builders listed here.
        """
        LeanEPollReactor = getattr(lean_reactor, "LeanEPollReactor", None)
        if LeanEPollReactor is None:
            self.skipTest("no epoll here")
        built = {name: cls for name, cls in globals().items()
                 if isinstance(cls, type) and issubclass(cls, ReactorBuilder)
                 and issubclass(cls, SynchronousTestCase)}
        expected = {f"{b.__name__}_LeanEPollReactorTests" for b in _TWISTED_BUILDERS}
        self.assertLessEqual(expected, set(built))
        for name, cls in built.items():
            self.assertIs(cls.reactorFactory, LeanEPollReactor, name)
