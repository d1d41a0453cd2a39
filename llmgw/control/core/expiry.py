"""
Node expiry and the bulk-loss freeze (DESIGN §6.3) as a pure decision.

L{judge} takes what the fleet state says about nodes (which came due for a
check, which are suspect, when each was last heard of, when a freeze last
restarted a suspect node's lost clock) and the time, and returns what
changes: nodes that turn suspect, come back, or are lost; whether
replacements freeze or resume; and which nodes to check again when. It
reads no clock and changes nothing; the reconciler applies the outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpiryRules:
    suspect_after: float
    lost_after: float
    #: Share of the live nodes suspect at once beyond which replacements freeze.
    freeze_share: float


@dataclass
class Expiry:
    """
    What a check decided. Times of silence are in seconds.
    """

    #: (node, silent for) that turn suspect now.
    suspect: list[tuple[str, float]] = field(default_factory=list)
    #: Suspect nodes heard from again.
    back: list[str] = field(default_factory=list)
    #: (node, silent for) declared lost now.
    lost: list[tuple[str, float]] = field(default_factory=list)
    #: Nodes the inventory no longer holds: forget them as suspects.
    gone: list[str] = field(default_factory=list)
    #: (deadline, node) to check again.
    recheck: list[tuple[float, str]] = field(default_factory=list)
    #: The new freeze, when it changed; C{None} when it did not.
    frozen: bool | None = None
    #: Suspect and live nodes when the freeze changed, for its message.
    suspect_count: int = 0
    live_count: int = 0
    #: Suspect nodes whose lost clock restarts now (the freeze lifted).
    fresh_clock: list[str] = field(default_factory=list)


def judge(
    due: Iterable[str],
    suspect: Iterable[str],
    known: int,
    lost: int,
    last_heard: Callable[[str], float | None],
    lost_clock: Mapping[str, float],
    was_frozen: bool,
    now: float,
    rules: ExpiryRules,
) -> Expiry:
    """
    @param due: nodes whose check deadline has come (not suspect or lost).
    @param suspect: nodes suspect before this check.
    @param known: nodes known; C{lost}: of them, lost.
    @param last_heard: when a node was last heard of (or learned of), or
        C{None} if the inventory no longer holds it.
    @param lost_clock: for suspect nodes, when their lost clock restarted.
    """
    out = Expiry()
    still_suspect = set(suspect)
    for node_id in due:
        last = last_heard(node_id)
        if last is None:
            continue
        # One expression decides and re-queues, so floating-point rounding
        # can never push back an entry that is already due.
        deadline = last + rules.suspect_after
        if deadline <= now:
            out.suspect.append((node_id, now - last))
            still_suspect.add(node_id)
        else:
            out.recheck.append((deadline, node_id))
    live = known - lost
    frozen = live > 0 and len(still_suspect) > rules.freeze_share * live
    fresh: set[str] = set()
    if frozen != was_frozen:
        out.frozen = frozen
        out.suspect_count, out.live_count = len(still_suspect), live
        if not frozen:
            # The freeze covered their silence: none of it counts towards
            # their being lost.
            fresh = set(still_suspect)
            out.fresh_clock = sorted(fresh)
    for node_id in sorted(still_suspect):
        last = last_heard(node_id)
        if last is None:
            out.gone.append(node_id)
            continue
        if last + rules.suspect_after > now:
            out.back.append(node_id)
            out.recheck.append((last + rules.suspect_after, node_id))
            continue
        since = now if node_id in fresh else max(last, lost_clock.get(node_id, last))
        if now - since >= rules.lost_after and not frozen:
            out.lost.append((node_id, now - last))
    return out
