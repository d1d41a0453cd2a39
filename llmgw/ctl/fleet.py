"""
``llmgw ctl status|nodes|deployments|replicas|events|cordon|uncordon|drain|scale|retry|reload|usage``:
the operator's view of the admin API (DESIGN §9).

Each command makes one or two requests to the control plane's admin API
(C{--admin URL}, default C{$LLMGW_ADMIN_URL}, C{$LLMGW_ADMIN} or
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

Against an HA control plane (issue 14) any member's URL does: one that does
not lead answers fleet reads and writes with C{307} to the leader's admin
URL, which the ctl follows (at most L{MAX_REDIRECTS} hops, with the same
certificate, never from C{https} to C{http}); C{status} is each member's own.

This is a plain blocking client (C{urllib}, no reactor): it runs once and
exits. It ignores C{http_proxy} and friends, because the admin API is
normally on loopback, and a proxy would see (or fake) the fleet's state.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TextIO
from urllib.parse import quote, urljoin, urlsplit

from llmgw.tlsconf.options import TLSConfigError, admin_files
from llmgw.wire import InvalidNodeId, validate_node_id

DEFAULT_ADMIN_URL = "http://127.0.0.1:7480"
ADMIN_ENV = "LLMGW_ADMIN_URL"
#: The older name of L{ADMIN_ENV}, still read.
ADMIN_ENV_OLD = "LLMGW_ADMIN"
CERTS_ENV = "LLMGW_ADMIN_CERTS"
AS_ENV = "LLMGW_ADMIN_AS"
DEFAULT_TIMEOUT = 10.0
#: Largest answer read from the admin API, in bytes.
MAX_ANSWER = 128 * 1024 * 1024

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_SERVER = 4

#: C{http(method, url, body, timeout) -> (status, body)}; raises
#: L{Unreachable} when no answer comes.
HTTPFunction = Callable[[str, str, bytes | None, float], tuple[int, bytes]]


class Unreachable(Exception):
    """
    No HTTP answer came from the control plane.
    """


class Redirected(Exception):
    """
    The admin API answered C{307} or C{308} with C{location}: a member of
    an HA control plane that does not lead sends the request to the leader
    (issue 14 item 5).
    """

    def __init__(self, status: int, location: str):
        super().__init__(f"HTTP {status} to {location}")
        self.status = status
        self.location = location


#: Redirects one request follows at most (a member that does not lead sends
#: the client to the leader: one hop; more means members disagree).
MAX_REDIRECTS = 3


class CtlError(Exception):
    """
    A command ends with C{exit_code}; C{message} goes to stderr and C{body}
    (if any) is what C{--json} prints.
    """

    def __init__(self, exit_code: int, message: str, body: Any = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message
        self.body = body


def admin_ssl_context(certs_dir: str, name: str) -> ssl.SSLContext:
    """
    A TLS client context for the admin API: trust every root in
    C{certs_dir/ca.pem}, present C{admin-NAME.pem/.key}, check the server's
    name, TLS 1.2 at least. The files are checked first by the project's
    loader (expiry, key, issuer), so a mistake is named before dialling.

    @raise TLSConfigError: naming the file and what is wrong.
    """
    files = admin_files(certs_dir, name)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=str(files.ca_path))
    context.load_cert_chain(str(files.cert_path), str(files.key_path))
    return context


def urllib_http(
    method: str, url: str, body: bytes | None, timeout: float,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    """
    One request with C{urllib}, without proxies; over TLS with C{context}
    for an C{https://} URL. A C{307}/C{308} is not followed here: it raises
    L{Redirected}, which L{AdminClient} follows.

    @raise Unreachable: no HTTP answer (connection refused, timeout, a
        refused TLS handshake, ...).
    """
    handlers: list[Any] = [urllib.request.ProxyHandler({}), _NoRedirect()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(
        url,
        data=body,
        method=method,
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "llmgw-ctl",
        },
    )
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read(MAX_ANSWER)
    except urllib.error.HTTPError as e:
        try:
            location = e.headers.get("Location") if e.headers is not None else None
            if e.code in (307, 308) and location:
                raise Redirected(e.code, location) from None
            return e.code, e.read(MAX_ANSWER)
        finally:
            e.close()
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            raise Unreachable(
                f"TLS: {e.reason.verify_message or e.reason} (is the control plane's certificate "
                "from the CA in --certs, and does it name the host in --admin? "
                "`llmgw ctl cert server --host HOST --renew` adds a name)"
            ) from e
        raise Unreachable(str(e.reason)) from e
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(str(e) or type(e).__name__) from e


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class AdminClient:
    """
    The admin API over an L{HTTPFunction}.
    """

    def __init__(self, base_url: str, http: HTTPFunction = urllib_http, timeout: float = DEFAULT_TIMEOUT):
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout = timeout

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: Any = None) -> Any:
        return self._call("POST", path, json.dumps(body if body is not None else {}).encode())

    def _call(self, method: str, path: str, body: bytes | None) -> Any:
        url = self.base_url + path
        status, raw, url = self._follow(method, url, body)
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if 200 <= status < 300:
            if answer is None:
                raise CtlError(
                    EXIT_SERVER,
                    f"{method} {url} answered {status} with something that is not JSON: "
                    "is --admin the control plane's admin API?",
                    {"error": "the answer is not JSON", "status": status},
                )
            return answer
        reason = answer.get("error") if isinstance(answer, dict) else None
        if not isinstance(reason, str):
            reason = _clean(raw[:200].decode("utf-8", "replace")) or "(no reason given)"
        body_out = answer if isinstance(answer, dict) else {"error": reason, "status": status}
        if 400 <= status < 500:
            raise CtlError(EXIT_REFUSED, f"the control plane refused: {reason} (HTTP {status})", body_out)
        raise CtlError(EXIT_SERVER, f"the control plane failed: {reason} (HTTP {status})", body_out)

    def _follow(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes, str]:
        """
        One request, following up to L{MAX_REDIRECTS} C{307}/C{308}
        answers (same method, body, TLS context and admin certificate); a
        redirect from C{https} to anything else is refused, so that no
        request leaves mutual TLS. Returns the status, body and the URL
        that answered.

        @raise CtlError: unreachable, or redirected too often or elsewhere.
        """
        for _ in range(MAX_REDIRECTS + 1):
            try:
                status, raw = self.http(method, url, body, self.timeout)
                return status, raw, url
            except Unreachable as e:
                where = urlsplit(url)
                raise CtlError(
                    EXIT_UNREACHABLE,
                    f"cannot reach the control plane at {where.scheme}://{where.netloc}: {e}",
                    {"error": f"cannot reach the control plane: {e}", "status": None},
                ) from None
            except Redirected as r:
                target = urljoin(url, r.location)
                scheme = urlsplit(target).scheme
                if scheme not in ("http", "https") or (urlsplit(url).scheme == "https" and scheme != "https"):
                    raise CtlError(
                        EXIT_SERVER,
                        f"{method} {url} was redirected to {_clean(target[:200])}, which is not "
                        + ("https (the request would leave TLS)" if scheme == "http" else "an http(s) URL")
                        + "; refusing to follow",
                        {"error": "redirect refused", "status": r.status},
                    ) from None
                url = target
        raise CtlError(
            EXIT_SERVER,
            f"{method} was redirected more than {MAX_REDIRECTS} times (last to {_clean(url[:200])}): "
            "do the control-plane members agree on the leader? `llmgw ctl status` on each says",
            {"error": "too many redirects", "status": None},
        )


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
        "--admin",
        type=admin_url,
        default=os.environ.get(ADMIN_ENV) or os.environ.get(ADMIN_ENV_OLD) or DEFAULT_ADMIN_URL,
        metavar="URL",
        help=f"the control plane's admin API (default ${ADMIN_ENV} or {DEFAULT_ADMIN_URL}); "
        "https:// for one behind mutual TLS",
    )
    common.add_argument(
        "--certs", default=os.environ.get(CERTS_ENV), metavar="DIR",
        help=f"with an https:// --admin: the directory with ca.pem and admin-NAME.pem/.key "
        f"(default ${CERTS_ENV})",
    )
    common.add_argument(
        "--as", dest="as_name", default=os.environ.get(AS_ENV), metavar="NAME",
        help=f"with an https:// --admin: whose admin certificate to present (default ${AS_ENV})",
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
        p.add_argument("node", type=node_id, metavar="NODE")
    p = add("scale", "set a deployment's desired replica count, or an autoscaled one's bounds with "
                     "--min/--max (kept across restarts)", cmd_scale)
    p.add_argument("model", metavar="MODEL")
    p.add_argument("replicas", type=replica_count, metavar="REPLICAS", nargs="?", default=None)
    p.add_argument("--min", dest="min_replicas", type=replica_count, default=None, metavar="N",
                   help="an autoscaled deployment's fewest replicas (0: it may scale to zero)")
    p.add_argument("--max", dest="max_replicas", type=replica_count, default=None, metavar="N",
                   help="an autoscaled deployment's most replicas")
    _count_or_bounds(p)
    p = add("retry", "place a held deployment again (after a configuration failure), clearing its backoff",
            cmd_retry)
    p.add_argument("model", metavar="MODEL")

    from llmgw.ctl import watch

    p = add("watch", "print the fleet's changes live, from the admin API's watch stream", watch.cmd_watch)
    watch.add_arguments(p)
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
  4  the control plane answered with a failure, or not with the admin API's JSON"""


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
    client = AdminClient(args.admin, http, args.timeout)
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
        # ha4: a member that does not lead answered from what the leader
        # published: say how fresh it is (on stderr: the table stays as is).
        err.write(f"llmgw ctl {args.ctl_command}: answered by a control-plane member that does not lead, "
                  f"from what leader {answer.get('published_by')} published at "
                  f"{_when(answer['published_at'])}\n")
    return EXIT_OK


def _when(t: Any) -> str:
    import datetime

    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
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
        )

    return _run(args, out, err, http, body)


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


