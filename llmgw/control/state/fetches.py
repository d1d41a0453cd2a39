"""
A fetching shard's progress on the control plane's side: what an agent's
heartbeat says of each shard whose weights it is putting on its node, kept
on the shard (L{llmgw.control.state.fleetstate.ShardRec.fetch}) for the
admin API, the watch stream, C{llmgw ctl replicas} and C{/metrics}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmgw.api.v1 import agent_pb2 as pb


@dataclass(frozen=True, slots=True)
class FetchProgress:
    """
    Bytes of the shard's model on its node so far (C{done}), of C{total}
    (C{None}: not known yet), at C{rate} bytes a second lately.
    """

    done: int
    total: int | None
    rate: float

    @classmethod
    def from_message(cls, msg: pb.FetchProgress) -> FetchProgress:
        """
        Read one heartbeat entry; a rate that is not finite or is negative
        reads as 0, a total of 0 as unknown.
        """
        rate = msg.rate if math.isfinite(msg.rate) and msg.rate >= 0 else 0.0
        return cls(done=msg.done, total=msg.total or None, rate=rate)

    def as_json(self) -> dict[str, Any]:
        """
        The admin API's form: C{{"done", "total", "rate"}}, C{total} C{None}
        when unknown, C{rate} in bytes a second.
        """
        return {"done": self.done, "total": self.total, "rate": round(self.rate, 1)}
