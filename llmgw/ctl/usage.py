"""
C{llmgw ctl usage}: requests and tokens per API key and model, and each
key's limits, from C{GET /api/v1/usage}: the control plane's admin API for
its embedded gateway, or a standalone gateway's C{--metrics} address
(C{--admin-url http://127.0.0.1:7481}). A table, or the API's JSON with
C{--json}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from llmgw.ctl.fleet import AdminClient, HTTPFunction, _run, clock_time, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key", metavar="NAME", help="only this API key's rows")
    parser.add_argument("--model", metavar="MODEL", help="only this model's rows")


def render_usage(answer: dict[str, Any]) -> str:
    """
    The counts, one row per key and model, then the limited keys' limits.
    """
    rows = [
        [u["key"], u["model"], u["requests"], u["prompt_tokens"], u["completion_tokens"],
         u["total_tokens"], u.get("unreported", 0), u.get("estimated", 0),
         f"{u.get('limited_requests', 0)}/{u.get('limited_tokens', 0)}"]
        for u in answer["usage"]
    ]
    text = f"usage since {clock_time(answer['since'])}"
    share = answer.get("share", 1.0)
    if share != 1.0:
        text += f" (this gateway enforces {share:g} of each limit)"
    text += "\n"
    if rows:
        text += table(["KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL", "UNREPORTED",
                       "ESTIMATED", "429 (REQ/TOK)"], rows)
    else:
        text += "no requests yet\n"
    limits = answer.get("limits") or []
    if limits:
        text += "\n" + table(
            ["KEY", "REQUESTS/MIN", "AVAILABLE", "TOKENS/MIN", "AVAILABLE"],
            [[lim["key"], _limit(lim, "requests"), lim.get("requests_available"),
              _limit(lim, "tokens"), lim.get("tokens_available")] for lim in limits],
        )
    return text


def _limit(lim: dict[str, Any], kind: str) -> Any:
    configured, here = lim.get(f"{kind}_per_minute"), lim.get(f"{kind}_per_minute_here")
    if configured is None or here is None or here == configured:
        return configured
    return f"{configured} ({here} here)"


def cmd_usage(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              http: HTTPFunction | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get("/api/v1/usage")
        key, model = getattr(args, "key", None), getattr(args, "model", None)
        if key is not None or model is not None:
            answer = {**answer, "usage": [
                u for u in answer["usage"]
                if (key is None or u.get("key") == key) and (model is None or u.get("model") == model)
            ]}
            if key is not None:
                answer["limits"] = [lim for lim in answer.get("limits", []) if lim.get("key") == key]
        return answer, lambda: render_usage(answer)

    return _run(args, out, err, http, body)
