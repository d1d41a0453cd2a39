"""
``llmgw ctl status|nodes|deployments|replicas|events|cordon|uncordon|drain|scale|retry|reload|usage``:
the operator's view of the admin API (DESIGN §9).

Each command makes one or two requests to the control plane's admin API
(C{--admin-url URL}, default C{$LLMGW_ADMIN_URL}, C{$LLMGW_ADMIN} or
C{http://127.0.0.1:7480}) and prints a table, or the API's JSON with
C{--json}.

An C{https://} admin API (mutual TLS) takes an admin certificate:
C{--certs DIR --as NAME} (or C{$LLMGW_ADMIN_CERTS}, C{$LLMGW_ADMIN_AS})
present C{DIR/admin-NAME.pem/.key} and trust the roots in C{DIR/ca.pem};
the control plane's certificate must name the host in the URL.

Exit codes, for scripts:

  - 0: done;
  - 1: the control plane refused the request (a 4xx answer: unknown node or
    model, bad value, refused catalog); the reason is on stderr;
  - 2: usage error (bad arguments; nothing was sent);
  - 3: the control plane cannot be reached (refused connection, timeout,
    DNS failure);
  - 4: the control plane answered but failed (a 5xx answer, or an answer
    that is not the admin API's JSON).

Against an HA control plane any member's URL does: one that does
not lead answers fleet reads and writes with C{307} to the leader's admin
URL, which the ctl follows (at most L{MAX_REDIRECTS} hops, with the same
certificate, never from C{https} to C{http}); C{status} is each member's own.

This is a plain blocking client (C{urllib}, no reactor): it runs once and
exits. It ignores C{http_proxy} and friends, because the admin API is
normally on loopback, and a proxy would see (or fake) the fleet's state.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote, urlsplit

from llmgw.ctl.client import (  # noqa: F401 (the client's names, as before the split)
    ADMIN_ENV,
    ADMIN_ENV_OLD,
    AS_ENV,
    CERTS_ENV,
    DEFAULT_ADMIN_URL,
    DEFAULT_TIMEOUT,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SERVER,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    MAX_ANSWER,
    MAX_REDIRECTS,
    AdminClient,
    CtlError,
    HTTPFunction,
    Redirected,
    Unreachable,
    admin_ssl_context,
    urllib_http,
)
from llmgw.ctl.render import (  # noqa: F401 (the renderers' names, as before the split)
    ago,
    clock_time,
    engine_columns,
    iso_time,
    render_deployments,
    render_events,
    render_nodes,
    render_replicas,
    render_status,
    table,
)
from llmgw.ctl.render import clean as _clean  # noqa: F401
from llmgw.ctl.render import value as _value
from llmgw.options import add_old_name
from llmgw.tlsconf.options import TLSConfigError
from llmgw.wire import InvalidNodeId, validate_node_id

# -- argument types -------------------------------------------------------------------


def admin_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 (checks the port is a number)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
    return value


def node_id(value: str) -> str:
    try:
        return validate_node_id(value)
    except InvalidNodeId as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def replica_count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: the replica count must not be negative")
    return n


def positive_seconds(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not n > 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return n


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def since_spec(value: str) -> str:
    """
    C{--since}: seconds since 1970, or a duration ago (C{90s}, C{10m},
    C{2h}, C{1d}). Checked here, resolved against the clock by
    L{resolve_since}.
    """
    resolve_since(value, 0.0)
    return value


def resolve_since(value: str, now: float) -> float:
    v = value.strip()
    try:
        if v and v[-1] in _UNITS:
            n = float(v[:-1])
            if n < 0 or n != n or n == float("inf"):
                raise ValueError
            return now - n * _UNITS[v[-1]]
        n = float(v)
        if n != n or n in (float("inf"), float("-inf")):
            raise ValueError
        return n
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give seconds since 1970, or a duration ago such as 90s, 10m, 2h, 1d"
        ) from None


# -- parsers --------------------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--admin-url",
        dest="admin",
        type=admin_url,
        default=os.environ.get(ADMIN_ENV) or os.environ.get(ADMIN_ENV_OLD) or DEFAULT_ADMIN_URL,
        metavar="URL",
        help=f"the control plane's admin API (default ${ADMIN_ENV} or {DEFAULT_ADMIN_URL}); "
        "https:// for one behind mutual TLS",
    )
    add_old_name(common, "admin", "admin-url", "admin", type=admin_url, metavar="URL")
    common.add_argument(
        "--certs", default=os.environ.get(CERTS_ENV), metavar="DIR",
        help=f"with an https:// --admin-url: the directory with ca.pem and admin-NAME.pem/.key "
        f"(default ${CERTS_ENV})",
    )
    common.add_argument(
        "--as", dest="as_name", default=os.environ.get(AS_ENV), metavar="NAME",
        help=f"with an https:// --admin-url: whose admin certificate to present (default ${AS_ENV})",
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    common.add_argument(
        "--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
        help=f"give up on the control plane after this long (default {DEFAULT_TIMEOUT:g})",
    )

    def add(name: str, help: str, func: Callable[..., int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, parents=[common], description=help + ".",
                           epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    add("status", "summary of the fleet and each deployment", cmd_status)
    add("nodes", "nodes: state, GPUs, shards, last heard from, stray processes", cmd_nodes)
    add("deployments", "deployments: replicas, backoff, hold, last failure and its class", cmd_deployments)
    p = add("replicas", "replicas: state, address, shards", cmd_replicas)
    p.add_argument("--model", help="only this model's replicas")
    p = add("events", "the reconciler's recent decisions, oldest first", cmd_events)
    p.add_argument("--since", type=since_spec, metavar="WHEN",
                   help="seconds since 1970, or a duration ago (90s, 10m, 2h, 1d)")
    p.add_argument("--limit", type=int, metavar="N", help="only the last N events")
    for name, help in (
        ("cordon", "keep new placements off a node"),
        ("uncordon", "let placements onto a node again"),
        ("drain", "cordon a node and move its replicas off it, make-before-break"),
    ):
        p = add(name, help, cmd_node_action)
        p.add_argument("node", type=node_id, metavar="NODE", help="the node's id")
    p = add("scale", "set a deployment's desired replica count, or an autoscaled one's bounds with "
                     "--min/--max (kept across restarts)", cmd_scale)
    p.add_argument("model", metavar="MODEL", help="the deployment's model")
    p.add_argument("replicas", type=replica_count, metavar="REPLICAS", nargs="?", default=None,
                   help="the desired replica count (not with --min/--max)")
    p.add_argument("--min", dest="min_replicas", type=replica_count, default=None, metavar="N",
                   help="an autoscaled deployment's fewest replicas (0: it may scale to zero)")
    p.add_argument("--max", dest="max_replicas", type=replica_count, default=None, metavar="N",
                   help="an autoscaled deployment's most replicas")
    _count_or_bounds(p)
    p = add("retry", "place a held deployment again (after a configuration failure), clearing its backoff",
            cmd_retry)
    p.add_argument("model", metavar="MODEL", help="the held deployment's model")

    from llmgw.ctl import watch

    p = add("watch", "print the fleet's changes live, from the admin API's watch stream", watch.cmd_watch)
    watch.add_arguments(p)
    from llmgw.ctl import models

    p = add("models", "which model's weights each node caches, their size, state and last use; "
                      "'models pull MODEL [--node N]...' stages them", models.cmd_models)
    models.add_arguments(p)
    from llmgw.ctl import rollout

    p = add("rollout", "a deployment's rollout of a changed profile: status, pause, resume, undo",
            rollout.cmd_rollout)
    rollout.add_arguments(p)
    from llmgw.ctl import deploy

    p = add("deploy", "add or change a deployment in the control plane's catalog (the file, or etcd "
                      "when HA), checked as the catalog file is", deploy.cmd_deploy)
    deploy.add_arguments(p)
    p = add("undeploy", "remove a deployment from the control plane's catalog", deploy.cmd_undeploy)
    p.add_argument("model", metavar="MODEL", help="the deployment's model")
    from llmgw.ctl import csr

    p = add("csr", "certificate requests waiting for an operator: list, approve NODE (signed here, "
                   "where the CA's key is), deny NODE", csr.cmd_csr)
    csr.add_arguments(p)
    from llmgw.ctl import usage

    p = add("usage", "requests and tokens per API key and model, and the keys' limits", usage.cmd_usage)
    usage.add_arguments(p)
    p = add("reload", "re-read the catalog file (a refused catalog leaves the running one)", cmd_reload)
    p.add_argument(
        "--tls", action="store_true",
        help="re-read the control plane's certificate, key, CA bundle and CRL instead",
    )


EXIT_CODES_HELP = """exit codes:
  0  done
  1  the control plane refused the request (the reason is printed)
  2  usage error (nothing was sent)
  3  the control plane cannot be reached
  4  the control plane answered with a failure, or not with the admin API's JSON
  130  interrupted (Ctrl-C)
  141  the output's reader went away (`llmgw ctl ... | head`)"""


