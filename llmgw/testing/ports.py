"""
TCP ports for tests whose child processes must bind a port themselves
(twistd, etcd, shards): ports no other test and no outbound connection can
be handed meanwhile, and nowhere near what C{llmgw local} uses.

A port picked by binding port 0 and closing is in the kernel's ephemeral
range, where any outbound connection may take it as its local port before
the child binds it. These come from L{TEST_PORTS} instead, outside the
ephemeral range (C{/proc/sys/net/ipv4/ip_local_port_range}), the demo
catalog's shard ports (20000 up), and the local fleet's 7480 and 8000;
each is checked free by binding it at the time it is picked, and held
for this process by a lock (an abstract Unix socket named after it, gone
with the process) so that parallel trial workers never pick the same one.
What remains, another program binding that very port between the check
and the child's bind, is for callers to retry: L{in_use} reads a child's refusal,
L{wait_bound} waits for a child to bind or be refused.
"""

from __future__ import annotations

import errno
import random
import re
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

#: Single ports come from here: below the demo catalog's shard range
#: (20000-29999) and above the usual service ports.
TEST_PORTS = (10000, 15999)
#: Blocks of shard ports (a test fleet's catalog range) come from here.
TEST_BLOCKS = (16000, 19999)
#: The size of a block from L{port_block}.
BLOCK = 100
#: How many candidates to try before giving up.
ATTEMPTS = 500

# The locks this process holds, by name: a port held here is never handed
# out again by this process, and no other process can lock it meanwhile.
_held: dict[str, socket.socket] = {}


def ephemeral_range() -> tuple[int, int]:
    """
    The kernel's range for the local ports of outbound connections.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _lock(name: str) -> socket.socket | None:
    """
    Hold the machine-wide lock C{name} for this process, or C{None} when
    this or another process holds it.
    """
    if name in _held:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0llmgw-test-" + name)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    _held[name] = s
    return s


def _unlock(name: str) -> None:
    s = _held.pop(name, None)
    if s is not None:
        s.close()


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """
    Whether nothing is bound to C{port} on C{host} or on every address,
    listening, connected or in TIME_WAIT (no C{SO_REUSEADDR}: stricter than
    the child's bind will be).
    """
    for address in {host, "0.0.0.0"}:
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def _candidates(low: int, high: int, step: int = 1) -> list[int]:
    eph_low, eph_high = ephemeral_range()
    out = [p for p in range(low, high + 1, step) if p + step - 1 < eph_low or p > eph_high]
    random.shuffle(out)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """
    A TCP port on C{host} that nothing is bound to now, outside the
    ephemeral range, held for this process from now on (never handed out
    twice, never to another test process). For a child process to bind:
    it is not bound here.

    @raise RuntimeError: none of L{ATTEMPTS} candidates was free.
    """
    for port in _candidates(*TEST_PORTS)[:ATTEMPTS]:
        if _lock(f"port-{port}") is None:
            continue
        if bindable(port, host):
            return port
        _unlock(f"port-{port}")
    raise RuntimeError(f"no free test port in {TEST_PORTS}")


def port_block(testcase: Any, size: int = BLOCK) -> tuple[int, int]:
    """
    C{(first, last)}: C{size} consecutive ports, for a test fleet's catalog
    C{[ports]}, held for C{testcase} until its cleanup. Its first and last
    ports were free when picked; the agent refuses a shard on a port found
    in use and the control plane places it on the next.
    """
    assert size <= BLOCK
    for first in _candidates(TEST_BLOCKS[0], TEST_BLOCKS[1] - BLOCK + 1, BLOCK):
        name = f"block-{first}"
        if _lock(name) is None:
            continue
        if bindable(first) and bindable(first + size - 1):
            testcase.addCleanup(_unlock, name)
            return first, first + size - 1
        _unlock(name)
    raise RuntimeError(f"no free block of test ports in {TEST_BLOCKS}")


def with_ports(text: str, first: int, last: int) -> str:
    """
    Catalog TOML C{text} with its C{[ports]} range set to C{first}-C{last}
    (the table added at the end when it has none).
    """
    table = re.search(r"^\[ports\][^\[]*", text, re.MULTILINE)
    if table is None:
        return text.rstrip("\n") + f"\n\n[ports]\nfirst = {first}\nlast = {last}\n"
    body = re.sub(r"^first\s*=.*$", f"first = {first}", table.group(0), flags=re.MULTILINE)
    body = re.sub(r"^last\s*=.*$", f"last = {last}", body, flags=re.MULTILINE)
    return text[: table.start()] + body + text[table.end():]


def in_use(text: str) -> bool:
    """
    Whether a child's output says it could not bind an address in use.
    """
    lowered = text.lower()
    return "address already in use" in lowered or "eaddrinuse" in lowered


def wait_bound(proc: subprocess.Popen[bytes], ports: list[int], output: Callable[[], str],
               timeout: float = 60.0) -> bool:
    """
    Block until each of C{ports} accepts a connection on 127.0.0.1 (true),
    or C{proc} has exited saying an address was in use (false: start it
    again on other ports). Any other exit, or C{timeout}, is true too: the
    caller's own waits report it with the output.
    """
    deadline = time.monotonic() + timeout
    waiting = list(ports)
    while waiting and time.monotonic() < deadline:
        if proc.poll() is not None:
            return not in_use(output())
        try:
            socket.create_connection(("127.0.0.1", waiting[0]), timeout=1).close()
            waiting.pop(0)
            continue
        except OSError:
            pass
        time.sleep(0.1)
    return True


__all__ = ["BLOCK", "TEST_BLOCKS", "TEST_PORTS", "bindable", "ephemeral_range", "free_port",
           "in_use", "port_block", "wait_bound", "with_ports"]
