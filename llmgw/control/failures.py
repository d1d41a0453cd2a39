"""
A failed shard, as the control plane keeps it (DESIGN §6.4): the
deployment's last failure, shown by the admin API.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ShardFailure:
    node: str
    replica: str
    shard: str
    #: C{None} when no process exit was seen (a timeout, say).
    exit_code: int | None
    signal: int | None
    error: str
    last_output: str
    time: float
    #: What kind of crash this was, when a classifier has said (for example
    #: "oom"); "" when none has.
    crash_class: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
