"""
Limits the operating system puts on a server process, shared by every
listener (the agent port, the admin API, the gateway's front).
"""

from __future__ import annotations

import resource


def ensure_fd_limit(needed: int) -> str | None:
    """
    Raise this process's soft open-file limit towards C{needed} (never past
    the hard limit). Returns what is still wrong, or C{None}.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft >= needed:
        return None
    return (
        f"the open-file limit is {soft}, below the {needed} that --max-connections "
        f"needs with headroom; connections past it fail at accept: raise it "
        f"(ulimit -n, systemd LimitNOFILE=) or lower --max-connections"
    )
