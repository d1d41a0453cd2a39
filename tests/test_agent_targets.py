"""
L{llmgw.agent.targets} and the agent's following of an HA control plane:
redirects to the leader at once and bounded, the other members tried on
failure, and a silent member left.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.targets import ControlTargets
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.wire import NO_LEADER_MARKER, ack, redirect_error
from tests.test_agent_client import Harness, frame


class RecordingEndpoint:
    def __init__(self, dialled: list[str], host: str, port: int):
        self.dialled = dialled
        self.address = f"{host}:{port}"

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        self.dialled.append(self.address)
        return defer.Deferred()


def targets(dialled: list[str], n: int = 3, **kw: Any) -> ControlTargets:
    return ControlTargets(
        [(f"10.0.0.{i + 1}", 7443) for i in range(n)],
        lambda host, port: RecordingEndpoint(dialled, host, port), **kw,
    )


class ControlTargetsTests(SynchronousTestCase):
    def test_failures_walk_the_members(self) -> None:
        """Each failure moves to the next configured member, round robin."""
        dialled: list[str] = []
        t = targets(dialled)
        for _ in range(4):
            t.connect(None)
            t.failed()
        self.assertEqual(dialled, ["10.0.0.1:7443", "10.0.0.2:7443", "10.0.0.3:7443", "10.0.0.1:7443"])

    def test_redirect_dialled_next_then_list_after_failure(self) -> None:
        """
        A redirect is dialled next (even an address not configured); if it
        fails, the agent goes back to the configured members.
        """
        dialled: list[str] = []
        t = targets(dialled)
        self.assertTrue(t.redirect("10.0.0.9:7443"))
        t.connect(None)
        t.failed()
        t.connect(None)
        self.assertEqual(dialled, ["10.0.0.9:7443", "10.0.0.1:7443"])

    def test_redirect_loop_bounded(self) -> None:
        """
        Redirects in a row without a registration are followed only up to
        the bound; a registration resets the count.
        """
        t = targets([], n=2, max_redirects=3)
        self.assertEqual([t.redirect("10.0.0.2:7443") for _ in range(4)], [True, True, True, False])
        t.registered()
        self.assertTrue(t.redirect("10.0.0.2:7443"))


class AgentFollowsLeaderTests(SynchronousTestCase):
    def harness(self) -> tuple[Harness, list[str]]:
        h = Harness(self)
        dialled: list[str] = []
        h.core.targets = targets(dialled)
        return h, dialled

    def test_redirect_followed_at_once_without_config_error(self) -> None:
        """
        A failed-precondition Ack naming the leader is not a configuration
        error: the next attempt goes to the leader with no delay.
        """
        h, dialled = self.harness()
        proto, transport = h.connect()
        proto.dataReceived(frame(ack(
            "register", ok=False, code=pb.Ack.CODE_FAILED_PRECONDITION,
            error=redirect_error("10.0.0.3:7443", "m3"),
        )))
        self.assertTrue(transport.disconnecting)
        proto.connectionLost(Failure(ConnectionError()))
        self.assertIsNone(h.core.config_error)
        self.assertEqual(h.core.retry_delay(1), 0.0)
        self.assertEqual(h.core.targets.current, "10.0.0.3:7443")

    def test_plain_failed_precondition_still_config_error(self) -> None:
        """A failed-precondition refusal without a leader stays a configuration error."""
        h, _ = self.harness()
        proto, _ = h.connect()
        proto.dataReceived(frame(ack(
            "register", ok=False, code=pb.Ack.CODE_FAILED_PRECONDITION, error="protocol version 9",
        )))
        proto.connectionLost(Failure(ConnectionError()))
        self.assertIsNotNone(h.core.config_error)
        self.flushLoggedErrors()

    def test_no_leader_retries_soon_elsewhere(self) -> None:
        """
        While members say none leads, the agent tries the next member at a
        fixed short delay rather than its growing backoff.
        """
        h, _ = self.harness()
        for _ in range(5):
            proto, _ = h.connect()
            proto.dataReceived(frame(ack(
                "register", ok=False, code=pb.Ack.CODE_RESOURCE_EXHAUSTED,
                error=f"{NO_LEADER_MARKER} (election under way); try another member",
            )))
            proto.connectionLost(Failure(ConnectionError()))
            self.assertEqual(h.core.retry_delay(h.core.failures), 1.0)
        self.assertEqual(h.core.targets.index, 5 % 3)

    def test_silent_member_left(self) -> None:
        """
        After a member has acknowledged heartbeats, a stream whose
        heartbeats go unacknowledged for two intervals and a second is
        aborted and the next member is tried.
        """
        h, _ = self.harness()
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        h.clock.advance(5)
        proto.dataReceived(frame(ack("heartbeat")))
        aborted: list[bool] = []
        transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
        h.clock.advance(10)
        self.assertEqual(aborted, [])
        h.clock.advance(5)
        self.assertEqual(aborted, [True])
        # The aborted stream ends; the next dial is the next member.
        proto.connectionLost(Failure(ConnectionError()))
        self.assertEqual(h.core.targets.index, 1)

    def test_lost_registered_stream_moves_on(self) -> None:
        """
        A registered stream that is lost (its member killed) makes the
        next dial go to the next member, not the one that went away.
        """
        h, _ = self.harness()
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.connectionLost(Failure(ConnectionError()))
        self.assertEqual(h.core.targets.index, 1)

    def test_member_that_never_acks_heartbeats_is_kept(self) -> None:
        """A control plane that does not acknowledge heartbeats (standalone) is never left."""
        h, _ = self.harness()
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        h.clock.advance(60)
        self.assertFalse(transport.disconnecting)


class FrozenLeaderTests(SynchronousTestCase):
    """
    A member frozen while leading (SIGSTOP: its connection open, nothing
    answered) is left within a bound of the heartbeat, at once, and not
    dialled again until another member leads.
    """

    def harness(self) -> tuple[Harness, list[str]]:
        h = Harness(self)
        dialled: list[str] = []
        h.core.targets = targets(dialled)
        h.config.control = h.core.targets.current
        return h, dialled

    def registered(self, h: Harness) -> tuple[Any, Any, list[bool]]:
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        aborted: list[bool] = []
        transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
        return proto, transport, aborted

    def test_left_at_the_bound_not_at_a_heartbeat(self) -> None:
        """
        The stream is aborted when two heartbeat intervals and a second
        have passed since the last acknowledgement (16 s after an ack at
        5 s with 5 s heartbeats), not at the heartbeat tick after that.
        """
        h, _ = self.harness()
        proto, _, aborted = self.registered(h)
        h.clock.advance(5)
        proto.dataReceived(frame(ack("heartbeat")))
        h.clock.advance(10.9)
        self.assertEqual(aborted, [])
        h.clock.advance(0.2)
        self.assertEqual(aborted, [True])

    def test_each_ack_moves_the_bound(self) -> None:
        """A member that keeps acknowledging is never left."""
        h, _ = self.harness()
        proto, _, aborted = self.registered(h)
        for _ in range(20):
            h.clock.advance(5)
            proto.dataReceived(frame(ack("heartbeat")))
        self.assertEqual(aborted, [])

    def test_next_member_at_once_and_silent_one_avoided(self) -> None:
        """
        After leaving a silent member the next is dialled with no delay; a
        redirect back to the silent member (the others name it until its
        lease runs out) is not followed but retried soon, the rotation
        passes it by, and a registration ends the avoidance.
        """
        h, _ = self.harness()
        proto, _, aborted = self.registered(h)
        proto.dataReceived(frame(ack("heartbeat")))
        h.clock.advance(11.1)
        self.assertEqual(aborted, [True])
        proto.connectionLost(Failure(ConnectionError()))
        self.assertEqual(h.core.retry_delay(1), 0.0)
        self.assertEqual(h.core.targets.current, "10.0.0.2:7443")
        # 10.0.0.2 still names the frozen 10.0.0.1 as leader.
        h.config.control = h.core.targets.current
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register", ok=False, code=pb.Ack.CODE_FAILED_PRECONDITION,
                                     error=redirect_error("10.0.0.1:7443", "m1"))))
        proto.connectionLost(Failure(ConnectionError()))
        self.assertIsNone(h.core.config_error)
        self.assertEqual(h.core.retry_delay(h.core.failures), 1.0)
        self.assertEqual(h.core.targets.current, "10.0.0.3:7443")
        h.core.targets.failed()
        # 10.0.0.1 is passed by.
        self.assertEqual(h.core.targets.current, "10.0.0.2:7443")
        # Once 10.0.0.2 leads and takes the agent, the avoidance ends.
        h.config.control = h.core.targets.current
        self.registered(h)
        self.assertIsNone(h.core.targets.silent)

    def test_silence_counts_from_registration(self) -> None:
        """
        On a later stream to a control plane known to acknowledge
        heartbeats, silence counts from the registration: a leader frozen
        before its first acknowledgement is left too.
        """
        h, _ = self.harness()
        proto, _, _ = self.registered(h)
        proto.dataReceived(frame(ack("heartbeat")))
        proto.connectionLost(Failure(ConnectionError()))
        _, _, aborted = self.registered(h)
        h.clock.advance(11.1)
        self.assertEqual(aborted, [True])

    def test_avoidance_bounded(self) -> None:
        """
        Redirects to the silent member are refused at most C{max_redirects}
        times; after that it is followed (it may lead again after all).
        """
        t = targets([], n=2, max_redirects=2)
        t.left_silent("10.0.0.1:7443")
        self.assertEqual([t.is_silent("10.0.0.1:7443") for _ in range(3)], [True, True, False])
        self.assertFalse(t.is_silent("10.0.0.2:7443"))
        self.assertIsNone(t.silent)

    def refuse_with_redirect(self, h: Harness, leader: str) -> None:
        """A stream to the current member, refused with a redirect to C{leader}."""
        h.config.control = h.core.targets.current
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register", ok=False, code=pb.Ack.CODE_FAILED_PRECONDITION,
                                     error=redirect_error(leader, "m1"))))
        proto.connectionLost(Failure(ConnectionError()))

    def test_member_still_silent_when_tried_again_left_at_the_bound(self) -> None:
        """
        Once the avoidance lapses and the redirect to the silent member is
        followed, a member still frozen (connected, no Ack) is left after
        two heartbeat intervals and a second, not the Register timeout:
        avoided again, the next member dialled at once.
        """
        h = Harness(self)
        h.core.targets = targets([], max_redirects=1)
        h.config.control = h.core.targets.current
        proto, _, aborted = self.registered(h)
        proto.dataReceived(frame(ack("heartbeat")))
        h.clock.advance(11.1)
        proto.connectionLost(Failure(ConnectionError()))
        self.refuse_with_redirect(h, "10.0.0.1:7443")
        self.refuse_with_redirect(h, "10.0.0.1:7443")
        # The second redirect is followed: 10.0.0.1 is tried again.
        self.assertEqual(h.core.targets.current, "10.0.0.1:7443")
        self.assertEqual(h.core.retry_delay(h.core.failures), 0.0)
        h.config.control = h.core.targets.current
        proto, transport = h.connect()
        again: list[bool] = []
        transport.abortConnection = lambda: again.append(True)  # type: ignore[method-assign]
        h.clock.advance(10.9)
        self.assertEqual(again, [])
        h.clock.advance(0.2)
        self.assertEqual(again, [True])
        proto.connectionLost(Failure(ConnectionError()))
        self.assertEqual(h.core.targets.silent, "10.0.0.1:7443")
        self.assertNotEqual(h.core.targets.current, "10.0.0.1:7443")
        self.assertEqual(h.core.retry_delay(h.core.failures), 0.0)

    def test_member_tried_again_that_answers_is_kept(self) -> None:
        """
        A member tried again after its avoidance lapsed that acknowledges
        the Register (woken, it leads after all) ends the probation; other
        members' Registers keep the full Register timeout.
        """
        t = targets([], n=2, max_redirects=0)
        t.left_silent("10.0.0.1:7443")
        self.assertFalse(t.is_silent("10.0.0.1:7443"))
        self.assertEqual(t.probing, "10.0.0.1:7443")
        t.registered()
        self.assertIsNone(t.probing)
        h, _ = self.harness()
        _, transport = h.connect()
        aborted: list[bool] = []
        transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
        h.clock.advance(29)
        self.assertEqual(aborted, [])
        h.clock.advance(2)
        self.assertEqual(aborted, [True])