# -- rendering ----------------------------------------------------------------------------


def _clean(text: str) -> str:
    """
    C{text} on one line with control characters escaped: what reaches the
    terminal from a node or a model process cannot move the cursor or
    change colours.
    """
    text = text.replace("\r\n", " ").replace("\n", " ").replace("\t", " ")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, dict):
        return " ".join(f"{_clean(str(k))}={_value(x)}" for k, x in v.items()) or "-"
    if isinstance(v, list | tuple):
        return ", ".join(_value(x) for x in v) or "-"
    return _clean(str(v))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """
    Left-aligned columns two spaces apart; the last column is not padded.
    """
    cells = [[_value(c) if not isinstance(c, str) else _clean(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    lines = []
    for row in [list(headers), *cells]:
        parts = [c.ljust(widths[i]) for i, c in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def ago(when: Any, now: float) -> str:
    if not isinstance(when, int | float) or isinstance(when, bool) or when <= 0:
        return "-"
    d = now - when
    if d < 0:
        return "in " + _duration(-d)
    return _duration(d) + " ago"


def _duration(d: float) -> str:
    if d < 120:
        return f"{d:.0f}s"
    if d < 7200:
        return f"{d / 60:.0f}m"
    if d < 172800:
        return f"{d / 3600:.0f}h"
    return f"{d / 86400:.0f}d"


def clock_time(when: Any) -> str:
    if not isinstance(when, int | float) or isinstance(when, bool):
        return "-"
    return datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")


def render_status(admin: str, status: dict[str, Any], deployments: list[dict[str, Any]], now: float) -> str:
    lines = [f"control plane  {admin}"]
    if status.get("replacements_frozen"):
        reason = status.get("frozen_reason") or status.get("frozen_because") or ""
        lines.append("WARNING        replacements are FROZEN" + (f": {_clean(str(reason))}" if reason else ""))
    skip = {"frozen_reason", "frozen_because"}
    width = max([len(k) for k in status if k not in skip] + [13])
    for key, value in status.items():
        if key in skip:
            continue
        lines.append(f"{_clean(key).ljust(width)}  {_value(value)}")
    for d in deployments:
        if isinstance(d.get("held"), dict):
            lines.append(f"WARNING        deployment {_clean(str(d['model']))} is HELD after a "
                         f"{_clean(str(d['held'].get('crash_class') or '?'))} failure; "
                         f"`llmgw ctl retry {_clean(str(d['model']))}` places it again")
    lines.append("")
    lines.append(render_deployments(deployments, now).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _failure_text(failure: Any, now: float) -> str:
    if not isinstance(failure, dict):
        return "-"
    what = failure.get("error") or (
        f"exit {failure.get('exit_code')}" if failure.get("exit_code") else
        f"signal {failure.get('signal')}" if failure.get("signal") else "failed"
    )
    cls = failure.get("crash_class")
    return f"{ago(failure.get('time'), now)} on {failure.get('node') or '?'}: " + (
        f"[{cls}] {what}" if cls else str(what)
    )


def _held_text(held: Any, now: float) -> str:
    if not isinstance(held, dict):
        return "-"
    reason = held.get("reason")
    return f"since {ago(held.get('since'), now)} [{held.get('crash_class') or '?'}]" + (
        f": {reason}" if reason else ""
    )


def render_deployments(deployments: list[dict[str, Any]], now: float) -> str:
    """
    One row a deployment; a held one says so with its class and reason,
    and the last failure shows its class.
    """
    if not deployments:
        return "no deployments\n"
    rows = []
    for d in deployments:
        backoff = d.get("backoff_until")
        backoff_text = ago(backoff, now) if isinstance(backoff, int | float) and backoff > now else "-"
        desired: Any = d.get("desired")
        auto = d.get("autoscale")
        if isinstance(auto, dict):
            desired = f"{desired} (auto {auto.get('min_replicas')}-{auto.get('max_replicas')})"
        rows.append([d["model"], d.get("profile"), desired, d.get("ready"), backoff_text,
                     _held_text(d.get("held"), now), _failure_text(d.get("last_failure"), now)])
    return table(["MODEL", "PROFILE", "DESIRED", "READY", "BACKOFF", "HELD", "LAST FAILURE"], rows)


def render_nodes(nodes: list[dict[str, Any]], now: float) -> str:
    if not nodes:
        return "no nodes\n"
    rows = []
    for n in nodes:
        gpus = n.get("gpus") or []
        total = sum(g.get("memory_total_mb", 0) for g in gpus)
        used = sum(g.get("memory_used_mb", 0) for g in gpus)
        problems = [f"gpu{g.get('index')}: {', '.join(map(str, g['problems']))}" for g in gpus if g.get("problems")]
        sched = "draining" if n.get("draining") else "cordoned" if n.get("cordoned") else "ok"
        rows.append([
            n["id"], n.get("state"), bool(n.get("connected")), sched, len(gpus),
            f"{(total - used) / 1024:.0f}/{total / 1024:.0f} GiB", len(n.get("shards") or []),
            ago(n.get("last_seen"), now), _strays_text(n.get("stray_processes")), "; ".join(problems) or "-",
        ])
    return table(["NODE", "STATE", "CONNECTED", "SCHEDULING", "GPUS", "MEM FREE", "SHARDS", "LAST SEEN",
                  "STRAYS", "PROBLEMS"], rows)


def _strays_text(strays: Any) -> str:
    """
    A node's stray processes as C{pid (shard)} items, at most five shown.
    """
    if not isinstance(strays, list) or not strays:
        return "-"
    items = [f"{s.get('pid')} ({s.get('shard_id') or '?'})" for s in strays[:5] if isinstance(s, dict)]
    more = len(strays) - 5
    return ", ".join(items) + (f" +{more} more" if more > 0 else "")


def render_replicas(replicas: list[dict[str, Any]]) -> str:
    if not replicas:
        return "no replicas\n"
    rows = []
    for r in replicas:
        shards = sorted(r.get("shards") or [], key=lambda s: s.get("rank", 0))
        leader = shards[0].get("address") if shards else None
        state = str(r.get("state")) + (" (draining)" if r.get("draining") else "")
        signals = shards[0].get("signals") if shards else None
        rows.append([
            r["id"], r.get("model"), r.get("profile"), state, leader or "-",
            *engine_columns(signals),
            " ".join(f"{s.get('node')}/{s.get('rank')}:{s.get('state')}" for s in shards) or "-",
        ])
    return table(["REPLICA", "MODEL", "PROFILE", "STATE", "ADDRESS", "WAITING", "RUNNING", "KV",
                  "SIGNALS AGE", "SHARDS (NODE/RANK:STATE)"], rows)


def engine_columns(signals: dict[str, Any] | None) -> list[str]:
    """
    The leader's engine signals as table cells: waiting, running, KV-cache
    use, and their age ("-" where the engine has no such figure; the age
    says "stale" with the scrape's error when the last scrape failed).
    """
    if not signals:
        return ["-", "-", "-", "-"]

    def count(v: Any) -> str:
        return "-" if v is None else f"{v:g}"

    kv = signals.get("kv_cache_usage")
    age = signals.get("age_s")
    age_text = "-" if age is None else f"{age:.1f}s"
    if signals.get("error"):
        age_text += f" (stale: {signals['error']})"
    return [count(signals.get("waiting")), count(signals.get("running")),
            "-" if kv is None else f"{kv * 100:.0f}%", age_text]


def render_events(events: list[dict[str, Any]]) -> str:
    if not events:
        return "no events\n"
    rows = []
    for e in events:
        reason = str(e.get("reason") or "")
        # An agent's reason says how the process ended ("killed by signal
        # 9"); the figure is added only where it does not.
        if e.get("exit_code"):
            if f"exit code {e['exit_code']}" not in reason:
                reason += f" (exit {e['exit_code']})"
        elif e.get("signal") and f"signal {e['signal']}" not in reason:
            reason += f" (signal {e['signal']})"
        if e.get("crash_class"):
            reason += f" [{e['crash_class']}]"
        rows.append([
            clock_time(e.get("time")), e.get("kind"), e.get("node") or "-",
            e.get("replica") or "-", e.get("shard") or "-", reason,
        ])
    return table(["TIME", "KIND", "NODE", "REPLICA", "SHARD", "REASON"], rows)
