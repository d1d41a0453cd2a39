"""
C{llmgw ctl deploy MODEL ...} and C{llmgw ctl undeploy MODEL}: add or
change a deployment, or remove it, where the control plane keeps its
catalog (C{PUT} and C{DELETE /api/v1/deployments/MODEL}; the file, or etcd
when HA), refused with the catalog file's own message.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote

from llmgw.ctl.fleet import AdminClient, HTTPFunction, _run


def _field(text: str) -> tuple[str, Any]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIELD=VALUE")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value  # a bare word is a string


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the model clients ask for")
    parser.add_argument("--profile", help="the profile it runs on (its engine and GPUs)")
    parser.add_argument("--source", help="where the weights come from: hf://ORG/REPO[@REV], https://..., file:///...")
    parser.add_argument("--file", help="the one file of an hf source a llama.cpp profile loads (NAME.gguf)")
    parser.add_argument("--replicas", type=int, help="a fixed replica count")
    parser.add_argument("--min", dest="min_replicas", type=int, help="autoscale: fewest replicas")
    parser.add_argument("--max", dest="max_replicas", type=int, help="autoscale: most replicas")
    parser.add_argument("--set", dest="fields", type=_field, action="append", default=[], metavar="FIELD=VALUE",
                        help="any other field of the deployment's catalog table (VALUE as JSON, or a word)")


def entry(args: argparse.Namespace) -> dict[str, Any]:
    """
    The deployment's table the arguments describe.
    """
    table: dict[str, Any] = dict(args.fields)
    for name in ("profile", "source", "file", "replicas", "min_replicas", "max_replicas"):
        if getattr(args, name) is not None:
            table[name] = getattr(args, name)
    return table


def cmd_deploy(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               http: HTTPFunction | None = None, now: float | None = None) -> int:
    path = f"/api/v1/deployments/{quote(args.model, safe='')}"

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.put(path, entry(args))
        changes = answer.get("changes") or {}
        what = "added" if args.model in changes.get("added", ()) else "set"
        return answer, lambda: f"{args.model}: {what} in {answer.get('stored')}\n"

    return _run(args, out, err, http, body)


def cmd_undeploy(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                 http: HTTPFunction | None = None, now: float | None = None) -> int:
    path = f"/api/v1/deployments/{quote(args.model, safe='')}"

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.delete(path)
        return answer, lambda: f"{args.model}: removed from {answer.get('stored')}; its replicas stop\n"

    return _run(args, out, err, http, body)
