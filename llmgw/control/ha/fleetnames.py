"""
Whether a connected node holds a name, seen from any member of an HA
control plane: the join check "a name another connected node holds is
refused" (DESIGN §20) for a member that does not lead.

Agents keep their stream to the leader, so a follower's own streams say
nothing about the fleet. A follower answers from the fleet view the leader
publishes in etcd (L{llmgw.control.ha.published_fleet}), which lists every
node with C{connected}, the same view it answers C{GET /api/v1/nodes} from.

What the check can miss: the view is as old as the leader's last
publication (every L{FLEET_INTERVAL} seconds when it changed, less often on
a large fleet, plus etcd's watch delay), so a node that connected to the
leader in the last few seconds is not in it; a view over etcd's size bound
lists only the nodes that fit; and a member that has just become leader
sees only the agents that have connected to it again. Why a miss stays
contained: the check runs only for a valid token, whose use the join
spends; the certificate issued names that one node (its CN), so it cannot
speak for any other; and the join is recorded (the token's nodes, the CA's
C{issued.jsonl}), so C{llmgw ctl cert revoke NODE} finds it. The leader does
not refuse the second stream: the newest wins, and it logs that the node
"connected again while its old stream was open", which shows the clash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from llmgw.control.ha.published_fleet import FLEET_INTERVAL
from llmgw.routing import RoutesDataError
from llmgw.tlsconf.csr import RequestRefused

#: Seconds a member that does not lead, holding no fleet view yet (just
#: started, or just stepped down), waits for the leader's next one before
#: it refuses a join: past two publications, and well inside the join
#: connection's deadline.
FLEET_WAIT = 2 * FLEET_INTERVAL + 0.5
#: Seconds between two looks for that view while waiting.
FLEET_WAIT_STEP = 0.25


class FleetNames:
    """
    L{holds} tells a member's join authority whether the leader's published
    fleet view lists a name connected.

    @param follower: the member's L{llmgw.control.ha.published_fleet.FleetFollower}
        (its C{document}: the view held, or C{None}).
    @param leading: whether the member leads now (then its own streams are
        the fleet's, and the join authority checks those itself).
    """

    def __init__(self, clock: IReactorTime, follower: Any, leading: Callable[[], bool],
                 wait: float = FLEET_WAIT, step: float = FLEET_WAIT_STEP):
        self.clock = clock
        self.follower = follower
        self.leading = leading
        self.wait = wait
        self.step = step

    def holds(self, node_id: str) -> Deferred[bool]:
        """
        Whether the leader's last published fleet view lists C{node_id}
        connected; C{False} while this member leads.

        @raise RequestRefused: (the Deferred's failure) this member does not
            lead and no readable view came within L{wait} seconds.
        """
        return Deferred.fromCoroutine(self._holds(node_id))

    async def _holds(self, node_id: str) -> bool:
        waited = 0.0
        while not self.leading():
            doc = self.follower.document
            if doc is not None:
                try:
                    return doc.is_connected(node_id)
                except RoutesDataError as e:
                    raise RequestRefused(
                        f"the fleet view the leader published is unreadable ({e}), so this member cannot "
                        f"tell whether a connected node holds the name {node_id!r}: try again, or join at "
                        "the leader") from None
            if waited >= self.wait:
                raise RequestRefused(
                    f"this member does not lead and holds no fleet view from the leader yet, so it cannot "
                    f"tell whether a connected node holds the name {node_id!r}: try again in a few "
                    "seconds, or join at the leader")
            await deferLater(self.clock, self.step, lambda: None)
            waited += self.step
        return False
