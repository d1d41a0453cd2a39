"""
Stopping a shard, which is its whole process group: TERM to the group, KILL
after the shard's C{stop_grace_s}, and that KILL stands after the main
process has exited, so children that ignore TERM die too. The shard holds
its GPUs and port until the group is empty; emptiness is polled on the
injected clock (L{llmgw.agent.processes.ProcessOps.group_members}), quickly
at first, then backing off.

L{Stopper} does the signalling and the watching; L{main_exit} and
L{final_state} say how a shard whose main process ended, or whose group
emptied, has ended: stopped, or failed with why.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

from llmgw.agent.processes import ProcessOps
from llmgw.agent.shard import FAILED, STOPPED, UNKNOWN_EXIT, Shard, ShardTimers
from llmgw.crash import classify

#: The first checks of a stopping group come quickly (most groups empty at
#: once), then back off to the supervisor's poll interval.
GROUP_POLL_FIRST = 0.05
#: After the KILL, how long a group may take to empty before the agent says,
#: loudly, that it survives (a process in uninterruptible sleep, say).
KILL_WAIT_S = 10.0


def exit_how(exit_code: int, sig: int) -> str:
    """
    How a main process ended, in words.
    """
    if sig:
        return f"killed by signal {sig}"
    if exit_code == UNKNOWN_EXIT:
        return "exit status unknown (not this agent's child)"
    return f"exit code {exit_code}"


def main_exit(shard: Shard, exit_code: int, sig: int) -> str:
    """
    Record on C{shard} that its main process ended with C{exit_code} or
    C{sig}: its exit, the state it takes once its group is empty, and, when
    that is failed (it was not asked to stop, or its stop was the agent's
    own doing), its error and crash class. Returns how it ended, in words.
    """
    how = exit_how(exit_code, sig)
    shard.exit_code, shard.signal = exit_code, sig
    if shard.stopping and not shard.stop_error:
        shard.final_state = STOPPED
        return how
    shard.final_state = FAILED
    if shard.stop_error:
        shard.error = f"{shard.stop_error}; {how}"
    else:
        shard.error = f"exited without being asked to ({how})"
    shard.crash_class = classify(
        exit_code if exit_code != UNKNOWN_EXIT else 0, sig, shard.last_output(),
        asked=shard.stopping,
    ).value
    return how


def final_state(shard: Shard) -> tuple[str, str]:
    """
    The state and error of a shard whose group is now empty. With no final
    state decided yet, a group that emptied on its own (a shard found by
    its marker) failed, and one the agent stopped is stopped.
    """
    state = shard.final_state or (
        FAILED if shard.stop_error or not shard.stopping else STOPPED)
    error = shard.error
    if state == FAILED and not error:
        error = shard.stop_error or "its processes ended"
    return state, error


class Stopper:
    """
    Signals shards' process groups and watches them empty, on C{clock}.

    @param emptied: called once a stopping shard's group is empty (after
        its main process ended): its GPUs and port are free.
    @param poll_interval: the slowest a stopping group is looked at.
    """

    log = Logger()

    def __init__(self, clock: Any, ops: ProcessOps, emptied: Callable[[Shard], None],
                 poll_interval: float = 1.0):
        self.clock = clock
        self.ops = ops
        self.emptied = emptied
        self.poll_interval = poll_interval
        self.timers = ShardTimers(clock)

    def escalate(self, shard: Shard, sig: int) -> None:
        """
        Send C{sig} (the shard's stop signal) to the shard's groups now and
        KILL after its grace; watch its group if its main process has
        already ended.
        """
        self.signal(shard, sig)
        self.timers.set(shard, "kill", shard.spec.stop_grace_s, self._kill, shard)
        if shard.main_ended:
            self.watch(shard)

    def watch(self, shard: Shard) -> None:
        """
        Look at the shard's group soon, and again until it is empty.
        """
        self._watch(shard, GROUP_POLL_FIRST)

    def signal(self, shard: Shard, sig: int) -> bool:
        """
        Send C{sig} to each of the shard's process groups; whether it went.
        """
        if shard.adopted and not shard.main_ended and shard.pid is not None:
            if self.ops.start_time(shard.pid) != shard.start_time:
                # The main process ended unseen: its pid may be someone
                # else's now; its group is still ours while it has members,
                # and the supervisor's poll takes it from here.
                return False
        for pgid in sorted(shard.pgids):
            self.ops.kill_group(pgid, sig)
        if sig == signal.SIGTERM:
            shard.term_sent = True
        return True

    def empty(self, shard: Shard) -> bool:
        """
        Whether all of the shard's process groups are empty.
        """
        return all(not self.ops.group_members(pgid) for pgid in shard.pgids)

    def _kill(self, shard: Shard) -> None:
        self.timers.fired(shard, "kill")
        if shard.main_ended and self.empty(shard):
            self.emptied(shard)
            return
        self.log.warn("shard {shard} (pid {pid}) outlived its {grace}s grace; sending KILL "
                      "to its process group", shard=shard.shard_id, pid=shard.pid,
                      grace=shard.spec.stop_grace_s)
        shard.killed_at = self.clock.seconds()
        self.signal(shard, signal.SIGKILL)

    def _watch(self, shard: Shard, delay: float) -> None:
        self.timers.set(shard, "group", delay, self._check_group, shard, delay)

    def _check_group(self, shard: Shard, delay: float) -> None:
        """
        One look at a stopping shard's group: done when empty, else look
        again later (backing off to the poll interval), re-sending KILL and
        saying so loudly when the group outlives it.
        """
        self.timers.fired(shard, "group")
        if not shard.held:
            return
        try:
            if self.empty(shard):
                self.emptied(shard)
                return
            if shard.killed_at is not None:
                if self.clock.seconds() - shard.killed_at >= KILL_WAIT_S:
                    if not shard.survivors_logged:
                        shard.survivors_logged = True
                        left = sorted(p for g in shard.pgids for p in self.ops.group_members(g))
                        self.log.critical(
                            "shard {shard}'s process group survives SIGKILL for {wait}s "
                            "(pids {pids}: uninterruptible sleep?); its GPUs {gpus} stay held",
                            shard=shard.shard_id, wait=KILL_WAIT_S,
                            pids=",".join(map(str, left)),
                            gpus=",".join(map(str, shard.spec.gpu_indices)) or "none",
                        )
                    self.signal(shard, signal.SIGKILL)
        except Exception:
            self.log.failure("watching shard {shard}'s process group failed",
                             shard=shard.shard_id)
        self._watch(shard, min(delay * 2, self.poll_interval))
