"""
C{llmgw ctl rollout status|pause|resume|undo MODEL}: a deployment's
rollout of a changed launch spec, from C{GET
/api/v1/deployments/MODEL/rollout} and C{POST .../rollout/ACTION}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote

from llmgw.ctl.fleet import AdminClient, HTTPFunction, _run

ACTIONS = ("status", "pause", "resume", "undo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="status: where it is; pause: start no further step; resume: go on (or "
                        "retry a failed one); undo: roll back to the previous launch spec")
    parser.add_argument("model", metavar="MODEL", help="the deployment's model")


def render(answer: Any) -> str:
    """
    The status the API answered, as a line (and the spec new replicas are
    placed from).
    """
    if not isinstance(answer, dict):
        return f"{answer!r}\n"
    text = str(answer.get("text") or "no rollout")
    extra = [f"placing {answer.get('version')}"]
    if answer.get("pinned"):
        extra.append("pinned by an undo")
    return f"{answer.get('model')}: {text}; " + ", ".join(extra) + "\n"


def cmd_rollout(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                http: HTTPFunction | None = None, now: float | None = None) -> int:
    path = f"/api/v1/deployments/{quote(args.model, safe='')}/rollout"

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get(path) if args.action == "status" else client.post(f"{path}/{args.action}")
        return answer, lambda: render(answer)

    return _run(args, out, err, http, body)
