"""
The gateway's own verdict on a replica that stopped sending first bytes
(L{llmgw.gateway.firstbyte}), on a Clock with fake requests: the bound, the
contrast with other replicas, the bench and the move; and the embedded
gateway moving requests off a replica that left the control plane's table.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.firstbyte import FirstByteWatch
from llmgw.gateway.router import Router
from llmgw.gateway.service import GatewayService
from llmgw.gateway.unstarted import Unstarted
from llmgw.routing import Route, RoutingTable


class Call:
    def __init__(self, model: str, sent_at: float) -> None:
        self.model = model
        self.sent_at = sent_at
        self.moved = 0

    def replica_left(self) -> None:
        self.moved += 1


class WatchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.unstarted = Unstarted()
        self.router = Router(self.clock, failure_threshold=3, cooldown=10)
        self.registry = CollectorRegistry()
        self.watch = FirstByteWatch(self.clock, self.unstarted, self.router.bench, self.registry)
        self.unstarted.on_answer = self.watch.answered

    def send(self, replica: str, n: int, model: str = "m") -> list[Call]:
        calls = [Call(model, self.clock.seconds()) for _ in range(n)]
        for call in calls:
            self.unstarted.add(replica, call)
        return calls

    def answer(self, replica: str, after: float = 0.1, model: str = "m") -> None:
        [call] = self.send(replica, 1, model)
        self.clock.advance(after)
        self.unstarted.answered(replica, call)

    def stalled(self) -> float:
        value = self.registry.get_sample_value("llmgw_gateway_replicas_stalled_total", {"model": "m"})
        return value or 0.0

    def test_stalled_replica_benched_and_its_requests_moved(self) -> None:
        """
        Three requests waiting past the bound (5 s: the model's first bytes
        come in 0.1 s) on one replica while another replica answered within
        it: the first is benched (out of rotation), its waiting requests
        are each moved once, it is counted once; the other is untouched.
        """
        stuck = self.send("r1", 3)
        self.clock.advance(4.75)
        self.answer("r2", after=0.125)  # 4.875 s in
        self.assertEqual(self.watch.check(), [])
        self.clock.advance(0.125)
        self.assertEqual(self.watch.check(), ["r1"])
        self.assertEqual([c.moved for c in stuck], [1, 1, 1])
        self.assertTrue(self.router.cooling("r1"))
        self.assertFalse(self.router.cooling("r2"))
        self.assertEqual(self.unstarted.waiting("r1"), 0)
        self.assertEqual(self.stalled(), 1.0)
        self.assertEqual(self.watch.check(), [])
        self.assertEqual(self.stalled(), 1.0)

    def test_fewer_than_three_kept(self) -> None:
        """
        Two late requests are not enough: a slow prompt or two is no verdict.
        """
        self.send("r1", 2)
        self.clock.advance(6)
        self.answer("r2")
        self.assertEqual(self.watch.check(), [])
        self.assertFalse(self.router.cooling("r1"))

    def test_slow_everywhere_is_not_a_stall(self) -> None:
        """
        When no other replica of the model answered within the bound (an
        overloaded model, or a single replica), nothing is benched.
        """
        self.answer("r2")
        self.send("r1", 5)
        self.clock.advance(30)
        self.assertEqual(self.watch.check(), [])
        # Another model's answers say nothing about this one.
        self.answer("x1", model="other")
        self.assertEqual(self.watch.check(), [])

    def test_bound_follows_the_models_first_bytes(self) -> None:
        """
        The bound is four times the model's recent median time to first
        byte when that is over 5 s / 4: requests waiting 11 s on a model
        whose first bytes take 3 s are not late yet; at 12 s they are.
        """
        for _ in range(5):
            self.answer("r2", after=3.0)
        self.assertEqual(self.watch.bound("m"), 12.0)
        self.send("r1", 3)
        self.clock.advance(9)
        self.answer("r2", after=2.0)  # 11 s in; the median is still 3 s
        self.assertEqual(self.watch.check(), [])
        self.clock.advance(1)
        self.assertEqual(self.watch.check(), ["r1"])

    def test_forget(self) -> None:
        """
        A replica that left the table no longer counts as one that answered.
        """
        self.answer("r2")
        self.watch.forget({"r1"})
        self.send("r1", 3)
        self.clock.advance(6)
        self.assertEqual(self.watch.check(), [])


class EmbeddedGatewayTests(SynchronousTestCase):
    def test_requests_move_when_a_replica_leaves_the_table(self) -> None:
        """
        The embedded gateway follows the control plane's own routing table:
        requests waiting on a replica that leaves it are moved at once.
        """
        clock = Clock()
        table = RoutingTable(clock)
        table.publish([Route("r1", "m", "127.0.0.1:1"), Route("r2", "m", "127.0.0.1:2")], ["m"])
        service = GatewayService(clock, table, port=0)
        unstarted = service.gateway.unstarted
        call = Call("m", 0.0)
        unstarted.add("r1", call)
        table.publish([Route("r2", "m", "127.0.0.1:2")], ["m"])
        self.assertEqual(call.moved, 1)
        self.assertEqual(unstarted.waiting("r1"), 0)


class UnstartedTests(SynchronousTestCase):
    """
    L{Unstarted} kept by request: each request waits on one replica, the
    one it was last sent to.
    """

    def setUp(self) -> None:
        self.unstarted = Unstarted()

    def test_answer_from_another_replica_leaves_it_waiting(self) -> None:
        """
        A first byte reported from a replica the request no longer waits on
        (an earlier attempt's) leaves it waiting on its own replica, which
        still moves it when it leaves.
        """
        call = Call("m", 0.0)
        self.unstarted.add("r2", call)
        self.unstarted.answered("r1", call)
        self.assertEqual(self.unstarted.waiting("r2"), 1)
        self.assertEqual(self.unstarted.left({"r1"}), 1)
        self.assertEqual(call.moved, 1)

    def test_sent_again_waits_on_the_new_replica_only(self) -> None:
        """
        A request sent to a second replica waits on that one only: the
        first leaving the table does not move it, and a discard naming the
        first does not take it out.
        """
        call = Call("m", 0.0)
        self.unstarted.add("r1", call)
        self.unstarted.add("r2", call)
        self.unstarted.discard("r1", call)
        self.assertEqual(self.unstarted.by_replica(), [("r2", [call])])
        self.assertEqual(self.unstarted.left({"r2"}), 0)
        self.assertEqual(call.moved, 0)
        self.unstarted.discard("r2", call)
        self.assertEqual(self.unstarted.by_replica(), [])

    def test_by_replica_groups_the_waiting(self) -> None:
        """
        C{by_replica} lists each replica with its waiting requests; one
        answered is no longer among them.
        """
        a, b, c = (Call("m", 0.0) for _ in range(3))
        self.unstarted.add("r1", a)
        self.unstarted.add("r2", b)
        self.unstarted.add("r1", c)
        self.unstarted.answered("r1", a)
        self.assertEqual(sorted((r, len(calls)) for r, calls in self.unstarted.by_replica()),
                         [("r1", 1), ("r2", 1)])
