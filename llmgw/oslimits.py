"""
Limits the operating system puts on a server process, shared by every
listener (the agent port, the admin API, the gateway's front).

Each listener raises the soft open-file limit towards what its own cap
needs when it starts (L{raise_fd_limit}); the process that composes them
checks once, at start-up, what all of them together may hold
(L{fd_limit_problem}), so that one warning names the options of that
process which drive the number, and how to raise the limit.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

#: Open files a server process holds beyond its listeners' connections: its
#: log, state files, the admin API's clients, a few spare for bursts.
FD_HEADROOM: Final = 1024

GetLimit = Callable[[], tuple[int, int]]
SetLimit = Callable[[tuple[int, int]], None]


def _get() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _set(limits: tuple[int, int]) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


@dataclass(frozen=True)
class FdNeed:
    """
    Open files one part of a process may hold at once.

    @ivar count: how many.
    @ivar what: what holds them, for the warning ("the agent port's
        connections").
    @ivar option: the option of this process that sets the count, or
        C{None} when none does.
    """

    count: int
    what: str
    option: str | None = None


def raise_fd_limit(needed: int, get: GetLimit = _get, set_: SetLimit = _set) -> int:
    """
    Raise this process's soft open-file limit towards C{needed}, never past
    the hard limit; returns the soft limit now (C{RLIM_INFINITY} when
    there is none).
    """
    soft, hard = get()
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            set_((target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def fd_limit_problem(
    needs: Sequence[FdNeed],
    headroom: int = FD_HEADROOM,
    get: GetLimit = _get,
    set_: SetLimit = _set,
) -> str | None:
    """
    Raise the soft open-file limit towards what C{needs} and C{headroom}
    add up to; C{None} when the limit (raised, if need be) is enough, else
    one line saying how short it is, which options of this process drive
    the number, and how to raise the limit. A need of 0 (a listener
    without a cap) counts for nothing.
    """
    counted = [n for n in needs if n.count > 0]
    if not counted:
        return None
    needed = sum(n.count for n in counted) + headroom
    soft = raise_fd_limit(needed, get, set_)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    parts = [f"{n.count} for {n.what}" + (f" ({n.option})" if n.option else "") for n in counted]
    parts.append(f"{headroom} spare")
    options = [n.option for n in counted if n.option]
    lower = f", or lower {' or '.join(options)}" if options else ""
    return (
        f"the open-file limit is {soft}, below the {needed} files this process may hold "
        f"({', '.join(parts)}): connections past it fail at accept. Raise it to {needed} "
        f"(systemd: LimitNOFILE={needed} in the unit; a shell: ulimit -n {needed} before "
        f"starting){lower}"
    )


__all__ = ["FD_HEADROOM", "FdNeed", "fd_limit_problem", "raise_fd_limit"]
