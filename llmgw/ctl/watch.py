"""
C{llmgw ctl watch}: the admin API's watch stream, live, for a person: one
line per message (C{--json}: the messages as they come), until interrupted
or C{--count} messages. It runs L{llmgw.client.FleetClient} under asyncio,
so a dropped connection is dialled again and resumed from the last
revision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, TextIO


def _clean(value: Any) -> str:
    # Names come from the fleet; keep control characters off the terminal.
    text = str(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _route(r: dict[str, Any]) -> str:
    return f"{_clean(r.get('replica'))}@{_clean(r.get('address'))}" + (" (draining)" if r.get("draining") else "")


def render_message(m: dict[str, Any]) -> str:
    """
    One line for a person about stream message C{m}.
    """
    kind = m.get("type")
    rev = f"#{m.get('revision')}"
    if kind == "snapshot":
        routes = m.get("routes") or {}
        parts = [f"{len(routes.get('routes', []))} routes"]
        for name in ("nodes", "replicas", "deployments"):
            if name in m:
                parts.append(f"{len(m[name])} {name}")
        return f"{rev} snapshot (epoch {_clean(m.get('epoch'))}): " + ", ".join(parts)
    if kind == "reset":
        return f"{rev} reset: {_clean(m.get('reason'))}"
    if kind == "routes":
        models = m.get("models") or {}
        text = "; ".join(
            f"{_clean(model)}: " + (", ".join(_route(r) for r in routes) if routes else "no routes")
            for model, routes in sorted(models.items())
        )
        if "known" in m:
            text += ("; " if text else "") + "declared: " + ", ".join(_clean(k) for k in m["known"])
        return f"{rev} routes {text}"
    if kind in ("node", "replica", "deployment"):
        if m.get("removed"):
            return f"{rev} {kind} {_clean(m.get('id'))} removed"
        view = m.get(kind) or {}
        if kind == "node":
            flags = [f for f in ("cordoned", "draining") if view.get(f)]
            used = sum(g.get("memory_used_mb", 0) for g in view.get("gpus", []))
            detail = f"{_clean(view.get('state'))}{''.join(', ' + f for f in flags)}, " \
                     f"{len(view.get('gpus', []))} GPUs, {used} MB used, {len(view.get('shards', []))} shards"
        elif kind == "replica":
            detail = f"{_clean(view.get('model'))} {_clean(view.get('state'))}" + (
                ", draining" if view.get("draining") else "")
        else:
            detail = f"desired {view.get('desired')}, ready {view.get('ready')}"
        return f"{rev} {kind} {_clean(m.get('id'))}: {detail}"
    if kind == "event":
        e = m.get("event") or {}
        when = time.strftime("%H:%M:%S", time.localtime(float(e.get("time", 0))))
        where = " ".join(_clean(e[k]) for k in ("node", "replica", "shard") if e.get(k))
        # No empty field before the colon for an event that names no node.
        head = " ".join(p for p in (rev, "event", when, _clean(e.get("kind")), where) if p)
        return f"{head}: {_clean(e.get('reason'))}"
    return f"{rev} {_clean(kind)}"


async def _watch(args: argparse.Namespace, out: TextIO) -> int:
    from llmgw.client import FleetClient

    ca = cert = key = None
    if args.admin.startswith("https"):
        from pathlib import Path

        if not args.certs or not args.as_name:
            sys.stderr.write("llmgw ctl watch: an https:// --admin-url needs --certs DIR and --as NAME\n")
            return 2
        d = Path(args.certs)
        ca, cert, key = str(d / "ca.pem"), str(d / f"admin-{args.as_name}.pem"), str(d / f"admin-{args.as_name}.key")
    client = FleetClient(args.admin, ca=ca, cert=cert, key=key, timeout=args.timeout)
    seen = 0
    try:
        async for message in client:
            out.write((json.dumps(message) if args.json else render_message(message)) + "\n")
            out.flush()
            seen += 1
            if args.count and seen >= args.count:
                break
    finally:
        try:
            await client.close()
        except asyncio.InvalidStateError:
            # Interrupted mid-handshake: the connection's futures are already
            # settled by the cancellation; there is nothing left to close.
            pass
    return 0


#: The exit status after Ctrl-C: the shell's convention for SIGINT (128 + 2).
EXIT_INTERRUPTED = 130


def cmd_watch(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              http: Any = None) -> int:
    """
    Print the watch stream until C{--count} messages (exit 0) or Ctrl-C,
    which ends it quietly with L{EXIT_INTERRUPTED}.
    """
    import txaio

    txaio.use_asyncio()
    interrupted = False

    def quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # After Ctrl-C, callbacks of the cancelled connection may find their
        # futures settled; that is the interruption, not a fault to report.
        if interrupted and isinstance(context.get("exception"), asyncio.InvalidStateError | asyncio.CancelledError):
            return
        loop.default_exception_handler(context)

    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(quiet)
        try:
            return runner.run(_watch(args, out if out is not None else sys.stdout))
        except KeyboardInterrupt:
            interrupted = True
            return EXIT_INTERRUPTED
        except asyncio.InvalidStateError:
            interrupted = True
            return EXIT_INTERRUPTED


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N messages (0: never)")