# -- running ----------------------------------------------------------------------------


def _run(
    args: argparse.Namespace,
    out: TextIO | None,
    err: TextIO | None,
    http: HTTPFunction | None,
    body: Callable[[AdminClient], tuple[Any, Callable[[], str]]],
) -> int:
    """
    Run one command: C{body(client)} returns the JSON to print with
    C{--json} and a function rendering the table otherwise.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if http is None:
        try:
            http = _http_for(args)
        except CtlError as e:
            err.write(f"llmgw ctl {args.ctl_command}: {e.message}\n")
            return e.exit_code
    says = err

    def redirected(note: str) -> None:
        # Which member leads is worth knowing: on stderr, the answer stays as is.
        says.write(f"llmgw ctl {args.ctl_command}: {note}\n")

    client = AdminClient(args.admin, http, args.timeout, on_redirect=redirected)
    try:
        answer, render = body(client)
        text = json.dumps(answer, indent=2) + "\n" if args.json else render()
    except CtlError as e:
        err.write(f"llmgw ctl {args.ctl_command}: {e.message}\n")
        if args.json and e.body is not None:
            out.write(json.dumps(e.body, indent=2) + "\n")
        return e.exit_code
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        # The answer is JSON but not the shape this ctl knows.
        err.write(
            f"llmgw ctl {args.ctl_command}: unexpected answer from {args.admin} "
            f"({type(e).__name__}: {e}); try --json\n"
        )
        return EXIT_SERVER
    out.write(text)
    if not args.json and isinstance(answer, dict) and "published_at" in answer:
        # A member that does not lead answered from what the leader
        # published: say how fresh it is (on stderr: the table stays as is).
        err.write(f"llmgw ctl {args.ctl_command}: answered by a control-plane member that does not lead, "
                  f"from what leader {answer.get('published_by')} published at "
                  f"{_when(answer['published_at'])}\n")
    return EXIT_OK


def _when(t: Any) -> str:
    try:
        return iso_time(float(t))
    except (TypeError, ValueError):
        return repr(t)[:40]


def _http_for(args: argparse.Namespace) -> HTTPFunction:
    """
    The HTTP function for C{args.admin}: plain, or mutual TLS with the
    admin certificate C{--certs}/C{--as} names.

    @raise CtlError: an https:// URL without a certificate, or certificate
        files that are refused (usage error: nothing was sent).
    """
    if urlsplit(args.admin).scheme != "https":
        return urllib_http
    certs, name = getattr(args, "certs", None), getattr(args, "as_name", None)
    if not certs or not name:
        raise CtlError(
            EXIT_USAGE,
            f"{args.admin} is https: give the admin certificate with --certs DIR and --as NAME "
            f"(or ${CERTS_ENV} and ${AS_ENV}); `llmgw ctl cert admin NAME --role ...` issues one",
        )
    try:
        context = admin_ssl_context(certs, name)
    except (TLSConfigError, ssl.SSLError, OSError) as e:
        raise CtlError(EXIT_USAGE, f"admin certificate {name!r} in {certs}: {e}") from None

    def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        return urllib_http(method, url, body, timeout, context)

    return http


def cmd_status(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        status = client.get("/api/v1/status")
        deployments = client.get("/api/v1/deployments")["deployments"]
        t = now if now is not None else time.time()
        return {"status": status, "deployments": deployments}, lambda: render_status(
            args.admin, status, deployments, t
        ) + _catalog_file_warning(status)

    return _run(args, out, err, http, body)


def _catalog_file_warning(status: Any) -> str:
    """
    A line for an HA member whose catalog file differs from etcd's (which
    it runs), else nothing.
    """
    ha = status.get("ha") if isinstance(status, dict) else None
    check = ha.get("catalog_file") if isinstance(ha, dict) else None
    if not isinstance(check, dict) or check.get("differs_from_etcd") is not True:
        return ""
    path = _clean(str(check.get("path")))
    return (f"WARNING        catalog file {path} differs from the catalog in etcd (revision "
            f"{_clean(str(check.get('etcd_revision')))}), which runs: `llmgw ctl catalog apply {path}` "
            "stores the file's\n")


def cmd_deployments(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                    http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get("/api/v1/deployments")
        t = now if now is not None else time.time()
        return answer, lambda: render_deployments(answer["deployments"], t)

    return _run(args, out, err, http, body)


def cmd_nodes(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get("/api/v1/nodes")
        t = now if now is not None else time.time()
        return answer, lambda: render_nodes(answer["nodes"], t)

    return _run(args, out, err, http, body)


def cmd_replicas(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                 http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.get("/api/v1/replicas")
        if args.model is not None:
            answer = {**answer, "replicas": [r for r in answer["replicas"] if r.get("model") == args.model]}
        return answer, lambda: render_replicas(answer["replicas"])

    return _run(args, out, err, http, body)


def cmd_events(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        t = now if now is not None else time.time()
        path = "/api/v1/events"
        if args.since is not None:
            path += f"?since={resolve_since(args.since, t)!r}"
        answer = client.get(path)
        if args.limit is not None:
            answer = {**answer, "events": answer["events"][-args.limit:] if args.limit > 0 else []}
        return answer, lambda: render_events(answer["events"])

    return _run(args, out, err, http, body)


def _count_or_bounds(parser: argparse.ArgumentParser) -> None:
    """
    Make C{ctl scale} a usage error (exit 2, nothing sent) unless it is
    given a replica count or --min/--max, not both.
    """
    plain = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, extra = plain(args, namespace)
        bounds = ns.min_replicas is not None or ns.max_replicas is not None
        if bounds == (ns.replicas is not None):
            parser.error("give either a replica count or --min/--max (an autoscaled deployment's bounds), "
                         + ("not both" if bounds else "one of them"))
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def cmd_node_action(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                    http: HTTPFunction | None = None, now: float | None = None) -> int:
    action = args.ctl_command
    done = {"cordon": "cordoned", "uncordon": "uncordoned", "drain": "draining"}[action]

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.post(f"/api/v1/nodes/{quote(args.node, safe='')}/{action}")
        return answer, lambda: f"node {args.node} {done}\n"

    return _run(args, out, err, http, body)


def cmd_scale(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              http: HTTPFunction | None = None, now: float | None = None) -> int:
    low, high = getattr(args, "min_replicas", None), getattr(args, "max_replicas", None)
    bounds = low is not None or high is not None
    if bounds == (args.replicas is not None):
        (err if err is not None else sys.stderr).write(
            f"llmgw ctl scale: give either a replica count or --min/--max (an autoscaled deployment's "
            f"bounds), {'not both' if bounds else 'one of them'}\n")
        return EXIT_USAGE
    path = f"/api/v1/deployments/{quote(args.model, safe='')}/scale"

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        if not bounds:
            answer = client.post(path, {"replicas": args.replicas})
            return answer, lambda: f"{args.model}: desired replicas set to {args.replicas}\n"
        lo, hi = low, high
        if lo is None or hi is None:
            # The bound not given stays as it is.
            views = client.get("/api/v1/deployments")["deployments"]
            auto = next((d.get("autoscale") for d in views if d.get("model") == args.model), None)
            if auto:
                lo = auto["min_replicas"] if lo is None else lo
                hi = auto["max_replicas"] if hi is None else hi
            else:
                lo, hi = (lo if lo is not None else 0), (hi if hi is not None else 0)
        answer = client.post(path, {"min": lo, "max": hi})
        return answer, lambda: f"{args.model}: autoscales between {lo} and {hi} replicas\n"

    return _run(args, out, err, http, body)


def cmd_retry(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        answer = client.post(f"/api/v1/deployments/{quote(args.model, safe='')}/retry")
        return answer, lambda: f"{args.model}: hold and backoff cleared; it is placed again\n"

    return _run(args, out, err, http, body)


def cmd_reload(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               http: HTTPFunction | None = None, now: float | None = None) -> int:
    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        if getattr(args, "tls", False):
            answer = client.post("/api/v1/tls/reload")
            return answer, lambda: (
                f"TLS reloaded: server certificate serial {_value(answer.get('server_serial'))}, "
                f"CRL number {_value(answer.get('crl_number'))}, "
                f"{len(answer.get('closed') or [])} revoked streams closed\n"
            )
        answer = client.post("/api/v1/catalog/reload")
        return answer, lambda: "catalog reloaded: " + _value(answer.get("changes")) + "\n"

    return _run(args, out, err, http, body)


