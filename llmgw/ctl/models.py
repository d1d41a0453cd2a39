"""
C{llmgw ctl models}: which model's weights are cached on which node, their
size, state and last use, from C{GET /api/v1/models} (a table, or the API's
JSON with C{--json}); and C{llmgw ctl models pull MODEL [--node N]...}, which
stages a deployment's weights on those nodes (or where prefetch would
choose) through C{POST /api/v1/deployments/MODEL/pull}.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote

from llmgw.ctl.client import EXIT_USAGE
from llmgw.ctl.fleet import AdminClient, HTTPFunction, _run, node_id, table
from llmgw.ctl.render import ago


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("pull",),
                        help="pull: stage MODEL's weights on nodes' caches")
    parser.add_argument("model", nargs="?", metavar="MODEL", help="with pull: the deployment's model")
    parser.add_argument("--node", dest="nodes", action="append", type=node_id, default=[], metavar="N",
                        help="with pull: a node to stage them on (again for more; none: where "
                        "prefetch would choose)")


def size_text(n: Any) -> str:
    """
    A byte count in the largest binary unit that keeps it at or above 1.
    """
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render_models(answer: dict[str, Any], now: float) -> str:
    """
    One row per model and node holding it (a model no node holds: one row
    with node "-"), named by the deployments that use it, else its key.
    """
    rows = []
    for m in answer.get("models", []):
        name = ", ".join(m.get("deployments") or []) or m.get("key", "?")
        nodes = m.get("nodes") or []
        if not nodes:
            rows.append([name, m.get("source", ""), "-", size_text(m.get("size")), "absent", "-"])
        for n in nodes:
            rows.append([name, m.get("source", ""), n.get("node"), size_text(n.get("size")),
                         n.get("state"), ago(n.get("last_used"), now)])
    if not rows:
        return "no models cached and no deployment names a source\n"
    return table(["MODEL", "SOURCE", "NODE", "SIZE", "STATE", "LAST USED"], rows)


def cmd_models(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               http: HTTPFunction | None = None, now: float | None = None) -> int:
    if args.action == "pull":
        if not args.model:
            (err if err is not None else sys.stderr).write("llmgw ctl models pull: name the MODEL\n")
            return EXIT_USAGE
        return _pull(args, out, err, http)
    if args.model or args.nodes:
        (err if err is not None else sys.stderr).write(
            "llmgw ctl models: MODEL and --node go with pull (llmgw ctl models pull MODEL --node N)\n")
        return EXIT_USAGE

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get("/api/v1/models")
        t = now if now is not None else time.time()
        return answer, lambda: render_models(answer, t)

    return _run(args, out, err, http, body)


def _pull(args: argparse.Namespace, out: TextIO | None, err: TextIO | None,
          http: HTTPFunction | None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.post(f"/api/v1/deployments/{quote(args.model, safe='')}/pull",
                             {"nodes": list(args.nodes)})
        told = ", ".join(answer.get("nodes") or []) or "no node"
        return answer, lambda: f"{args.model}: weights being staged on {told}\n"

    return _run(args, out, err, http, body)
