"""
Adoption of shards already running when the agent starts: plain functions
that turn what the state directory recorded and what C{/proc} shows into
shards the supervisor takes over, shards whose record was lost, and strays.

A recorded shard is adopted if its main process is still the one recorded
(same pid and start time in C{/proc/PID/stat}), or if processes carrying its
marker live on (it is stopping). A shard is no child of the agent that
adopts it, so its end is found by polling. Processes that carry this
agent's marker but no record are either a shard whose record was damaged or
lost ("record lost": reported so the control plane stops it; its profile is
unknown) or, naming no usable shard, strays: logged loudly and listed in
C{Register}, never signalled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.agent.processes import SHARD_MARKER, MarkedProcess
from llmgw.agent.shard import (
    FAILED,
    HELD_STATES,
    LIVE_STATES,
    STARTING,
    STOPPED,
    STOPPING,
    UNKNOWN_EXIT,
    Shard,
)
from llmgw.agent.state import ShardRecord, ShardSpec, valid_shard_id
from llmgw.crash import CrashClass


@dataclass
class Stray:
    """
    A process this agent started (it carries the marker) that belongs to no
    shard it can name: logged loudly and listed in C{Register}, never
    signalled.
    """

    pid: int
    pgid: int
    shard_id: str
    reason: str
    command: str
    start_time: int | None = None


def by_shard(marked: Iterable[MarkedProcess]) -> dict[str, list[MarkedProcess]]:
    """
    The marked processes by the shard id they carry ("" for none).
    """
    out: dict[str, list[MarkedProcess]] = {}
    for proc in marked:
        out.setdefault(proc.shard_id, []).append(proc)
    return out


def main_alive(record: ShardRecord, start_time: int | None) -> bool:
    """
    Whether the recorded main process still runs, C{start_time} being the
    recorded pid's start time now (C{None}: no such process): a pid with
    another start time was reused.
    """
    return start_time is not None and start_time == record.start_time


def adopt(record: ShardRecord, procs: list[MarkedProcess], start_time: int | None) -> Shard | None:
    """
    The shard to take over from C{record}, or C{None} when nothing of it
    survived (its GPUs and port are free again).

    @param procs: the live processes carrying the shard's marker.
    @param start_time: the recorded pid's start time now (C{None}: no such
        process); the main process lives if it is the recorded one.

    The shard keeps its recorded state while its main process lives and it
    was live; it is stopping otherwise (it was, or its main process ended
    while the agent was away), with what the record says of how it ends.
    Its log tail is not opened.
    """
    spec = record.spec
    alive = main_alive(record, start_time)
    if not valid_shard_id(spec.shard_id) or (not alive and not procs):
        return None
    shard = Shard(spec, record.state if record.state in HELD_STATES else STARTING)
    shard.adopted = True
    shard.pid, shard.start_time = record.pid, record.start_time
    # Groups are trusted while the main process lives (its pid is its group)
    # or when members carry the shard's marker.
    shard.pgids = {p.pgid for p in procs}
    if alive:
        shard.pgids |= set(record.pgids or [record.pid])
    if not (alive and record.state in LIVE_STATES):
        _resume_stopping(shard, record, alive)
    return shard


def _resume_stopping(shard: Shard, record: ShardRecord, alive: bool) -> None:
    shard.stopping = True
    shard.state = STOPPING
    shard.stop_error = record.stop_error
    if not (record.main_ended or not alive):
        return
    shard.main_ended = True
    if record.main_ended:
        shard.error, shard.exit_code, shard.signal = record.error, record.exit_code, record.signal
        shard.crash_class = record.crash_class
        shard.final_state = FAILED if record.error or record.stop_error else STOPPED
    elif record.state == STOPPING and not record.stop_error:
        shard.exit_code, shard.final_state = UNKNOWN_EXIT, STOPPED
    else:
        shard.exit_code, shard.final_state = UNKNOWN_EXIT, FAILED
        shard.error = "exited while the agent was away (exit status unknown)"
        if record.stop_error:
            shard.error = f"{record.stop_error}; {shard.error}"
        shard.crash_class = CrashClass.UNKNOWN.value


def outside_group(record: ShardRecord, procs: Iterable[MarkedProcess]) -> list[int]:
    """
    The pids of the shard's processes outside its main process's group.
    """
    return sorted(p.pid for p in procs if p.pgid != record.pid)


def lost_record(shard_id: str, procs: list[MarkedProcess]) -> Shard:
    """
    The shard whose processes C{procs} carry its (usable) id but whose
    record is lost: what its group leader's environment says of it, held
    (its GPUs and port are taken) until its processes end. Its command,
    health path and timeouts went with the record: its profile is reported
    unknown, so the control plane stops it.
    """
    leader = group_leader(procs)
    env = leader.env
    spec = ShardSpec(
        shard_id=shard_id,
        replica_id=env.get("LLMGW_REPLICA_ID", ""),
        model=env.get("LLMGW_MODEL", ""),
        profile="",
        argv=[],
        gpu_indices=_int_list(env.get("CUDA_VISIBLE_DEVICES", "")),
        port=_int(env.get("LLMGW_PORT", "")),
        rank=_int(env.get("LLMGW_RANK", "")),
        world_size=_int(env.get("LLMGW_WORLD_SIZE", "")) or 1,
        leader_address=env.get("LLMGW_LEADER", ""),
    )
    shard = Shard(spec, STARTING)
    shard.adopted = shard.record_lost = shard.main_ended = True
    shard.pid, shard.start_time = leader.pid, leader.start_time
    shard.pgids = {p.pgid for p in procs}
    return shard


def group_leader(procs: list[MarkedProcess]) -> MarkedProcess:
    """
    The process among C{procs} that leads its group, else the first.
    """
    return next((p for p in procs if p.pid == p.pgid), procs[0])


def strays(shard_id: str, procs: Iterable[MarkedProcess]) -> list[Stray]:
    """
    Marked processes whose C{LLMGW_SHARD_ID} names no usable shard.
    """
    return [
        Stray(pid=p.pid, pgid=p.pgid, shard_id=shard_id, command=p.command,
              reason=f"its {SHARD_MARKER} {shard_id!r} is not a shard id",
              start_time=p.start_time)
        for p in procs
    ]


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return out
